"""The second grammar backend, over llguidance's public API (``LLTokenizer`` / ``LLMatcher``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from deepinfer_core.extras import require
from deepinfer_core.protocols import Tokenizer
from deepinfer_core.structured._bitmask import check_bitmask
from deepinfer_core.structured.spec import GrammarSpec
from deepinfer_core.structured.vocab import GrammarVocab, grammar_vocab, llguidance_tokenizer

log = logging.getLogger(__name__)

# words of llguidance's resource-limit errors ("Current row has 2501 items; max is 2000", fuel, size)
_LIMIT_WORDS = ("max is", "limit", "too many", "too large", "too big", "fuel")


@attrs.frozen(slots=True)
class LLGuidanceGrammar:
    """A validated llguidance grammar: a template matcher that each request deep-copies."""

    grammar: str
    template: object = attrs.field(repr=False)


class LLGuidanceMatcher:
    """One request's grammar state (llguidance ``LLMatcher``).

    ``LLMatcher.consume_token`` puts the matcher into a permanent error state on a rejected token, so
    tokens go through ``try_consume_tokens`` (which refuses without side effects); EOS is taken only in
    an accepting state. llguidance reports
    "stopped" as soon as only EOS can follow; we call a matcher terminated only once EOS was accepted,
    as xgrammar does, and track that ourselves (EOS is always the last accepted token). See
    ``accept_token`` for how EOS interacts with llguidance's rollback history.
    """

    __slots__ = ("_eos", "_eos_recorded", "_history", "_m", "_template", "_terminated", "_words")

    def __init__(self, template: Any, words: int, eos: int) -> None:  # llguidance's matcher (untyped)
        self._template = template
        self._m = template.deep_copy()
        self._words = words
        self._eos = eos
        self._terminated = False
        self._eos_recorded = False
        # Accepted tokens (EOS excluded): llguidance turns a state with no allowed token into a
        # permanent error, so after such a dead end the matcher is rebuilt by replaying these.
        self._history: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        t = int(token_id)
        if t == self._eos:
            if not self._m.is_accepting():
                return False
            # Once the parser has stopped (only EOS can follow) llguidance takes EOS as a no-op that is
            # not in its rollback history (and try_consume_tokens refuses it); otherwise EOS is a
            # recorded token. Remember which, so rollback undoes exactly what was consumed.
            self._eos_recorded = not self._m.is_stopped()
            if self._eos_recorded and self._m.try_consume_tokens([t]) != 1:
                return False
            self._terminated = True
            return True
        if self._m.try_consume_tokens([t]) != 1:
            return False
        self._history.append(t)
        return True

    def library_error(self) -> str | None:
        """llguidance's own message when the matcher is in its error state (a parser limit, say)."""
        if not self._m.is_error():
            return None
        return "llguidance: " + self._m.get_error().strip().splitlines()[0]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        check_bitmask(bitmask, row, self._words)
        self.fill_unchecked(bitmask, row)

    def fill_unchecked(self, bitmask: torch.Tensor, row: int) -> None:
        """``fill_next_token_bitmask`` without argument checks (the manager validated its own buffer)."""
        if self._terminated:  # nothing follows EOS (xgrammar's behaviour too)
            bitmask[row].zero_()
            return
        nbytes = self._words * 4
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * nbytes, nbytes)
        if self._m.is_error():
            self._recover(bitmask, row)

    def _recover(self, bitmask: torch.Tensor, row: int) -> None:
        # No token can continue ("NoExtensionBias"): report a dead end as an all-zero row, as xgrammar
        # does, and rebuild the matcher at the same (dead) state so that rollback still works.
        log.debug("llguidance dead end: %s", self._m.get_error().splitlines()[0])
        bitmask[row].zero_()
        self._m = self._template.deep_copy()
        if self._history and not self._m.consume_tokens(self._history):
            raise RuntimeError(
                f"llguidance could not replay {len(self._history)} tokens: {self._m.get_error()}"
            )

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        n = int(num_tokens)  # tokens to drop from our history (EOS is never in it)
        llg_n = n
        if self._terminated:
            n -= 1
            llg_n = n + self._eos_recorded  # the EOS taken after a stop is not in llguidance's history
        if n > len(self._history):
            raise ValueError(
                f"num_tokens={num_tokens}: only {len(self._history) + self._terminated} tokens were accepted"
            )
        if llg_n > 0 and not self._m.rollback(llg_n):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self._m.get_error()}")
        if n > 0:
            del self._history[-n:]
        self._terminated = False

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._m.reset()
        self._history.clear()
        self._terminated = False

    @property
    def raw(self) -> object:
        """The llguidance ``LLMatcher`` (benchmarks compare against calling it directly)."""
        return self._m


class LLGuidanceBackend:
    """Compiles :class:`GrammarSpec` s with llguidance against one tokenizer.

    EBNF arrives in GBNF (xgrammar's dialect) and is converted to Lark with llguidance's own converter;
    a grammar already in Lark syntax passes through. JSON is compact by default, like
    :class:`~deepinfer_core.structured.XGrammarBackend`.
    """

    name = "llguidance"

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int | None = None,
        mask_threads: int | None = None,
        json_any_whitespace: bool = False,
    ) -> None:
        llg = require("llguidance", "the llguidance grammar backend")

        self._vocab: GrammarVocab = grammar_vocab(tokenizer, vocab_size)
        self._tok = llguidance_tokenizer(self._vocab, tokenizer)
        self._json_opts = {
            "whitespace_flexible": bool(json_any_whitespace),
            "item_separator": ",",
            "key_separator": ":",
        }
        self._llg = llg
        # llguidance's LLExecutor fills a batch on its own threads, but measured here it costs ~2x the
        # CPU per row of calling each matcher (1-2 threads, 128k vocabulary; docs/performance.md), so
        # it is used only when asked for with mask_threads > 1.
        self._executor = (
            llg.LLExecutor(num_threads=mask_threads) if mask_threads and mask_threads > 1 else None
        )
        self._nbytes = self._vocab.bitmask_words * 4
        self._last_bm: torch.Tensor | None = (
            None  # fill_keys' cached buffer address (a strong ref keeps it valid)
        )
        self._last_ptr = 0
        # The manager's draft loop steps non-EOS tokens on our matchers inline (see _fastpath).
        self.key_inline_eos = self._vocab.eos_token_id
        self.key_check_eos = self._vocab.eos_token_id  # see fill_keys / check_rows
        # "llguidance": the manager's C++ fast path (fastfill.cpp) makes the per-row library calls of
        # fill_keys / fill_rows / accept_token itself; with an executor the Python fast path runs.
        self.fast_fill_kind: str | None = "llguidance" if self._executor is None else None

    def fill_rows(
        self, matchers: list[LLGuidanceMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """Fill ``bitmask[rows[i]]`` for ``matchers[i]`` (the manager's batch path)."""
        words = self._vocab.bitmask_words
        if self._executor is None:
            nbytes, ptr = words * 4, bitmask.data_ptr()
            for m, r in zip(matchers, rows):
                if m._terminated:
                    bitmask[r].zero_()
                    continue
                raw = m._m
                raw.unsafe_compute_mask_ptr(ptr + r * nbytes, nbytes)
                # On an error llguidance writes an EOS-only row (not all-zero), so the dead-row pass
                # cannot stand in for this check.
                if raw.is_error():
                    m._recover(bitmask, r)
            return
        pairs = []
        for m, r in zip(matchers, rows):
            if m._terminated:
                bitmask[r].zero_()
            else:
                pairs.append((m._m, r))
        if not pairs:
            return
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, bitmask.shape[0])
        for m, r in zip(matchers, rows):
            if not m._terminated and m._m.is_error():
                m._recover(bitmask, r)

    # ----- the manager's fast path: keys are our matchers (the per-row call is Python either way) -----
    @staticmethod
    def batch_key(matcher: LLGuidanceMatcher) -> LLGuidanceMatcher:
        return matcher

    def fill_keys(
        self,
        keys: list[LLGuidanceMatcher],
        bitmask: torch.Tensor,
        rows: list[int] | None,
        debug_print: bool = False,
    ) -> None:
        """:meth:`fill_rows` for the manager; ``rows=None`` means row ``i`` for ``keys[i]`` *without*
        the per-row checks (EOS taken, error state), which the manager then runs through
        :meth:`check_rows` on the rows its C++ pass flags: llguidance writes an EOS-only row for a
        matcher in its error state and after EOS (``key_check_eos``), so the loop is the bare library
        loop. The buffer address is cached per tensor object (the manager reuses its views), since
        ``data_ptr()`` costs ~0.2 us.
        """
        if self._executor is not None or rows is not None:
            self.fill_rows(keys, bitmask, range(len(keys)) if rows is None else rows)
            return
        if bitmask is self._last_bm:
            p = self._last_ptr
        else:
            p = bitmask.data_ptr()
            self._last_bm, self._last_ptr = bitmask, p
        nbytes = self._nbytes
        for m in keys:
            m._m.unsafe_compute_mask_ptr(p, nbytes)
            p += nbytes

    def check_rows(self, keys: list[LLGuidanceMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """After ``fill_keys(keys, bitmask, None)``: fix the rows (indices into ``keys``) that allow only
        EOS or nothing: all-zero after EOS was taken, dead-end recovery in llguidance's error state."""
        for r in rows:
            m = keys[r]
            if m._terminated:
                bitmask[r].zero_()
            elif m._m.is_error():
                m._recover(bitmask, r)

    @staticmethod
    def accept_key(key: LLGuidanceMatcher, token: int) -> int:
        """Draft step: 0 rejected (state unchanged), 1 accepted, 2 accepted EOS (the end)."""
        if not key.accept_token(token):
            return 0
        return 2 if key._terminated else 1

    @property
    def vocab_size(self) -> int:
        return self._vocab.vocab_size

    @property
    def vocab(self) -> GrammarVocab:
        """Token bytes, control ids and EOS this backend was built from (the manager's UTF-8 filter)."""
        return self._vocab

    def json_whitespace(self, spec: GrammarSpec) -> bool:
        """Whether a JSON document of ``spec`` may contain whitespace between its tokens."""
        o = {**self._json_opts, **spec.options_for("llguidance")}
        return bool(o.get("whitespace_flexible") or o.get("whitespace_pattern"))

    @property
    def eos_token_id(self) -> int:
        return self._vocab.eos_token_id

    def _grammar_text(self, spec: GrammarSpec) -> str:
        llg = self._llg
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(
                spec.text, overrides={**self._json_opts, **spec.options_for("llguidance")}
            )
        if spec.kind == "ebnf":
            return llg.grammar_from("ebnf", spec.text)
        return llg.grammar_from("choice", json.dumps(list(spec.choices)))

    def compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        spec = GrammarSpec.of(spec)
        try:
            grammar = self._grammar_text(spec)
        except ValueError as e:
            raise ValueError(f"llguidance could not compile the {spec.kind}: {e}") from None
        # Building the matcher parses and checks the grammar (with the GIL released), so the template
        # doubles as validation; each request then gets a cheap deep copy.
        template = self._llg.LLMatcher(self._tok, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"llguidance could not compile the {spec.kind}: {template.get_error().strip()}")
        limit = self._probe_limits(template)
        if limit is not None:
            raise ValueError(f"llguidance could not compile the {spec.kind}: {limit}")
        return LLGuidanceGrammar(grammar=grammar, template=template)

    def _probe_limits(self, template: object, probes: int = 4) -> str | None:
        """llguidance's parser limits (e.g. at most 2,000 items in a parser row: a ``choice`` of more
        options) do not fail the build; they fail the first token consumed. Consume each of the first
        few allowed tokens on a copy so such a grammar is refused at compile time with the library's
        message, instead of failing mid-generation."""
        import numpy as np

        def limit(matcher: object) -> str | None:  # a dead end is not a limit: the manager handles it
            msg = matcher.get_error().strip().splitlines()[0] if matcher.is_error() else ""  # type: ignore[attr-defined]
            return msg if any(w in msg.lower() for w in _LIMIT_WORDS) else None

        m = template.deep_copy()  # type: ignore[attr-defined]
        buf = np.zeros(self._vocab.bitmask_words, np.int32)
        m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
        if m.is_error():
            return limit(m)
        bits = np.unpackbits(buf.view(np.uint8), bitorder="little")[: self._vocab.vocab_size]
        for t in np.flatnonzero(bits)[:probes].tolist():
            if t == self._vocab.eos_token_id:
                continue
            c = template.deep_copy()  # type: ignore[attr-defined]
            c.try_consume_tokens([int(t)])
            msg = limit(c)
            if msg is not None:
                return msg
        return None

    def matcher(self, compiled: LLGuidanceGrammar) -> LLGuidanceMatcher:
        if not isinstance(compiled, LLGuidanceGrammar):
            raise TypeError(
                f"compiled: expected an LLGuidanceGrammar from compile(), got {type(compiled).__name__}"
            )
        return LLGuidanceMatcher(compiled.template, self._vocab.bitmask_words, self._vocab.eos_token_id)
