"""The ``auto`` grammar backend: both engines behind one backend, chosen per spec, with fallback.

Each spec is compiled by the engine that suits it best first (``ORDER``; ``so_args["engine"]`` puts the
named engine first); when that engine refuses the spec (llguidance: ``oneOf``, unknown formats,
``dependencies``, ``uniqueItems``, ``not``, ``if/then/else``; xgrammar: other constructs), the next one
compiles it, per request. Why llguidance first for JSON schemas: on the development sample of real-world
schemas it was the engine whose documents were valid (xgrammar's approximations of string bounds and of
some keywords let invalid documents through; the manager's post-hoc check reports those as
``grammar_violation``, but a valid document is better than a reported invalid one).

Only the installed engines take part (the ``structured`` extra brings llguidance, the ``xgrammar`` extra
xgrammar): with one of them the backend is that engine with the relaxed JSON retry; with neither it
raises the one-line :class:`~deepinfer_core.extras.MissingExtraError` naming the ``structured`` extra.

The request's matcher is the serving engine's own matcher, so the masks are exactly that engine's. For the
manager's fast path the backend presents the *primary* engine's batch keys (the first engine of the JSON
order): requests served by the other engine have no key, so a batch that contains one takes the
manager's general path, where :meth:`AutoBackend.fill_rows` fills each engine's rows with its own batch
call.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import torch

from deepinfer_core.protocols import Tokenizer
from deepinfer_core.structured.engines import require_any_engine
from deepinfer_core.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceMatcher
from deepinfer_core.structured.spec import ENGINES, GrammarSpec
from deepinfer_core.structured.vocab import GrammarVocab
from deepinfer_core.structured.xgrammar_backend import XGrammarBackend, XGrammarMatcher

log = logging.getLogger(__name__)

# Engine order per constraint kind. JSON schema: llguidance is strict (see the module docstring);
# regex: llguidance is ~100x faster on bounded repetitions at a large vocabulary (docs/structured.md);
# EBNF arrives in GBNF, xgrammar's own dialect (llguidance gets it converted); choice: either.
ORDER: dict[str, tuple[str, ...]] = {
    "json_schema": ("llguidance", "xgrammar"),
    "regex": ("llguidance", "xgrammar"),
    "ebnf": ("xgrammar", "llguidance"),
    "choice": ("llguidance", "xgrammar"),
}
# When every engine refused a JSON schema: llguidance once more with what it refuses relaxed (unknown
# keywords and formats ignored, oneOf as anyOf). Its documents may then violate the schema, which the
# manager's document check reports as grammar_violation; a request's own options take precedence.
RELAXED: tuple[str, dict[str, bool]] = ("llguidance", {"lenient": True, "coerce_one_of": True})


@attrs.frozen(slots=True)
class AutoGrammar:
    """A spec compiled by ``engine``; ``refused`` holds (engine, message) of the engines tried before."""

    engine: str
    compiled: object = attrs.field(repr=False)
    refused: tuple[tuple[str, str], ...] = ()
    relaxed: tuple[str, ...] = ()  # options of RELAXED this compile needed


class AutoBackend:
    """Compiles with the best engine for each spec and falls back to the other (see the module docstring).

    ``order`` overrides :data:`ORDER` for every kind (e.g. ``("xgrammar", "llguidance")``). Other keyword
    arguments (``vocab_size``, ``mask_threads``, ``json_any_whitespace``) go to both engines.
    """

    name = "auto"

    def __init__(self, tokenizer: Tokenizer, *, order: tuple[str, ...] | None = None, **kwargs: Any) -> None:
        if order is not None:
            bad = [e for e in order if e not in ENGINES]
            if bad or not order or len(set(order)) != len(order):
                raise ValueError(f"order={order!r}: must be distinct engines of {list(ENGINES)}")
        self._order = tuple(order) if order is not None else None
        installed = require_any_engine("the auto grammar backend")
        kinds = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}
        self.backends: dict[str, Any] = {e: kinds[e](tokenizer, **kwargs) for e in ENGINES if e in installed}
        if len(installed) < len(ENGINES):
            log.info("auto grammar backend: only %s installed", ", ".join(installed))
        first = next(e for e in (*(self._order or ORDER["json_schema"]), *ENGINES) if e in self.backends)
        self.primary = first
        p = self.backends[first]
        self._primary_type = XGrammarMatcher if first == "xgrammar" else LLGuidanceMatcher
        # The manager's fast path, over the primary engine's keys (see batch_key).
        for attr in (
            "fill_keys",
            "accept_key",
            "fast_fill_kind",
            "key_refuse",
            "key_eos",
            "key_inline_eos",
            "key_check_eos",
        ):
            if hasattr(p, attr):
                setattr(self, attr, getattr(p, attr))
        # ... and the other engine's, for the manager's second C++ call (batches served by it alone).
        second = next(e for e in ENGINES if e != first)
        other = self.backends.get(second)
        self.second_fast_backend = other if getattr(other, "fast_fill_kind", None) else None
        self._second_type = XGrammarMatcher if second == "xgrammar" else LLGuidanceMatcher

    @property
    def vocab_size(self) -> int:
        return self.backends[self.primary].vocab_size

    @property
    def eos_token_id(self) -> int:
        return self.backends[self.primary].eos_token_id

    @property
    def vocab(self) -> GrammarVocab:
        return self.backends[self.primary].vocab

    def order_for(self, spec: GrammarSpec) -> tuple[str, ...]:
        order = self._order or ORDER[spec.kind]
        if spec.engine is not None:
            order = (spec.engine, *(e for e in order if e != spec.engine))
        # a preferred engine that is not installed yields to the installed one
        return tuple(e for e in order if e in self.backends)

    def compile(self, spec: GrammarSpec) -> AutoGrammar:
        spec = GrammarSpec.of(spec)
        refused: list[tuple[str, str]] = []
        for engine in self.order_for(spec):
            try:
                compiled = self.backends[engine].compile(spec)
            except ValueError as e:
                refused.append((engine, str(e)))
                continue
            if refused:
                log.info(
                    "auto backend: %s refused the %s (%s); %s serves it",
                    refused[-1][0],
                    spec.kind,
                    refused[-1][1].splitlines()[0][:200],
                    engine,
                )
            return AutoGrammar(engine=engine, compiled=compiled, refused=tuple(refused))
        if spec.kind == "json_schema":
            engine, extra = RELAXED
            if engine not in self.backends:
                raise ValueError(
                    "no engine could compile the spec: " + "; ".join(f"{e}: {m}" for e, m in refused)
                )
            mine = spec.options_for(engine)
            add = {k: v for k, v in extra.items() if k not in mine}
            if add:
                opts = {e: spec.options_for(e) for e in ENGINES}
                opts[engine] = {**add, **mine}
                try:
                    compiled = self.backends[engine].compile(attrs.evolve(spec, options=opts))
                except ValueError as e:
                    refused.append((f"{engine} (relaxed)", str(e)))
                else:
                    log.info(
                        "auto backend: every engine refused the json_schema; %s serves it relaxed (%s)",
                        engine,
                        ", ".join(sorted(add)),
                    )
                    return AutoGrammar(
                        engine=engine, compiled=compiled, refused=tuple(refused), relaxed=tuple(sorted(add))
                    )
        raise ValueError("no engine could compile the spec: " + "; ".join(f"{e}: {m}" for e, m in refused))

    def matcher(self, compiled: AutoGrammar) -> Any:
        if not isinstance(compiled, AutoGrammar):
            raise TypeError(
                f"compiled: expected an AutoGrammar from compile(), got {type(compiled).__name__}"
            )
        return self.backends[compiled.engine].matcher(compiled.compiled)

    def engine_of(self, matcher: Any) -> str:
        """Which engine a matcher of this backend belongs to."""
        return "xgrammar" if isinstance(matcher, XGrammarMatcher) else "llguidance"

    def json_whitespace(self, spec: GrammarSpec) -> bool:
        return any(b.json_whitespace(spec) for b in self.backends.values())

    def fill_rows(self, matchers: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Each engine's rows through that engine's own batch fill."""
        x = [i for i, m in enumerate(matchers) if isinstance(m, XGrammarMatcher)]
        if len(x) == len(matchers) or not x:
            self.backends["xgrammar" if x else "llguidance"].fill_rows(matchers, bitmask, rows)
            return
        lg = [i for i, m in enumerate(matchers) if not isinstance(m, XGrammarMatcher)]
        self.backends["xgrammar"].fill_rows([matchers[i] for i in x], bitmask, [rows[i] for i in x])
        self.backends["llguidance"].fill_rows([matchers[i] for i in lg], bitmask, [rows[i] for i in lg])

    def check_rows(self, keys: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
        """llguidance's row checks (error state, EOS taken) on the rows of llguidance keys."""
        mine = [r for r in rows if isinstance(keys[r], LLGuidanceMatcher)]
        if mine and "llguidance" in self.backends:
            self.backends["llguidance"].check_rows(keys, bitmask, mine)

    def batch_key2(self, matcher: Any) -> object | None:
        """The other engine's key (for the manager's second C++ call), None for the primary's matchers."""
        if self.second_fast_backend is None or not isinstance(matcher, self._second_type):
            return None
        return self.second_fast_backend.batch_key(matcher)

    def batch_key(self, matcher: Any) -> object | None:
        """The primary engine's key; None for the other engine's matchers (the general path fills them)."""
        if not isinstance(matcher, self._primary_type):
            return None
        return self.backends[self.primary].batch_key(matcher)
