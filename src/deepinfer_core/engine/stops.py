"""Stop strings (``SamplingParams.stop``), with the semantics vLLM users expect.

- Generation stops as soon as the output text contains one of the strings; ``finish_reason`` is ``"stop"``
  and ``stop_reason`` the string that matched.
- The returned text ends before the stop string (``include_stop_str_in_output=True``: after it); text a
  token carried past the stop string is dropped. ``token_ids`` keep every token up to and including the
  one that completed the stop string.
- A stop string matches when a token completes it (the match ends inside that token's text), from the
  ``min_tokens``-th output token on; one that lies wholly inside the first ``min_tokens`` tokens never
  matches (vLLM's incremental check searches only the window the new text can complete, too).
- Of several strings the earliest match in the text wins.

Matching runs on the output *bytes* (each token's bytes from ``Tokenizer.token_bytes()``): UTF-8 is
self-synchronising, so a byte match of a string's UTF-8 encoding on valid UTF-8 is exactly a text match,
and no incremental detokeniser is needed. The text of a stopped request is its bytes up to the cut,
decoded with replacement (as ``ByteTokenizer.decode`` does).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs


@attrs.frozen(slots=True)
class StopHit:
    """Where a request stopped: ``stop`` matched; the text is the first ``cut`` bytes; the output keeps
    its first ``tokens`` token ids."""

    stop: str
    cut: int
    tokens: int


class StopStrings:
    """One request's stop-string state, fed the request's output tokens in order."""

    __slots__ = ("_buf", "_include", "_min_tokens", "_ntok", "_pats", "_stops", "_token_bytes", "hit")

    def __init__(
        self,
        stops: Sequence[str],
        token_bytes: Sequence[bytes],
        *,
        include: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if not stops:
            raise ValueError("SamplingParams.stop: needs at least one string")
        self._stops = tuple(stops)
        self._pats = [s.encode("utf-8") for s in self._stops]
        self._token_bytes = token_bytes
        self._include = include
        self._min_tokens = min_tokens
        self._buf = bytearray()
        self._ntok = 0
        self.hit: StopHit | None = None

    def feed(self, tokens: Iterable[int]) -> StopHit | None:
        """Append ``tokens``; the hit (once one of them completes a stop string), else None."""
        if self.hit is not None:
            return self.hit
        tb, buf = self._token_bytes, self._buf
        for t in tokens:
            t = int(t)
            before = len(buf)
            if 0 <= t < len(tb):
                buf += tb[t]
            self._ntok += 1
            if self._ntok < self._min_tokens or len(buf) == before:
                continue
            best: tuple[int, int] | None = None
            for i, p in enumerate(self._pats):
                at = buf.find(p, max(0, before - len(p) + 1))  # a match ending in this token's bytes
                if at >= 0 and (best is None or at < best[0]):
                    best = (at, i)
            if best is not None:
                at, i = best
                cut = at + len(self._pats[i]) if self._include else at
                self.hit = StopHit(self._stops[i], cut, self._ntok)
                return self.hit
        return None

    def text(self) -> str:
        """The output text up to the cut (all of it while there is no hit)."""
        data = self._buf if self.hit is None else self._buf[: self.hit.cut]
        return bytes(data).decode("utf-8", errors="replace")
