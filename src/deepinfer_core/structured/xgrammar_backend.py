"""The default grammar backend, over xgrammar's public API (``GrammarCompiler`` / ``GrammarMatcher``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from deepinfer_core.extras import require
from deepinfer_core.protocols import Tokenizer
from deepinfer_core.structured._bitmask import check_bitmask
from deepinfer_core.structured.spec import GrammarSpec
from deepinfer_core.structured.vocab import GrammarVocab, grammar_vocab, xgrammar_tokenizer_info

log = logging.getLogger(__name__)


class XGrammarMatcher:
    """One request's grammar state (xgrammar ``GrammarMatcher``).

    EOS is the only stop token, so "terminated" means "the last accepted token was EOS"; tracking that
    here saves a call into xgrammar on every fill (it raises when asked for a mask after EOS).
    """

    __slots__ = ("_done", "_eos", "_m", "_refuse", "_words")

    def __init__(
        self, matcher: Any, words: int, refuse: frozenset[int], eos: int
    ) -> None:  # xgrammar's (untyped)
        self._m = matcher
        self._words = words
        self._refuse = refuse
        self._eos = eos
        self._done = False

    def accept_token(self, token_id: int) -> bool:
        # xgrammar refuses (state unchanged) tokens the grammar rejects, specials, ids out of range,
        # and anything after termination: exactly our contract. Control tokens are refused here first
        # because xgrammar logs a warning line for each one.
        t = int(token_id)
        if t in self._refuse or not self._m.accept_token(t):
            return False
        self._done = t == self._eos
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        check_bitmask(bitmask, row, self._words)
        self.fill_unchecked(bitmask, row)

    def fill_unchecked(self, bitmask: torch.Tensor, row: int) -> None:
        """``fill_next_token_bitmask`` without argument checks (the manager validated its own buffer)."""
        if self._done:  # nothing may follow EOS
            bitmask[row].zero_()
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._m.rollback(int(num_tokens))
            self._done = False  # EOS is always the last token, so any rollback removes it

    def is_terminated(self) -> bool:
        return self._done

    def reset(self) -> None:
        self._m.reset()
        self._done = False

    @property
    def raw(self) -> object:
        """The xgrammar ``GrammarMatcher`` (benchmarks compare against calling it directly)."""
        return self._m


class XGrammarBackend:
    """Compiles :class:`GrammarSpec` s with xgrammar against one tokenizer.

    JSON is compiled compact (``,`` and ``:`` separators, no free whitespace) so both backends accept the
    same language and a random-logit model cannot pad forever with spaces; pass ``json_any_whitespace``
    to allow whitespace. Compiling is thread-safe (the manager runs it on a pool).
    """

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int | None = None,
        compile_threads: int = 1,
        mask_threads: int | None = None,
        json_any_whitespace: bool = False,
    ) -> None:
        xgr = require("xgrammar", "the xgrammar grammar backend")

        self._vocab: GrammarVocab = grammar_vocab(tokenizer, vocab_size)
        self._info = xgrammar_tokenizer_info(self._vocab)
        # The manager caches compiled grammars by spec; xgrammar's own cache would duplicate memory.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=compile_threads, cache_enabled=False)
        self._json_any_ws = json_any_whitespace
        self._refuse = self._vocab.special_ids - {self._vocab.eos_token_id}
        # Batch mask filling on xgrammar's own threads ("auto": half the hardware threads).
        self._batch = xgr.BatchGrammarMatcher(mask_threads if mask_threads else "auto")
        self._xgr = xgr
        # The manager's fast path calls the C++ handles under xgrammar's Python classes directly: the
        # public batch call rebuilds a list of handles per call (~3 us at batch 1, ~60 ns a matcher).
        # Both are private names, so without them (another xgrammar version) the manager keeps the
        # public-API path.
        self._batch_handle = getattr(self._batch, "_handle", None)
        # "xgrammar": the manager's C++ fast path (fastfill.cpp) calls fill_keys and steps the handles.
        self.fast_fill_kind: str | None = None
        if self._batch_handle is not None:  # the bound library call itself: no Python frame of ours
            # the bound library call replaces the method on this instance (fewer frames per call)
            self.fill_keys = self._batch_handle.batch_fill_next_token_bitmask  # type: ignore[method-assign]
            self.fast_fill_kind = "xgrammar"
        self._eos = self._vocab.eos_token_id
        # For the manager's draft loop, which steps handles inline: refused ids (controls) and EOS.
        self.key_refuse: frozenset[int] = frozenset(self._refuse)
        self.key_eos = self._eos

    @property
    def vocab_size(self) -> int:
        return self._vocab.vocab_size

    @property
    def vocab(self) -> GrammarVocab:
        """Token bytes, control ids and EOS this backend was built from (the manager's UTF-8 filter)."""
        return self._vocab

    def json_whitespace(self, spec: GrammarSpec) -> bool:
        """Whether a JSON document of ``spec`` may contain whitespace between its tokens."""
        return bool(spec.options_for("xgrammar").get("any_whitespace", self._json_any_ws))

    @property
    def eos_token_id(self) -> int:
        return self._vocab.eos_token_id

    def compile(self, spec: GrammarSpec) -> object:
        spec = GrammarSpec.of(spec)
        c = self._compiler
        try:
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "json_schema":
                opts = spec.options_for("xgrammar")
                ws = bool(opts.pop("any_whitespace", self._json_any_ws))
                seps = None if ws else (",", ":")
                return c.compile_json_schema(spec.text, any_whitespace=ws, separators=seps, **opts)
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.text)
            return c.compile_grammar(spec.choice_ebnf())
        except (RuntimeError, ValueError) as e:  # xgrammar reports parse errors as RuntimeError
            raise ValueError(
                f"xgrammar could not compile the {spec.kind}: {_strip_location(str(e))}"
            ) from None

    def fill_rows(self, matchers: list[XGrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill ``bitmask[rows[i]]`` for ``matchers[i]`` in one call (the manager's batch path)."""
        if any(m._done for m in matchers):  # rare: nothing follows EOS
            for m, r in zip(matchers, rows):
                if m._done:
                    bitmask[r].zero_()
            rows = [r for m, r in zip(matchers, rows) if not m._done]
            matchers = [m for m in matchers if not m._done]
        if matchers:
            self._batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, rows)

    # ----- the manager's fast path: keys are xgrammar's own C++ matcher handles ------------------------
    def batch_key(self, matcher: XGrammarMatcher) -> object | None:
        """What :meth:`fill_keys` takes for ``matcher`` (None: this matcher has no fast path)."""
        if self._batch_handle is None:
            return None
        return getattr(matcher._m, "_handle", None)

    def fill_keys(
        self, keys: list[object], bitmask: torch.Tensor, rows: list[int] | None, debug_print: bool
    ) -> None:
        """Fill ``bitmask[rows[i]]`` (``rows=None``: row ``i``) for the handles ``keys`` in one call.

        Replaced in ``__init__`` by xgrammar's bound batch call (same signature). Raises RuntimeError
        (from xgrammar, before any state changes) if a matcher already accepted EOS; the manager then
        takes its general path, which writes such rows as all-zero.
        """
        raise RuntimeError(
            "xgrammar has no BatchGrammarMatcher handle here: the manager's general path fills masks"
        )

    def accept_key(self, key: Any, token: int) -> int:
        """Draft step on a handle: 0 rejected (state unchanged), 1 accepted, 2 accepted EOS (the end).

        (The manager inlines this using ``key_refuse`` / ``key_eos``; keys also ``rollback(n)``.)"""
        if token in self._refuse or not key.accept_token(token, False):
            return 0
        return 2 if token == self._eos else 1

    def matcher(self, compiled: object) -> XGrammarMatcher:
        return XGrammarMatcher(
            self._xgr.GrammarMatcher(compiled),
            self._vocab.bitmask_words,
            self._refuse,
            self._vocab.eos_token_id,
        )


def _strip_location(msg: str) -> str:
    # "[23:03:34] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> the part users need.
    _, sep, tail = msg.partition(".cc:")
    if sep:
        _, _, rest = tail.partition(": ")
        return rest.strip() or msg.strip()
    return msg.strip()
