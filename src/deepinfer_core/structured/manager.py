"""``StructuredOutputManager``: per-request matchers, async compilation, and batch masks with drafts.

Lifecycle of a constrained request::

    add_request(rid, spec)          # validates now, compiles on the pool (cached by spec)
    ready(rids) / wait(rids)        # schedule a request only once its grammar is ready
    fill_bitmask([(rid, drafts)])   # rows 0..k: mask before each draft position
    advance(rid, accepted_tokens)   # after verification, commit what was accepted
    finish_reason(rid)              # STOP / DEAD_END / INVALID_GRAMMAR / REJECTED_TOKEN / VIOLATION or None
    metrics(rid)                    # which engine served it, what was refused, what the checks said
    remove_request(rid)

Guarantees on top of the engines (both on by default): every row is intersected with a byte-level
validity automaton (``_C.structured.ByteFilter``: UTF-8, and for JSON no raw control characters), so no
request can emit invalid UTF-8 whatever its engine allows; and a ``json_schema`` request whose grammar
accepts its end is checked post hoc (:mod:`~deepinfer_core.structured.validate`): an invalid document
finishes with ``VIOLATION`` (``grammar_violation``), never ``STOP``.

Speculative rows: a request with drafts ``d1..dk`` gets rows ``r0..rk``; ``r0`` is the mask at its
committed state, ``ri`` the mask after accepting ``d1..di``. The matcher accepts the drafts one by one,
filling each row ("accept-draft-then-fill"), and is rolled back to its committed state afterwards. A draft
the grammar rejects (or one that leads to a state no token can continue) cuts the draft there: later
drafts are not verified, and the unused rows repeat the last valid row so that sampling from them is
harmless. ``BatchMask.num_drafts`` tells the verifier how many drafts survived.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any

import attrs
import numpy as np
import torch

from deepinfer_core.protocols import GrammarBackend, GrammarMatcher
from deepinfer_core.structured import _fastpath, _general

# the dead-row pass lives with the general path; re-exported for the tests that pin it
from deepinfer_core.structured._general import _C_FINISH_ROWS, _finish_rows, _finish_rows_numpy  # noqa: F401
from deepinfer_core.structured.spec import FinishReason, GrammarSpec
from deepinfer_core.structured.validate import check_document, make_validator

log = logging.getLogger(__name__)


@attrs.frozen(slots=True)
class BatchMask:
    """Masks of one batch: request ``i`` owns rows ``offsets[i]:offsets[i + 1]``."""

    bitmask: torch.Tensor  # int32 [rows, ceil(vocab / 32)], bit set = allowed
    offsets: np.ndarray  # int64 [n + 1]
    num_drafts: np.ndarray  # int64 [n]: drafts that survive the grammar (<= drafts given)
    dead_end: np.ndarray  # bool [n]: row 0 allows nothing; the request was finished with DEAD_END

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])


@attrs.frozen(slots=True)
class _Compiled:
    """What a compile job yields: the backend's grammar and, for JSON schemas, the post-hoc validator."""

    grammar: object
    validator: Any = None
    validator_error: str | None = None


class _Request:
    __slots__ = ("doc", "finish", "future", "matcher", "metrics", "spec", "validator")

    def __init__(self, spec: GrammarSpec, future: cf.Future[Any]) -> None:
        self.spec = spec
        self.future = future
        self.matcher: GrammarMatcher | None = None
        self.finish: FinishReason | None = None
        self.doc: bytearray | None = None  # the output's bytes (json_schema requests, for the check)
        self.validator: _Compiled | None = None
        self.metrics: dict[str, Any] = {}


class StructuredOutputManager:
    """Grammar state for every constrained request of an engine, over one :class:`GrammarBackend`.

    Call it from one thread (the engine loop); only compilation runs on the pool.
    """

    def __init__(
        self,
        backend: GrammarBackend,
        *,
        compile_workers: int = 2,
        cache_size: int = 256,
        fast_path: bool = True,
        utf8: bool = True,
        validate: bool = True,
    ) -> None:
        """``utf8``: intersect every mask with the byte filter (needs the backend's ``vocab`` and the C++
        extension); ``validate``: check finished JSON documents against their schema (see the module
        docstring). Both exist to be turned off for measurements of what they cost."""
        if compile_workers < 1:
            raise ValueError(f"compile_workers={compile_workers}: must be >= 1")
        if cache_size < 1:
            raise ValueError(f"cache_size={cache_size}: must be >= 1")
        self._backend = backend
        self._vocab_size = int(backend.vocab_size)
        self._words = (self._vocab_size + 31) // 32
        self._pool = cf.ThreadPoolExecutor(max_workers=compile_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarSpec, cf.Future[Any]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._requests: dict[Hashable, _Request] = {}
        self._errors: dict[Hashable, str] = {}
        self._buf = torch.empty((0, self._words), dtype=torch.int32)
        # Bits past vocab_size in the last word are padding; backends disagree on them (xgrammar sets
        # them), so the manager clears them and a mask means the same whichever backend filled it.
        tail = self._vocab_size % 32
        self._tail_keep = None if tail == 0 else np.int32(np.uint32((1 << tail) - 1))
        self._tail_keep_c = -1 if tail == 0 else (1 << tail) - 1
        self._view_cache: dict[int, tuple[torch.Tensor, np.ndarray, np.ndarray | None]] = {}
        # Fast path (backends with batch keys; fast_path=False keeps the general path, which tests use
        # as the reference): request id -> the backend's batch key, for requests with a live matcher
        # and no finish reason, so a step is one dict lookup per request.
        self._keys: dict[Hashable, Any] | None = (
            {} if fast_path and _fastpath.has_fast_path(backend) else None
        )
        self._fill_keys = getattr(backend, "fill_keys", None)
        # >= 0: the backend's draft-free fill skips per-row checks; rows allowing only this token (or
        # nothing) are handed to backend.check_rows (llguidance's error and after-EOS rows look so).
        check_eos = getattr(backend, "key_check_eos", None) if self._keys is not None else None
        self._check_eos = (
            -1 if check_eos is None or not callable(getattr(backend, "check_rows", None)) else int(check_eos)
        )
        # rows -> (tensor view, its address, the BatchMask a draft-free batch of that size returns when
        # no row is dead: offsets, num_drafts and dead_end are then the same every step, read-only).
        self._fast_views: dict[int, tuple[torch.Tensor, int, BatchMask | None]] = {}
        self._fast_fill: Any = None
        self.cache_hits = 0
        self.cache_misses = 0
        # Round 3: for xgrammar and llguidance the whole fast path is C++ (csrc/structured/fastfill.cpp):
        # the instance attribute shadows the method below, so mgr.fill_bitmask(batch) runs no Python
        # frame of ours; anything unusual comes back to the method (the Python path).
        self._fast_fill = _fastpath.make_fast_fill(self, backend, BatchMask)
        if self._fast_fill is not None:
            self.fill_bitmask = self._fast_fill.fill_bitmask  # type: ignore[method-assign]
        # The auto backend's second engine: its own keys and C++ call, tried when the first one's
        # misses (a batch served wholly by the second engine); a mixed batch takes the general path.
        self._keys2: dict[Hashable, Any] | None = None
        self._fast_fill2: Any = None
        second = getattr(backend, "second_fast_backend", None) if self._fast_fill is not None else None
        if second is not None:
            self._keys2 = {}
            self._fast_fill2 = _fastpath.make_fast_fill(
                self, second, BatchMask, self._keys2, type(self)._fill_general
            )
            if self._fast_fill2 is None:
                self._keys2 = None
        self._validate = validate
        # The byte filter: request id -> its state (the C++ fast path reads this same dict), the
        # next-state table per state for advance(), and each token's bytes for the JSON check.
        self._u8: dict[Hashable, int] = {}
        self._u8f: Any = None
        self._u8tab: list[bytes] = []
        vocab = getattr(backend, "vocab", None)
        self._token_bytes: tuple[bytes, ...] | None = vocab.token_bytes if vocab is not None else None
        if utf8 and vocab is not None and _ByteFilter is not None:
            self._u8f = _ByteFilter(list(vocab.token_bytes), self._words)
            self._u8tab = [self._u8f.table(s) for s in range(self._u8f.NUM_STATES)]
            if self._fast_fill is not None:
                self._fast_fill.set_utf8(self._u8f, self._u8)
            if self._fast_fill2 is not None:
                self._fast_fill2.set_utf8(self._u8f, self._u8)
        elif utf8:
            log.warning(
                "structured outputs: no byte filter (backend without `vocab`, or the C++ extension "
                "predates it); masks are the engine's alone"
            )

    # ----- submission and compilation -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _compiled_future(self, spec: GrammarSpec) -> cf.Future[Any]:
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                self.cache_hits += 1
                return fut
            self.cache_misses += 1
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)  # running requests keep their own future
            return fut

    def _compile(self, spec: GrammarSpec) -> _Compiled:
        grammar = self._backend.compile(spec)
        if spec.kind != "json_schema" or not self._validate:
            return _Compiled(grammar)
        assert isinstance(spec.text, str)  # a JSON schema's text
        validator, why = make_validator(spec.text)
        return _Compiled(grammar, validator, why)

    def add_request(self, request_id: Hashable, spec: GrammarSpec | Mapping[str, Any]) -> None:
        """Validate ``spec`` (``ValueError`` naming the field) and start compiling it in the background."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r}: already registered")
        spec = GrammarSpec.of(spec)
        name = getattr(self._backend, "name", None)
        if spec.engine is not None and name in ("xgrammar", "llguidance") and spec.engine != name:
            raise ValueError(
                f"so_args.engine: {spec.engine!r}, but this manager's backend is {name!r} "
                "(the 'auto' backend serves either engine)"
            )
        self._requests[request_id] = _Request(spec, self._compiled_future(spec))

    def _get(self, request_id: Hashable) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request_id={request_id!r}: not registered (add_request first)") from None

    def _resolve(self, req: _Request, request_id: Hashable) -> bool:
        """Make the matcher once the compile finished; False while still compiling."""
        if req.matcher is not None or req.finish is not None:
            return True
        if not req.future.done():
            return False
        try:
            res = req.future.result()
            grammar = res.grammar if isinstance(res, _Compiled) else res
            req.matcher = self._backend.matcher(grammar)
            self._start(req, request_id, res, grammar)
            if self._keys is not None:
                key = self._backend.batch_key(req.matcher)  # type: ignore[attr-defined]
                if key is not None:
                    self._keys[request_id] = key
                elif self._keys2 is not None:
                    key2 = self._backend.batch_key2(req.matcher)  # type: ignore[attr-defined]
                    if key2 is not None:
                        self._keys2[request_id] = key2
        except ValueError as e:  # the backend's own message: the request fails alone
            req.finish = FinishReason.INVALID_GRAMMAR
            self._errors[request_id] = str(e)
            log.info("request %r: %s", request_id, e)
        except Exception as e:  # an engine bug or a cancelled compile must not take the batch down
            req.finish = FinishReason.INVALID_GRAMMAR
            self._errors[request_id] = f"{type(e).__name__}: {e}"
            log.exception("request %r: grammar compilation failed unexpectedly", request_id)
        return True

    def ready(self, request_ids: Iterable[Hashable]) -> list[Hashable]:
        """Those of ``request_ids`` whose grammar is compiled (or failed; see ``finish_reason``)."""
        return [rid for rid in request_ids if self._resolve(self._get(rid), rid)]

    def _start(self, req: _Request, rid: Hashable, res: Any, grammar: Any) -> None:
        """A request's matcher exists: its byte-filter state, document buffer and metrics."""
        spec = req.spec
        engine = getattr(grammar, "engine", None) or getattr(
            self._backend, "name", type(self._backend).__name__
        )
        req.metrics = {"grammar_engine": engine}
        refused = getattr(grammar, "refused", ())
        if refused:
            req.metrics["grammar_refused"] = {e: m for e, m in refused}
        if getattr(grammar, "relaxed", ()):
            req.metrics["grammar_relaxed"] = list(grammar.relaxed)
        if self._u8f is not None:
            variant = 0
            if spec.kind == "json_schema":  # no raw control characters; tab / LF / CR where whitespace may be
                ws = getattr(self._backend, "json_whitespace", None)
                variant = 2 if ws is not None and ws(spec) else 1
            self._u8[rid] = 8 * variant
        if (
            spec.kind == "json_schema"
            and isinstance(res, _Compiled)
            and self._validate
            and self._token_bytes is not None
        ):
            req.doc = bytearray()
            req.validator = res

    def metrics(self, request_id: Hashable) -> dict[str, Any]:
        """``grammar_engine`` (which engine serves / served it), ``grammar_refused`` (engine -> message,
        for engines that refused the spec first), ``grammar_relaxed`` (options the auto backend's last
        resort needed), ``grammar_check`` ("passed", "failed", or "partial" when only UTF-8 / JSON could
        be checked) and ``grammar_check_error``."""
        req = self._get(request_id)
        self._resolve(req, request_id)
        return dict(req.metrics)

    def wait(self, request_ids: Iterable[Hashable], timeout: float | None = None) -> list[Hashable]:
        """Block until the given requests' grammars are compiled (or ``timeout``); return the ready ones."""
        ids = list(request_ids)
        cf.wait([self._get(r).future for r in ids], timeout=timeout)
        return self.ready(ids)

    def finish_reason(self, request_id: Hashable) -> FinishReason | None:
        req = self._get(request_id)
        self._resolve(req, request_id)
        return req.finish

    def error(self, request_id: Hashable) -> str | None:
        """The backend's message for a request finished with INVALID_GRAMMAR (or REJECTED_TOKEN when the
        library itself failed, e.g. a parser limit), or what the document check found (VIOLATION)."""
        return self._errors.get(request_id)

    def matcher(self, request_id: Hashable) -> GrammarMatcher:
        req = self._get(request_id)
        if not self._resolve(req, request_id) or req.matcher is None:
            raise RuntimeError(
                f"request_id={request_id!r}: grammar is not ready (finish_reason={req.finish})"
            )
        return req.matcher

    def remove_request(self, request_id: Hashable) -> None:
        self._requests.pop(request_id, None)
        self._u8.pop(request_id, None)
        self._end(request_id)
        self._errors.pop(request_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _end(self, request_id: Hashable) -> None:
        """The request has no next mask any more: off the fast path."""
        if self._keys is not None:
            self._keys.pop(request_id, None)
        if self._keys2 is not None:
            self._keys2.pop(request_id, None)

    # ----- per step ----------------------------------------------------------------------------------
    def _active_matcher(self, rid: Hashable) -> GrammarMatcher:
        req = self._get(rid)
        if not self._resolve(req, rid):
            raise RuntimeError(
                f"request_id={rid!r}: grammar still compiling; schedule it once ready() lists it"
            )
        if req.finish is not None or req.matcher is None:
            raise RuntimeError(f"request_id={rid!r}: already finished ({req.finish}); it has no next mask")
        return req.matcher

    def fill_bitmask(
        self, batch: Sequence[tuple[Hashable, Sequence[int]]], out: torch.Tensor | None = None
    ) -> BatchMask:
        """Masks for ``batch`` = [(request_id, draft_tokens), ...], ``1 + len(drafts)`` rows each.

        ``out`` (int32 CPU, contiguous, at least that many rows) is reused when given; otherwise an
        internal buffer grows as needed (the returned tensor is a view of it, valid until the next call;
        the returned arrays may be read-only and shared between calls).
        Requests whose row 0 allows nothing are finished with ``DEAD_END`` and flagged in ``dead_end``.
        """
        keys_of = self._keys
        if self._fast_fill2 is not None and out is None:
            # the auto backend's second engine's C++ call (it hands anything else to the general path)
            return self._fast_fill2.fill(batch, None)
        if self._u8f is not None:
            # The Python fast path predates the byte filter: with it on, the C++ call (installed over
            # this method) is the fast path and everything it hands back takes the general path.
            return self._fill_general(batch, out)
        if keys_of is not None and out is None and batch:
            # The fast path. One comprehension looks up every draft-free request's batch key; a miss
            # (not resolved yet, finished, unknown) goes to the general path, which raises the clear
            # errors. Everything per call is inlined: at batch 1 the library call itself is ~2 us.
            try:
                keys = [keys_of[rid] for rid, drafts in batch if not drafts]
            except (KeyError, TypeError, ValueError):
                return self._fill_general(batch, out)
            n = len(keys)
            if n != len(batch):  # some request has drafts
                got = self._fill_fast_drafts(batch)
                return got if got is not None else self._fill_general(batch, out)
            hit = self._fast_views.get(n)
            if hit is None:
                hit = self._fast_view(n)
            bm, ptr, same = hit
            assert self._fill_keys is not None  # the fast path's keys exist only with the backend's fill_keys
            try:
                self._fill_keys(keys, bm, None, False)
            except (
                RuntimeError
            ):  # xgrammar: a matcher past EOS (stepped outside the manager); no state changed
                return self._fill_general(batch, out)
            if _COUNT_DEAD(ptr, n, self._words, self._tail_keep_c, self._check_eos) == 0:
                return same if same is not None else self._same_mask(n)
            return self._fast_dead(batch, keys, bm, ptr, n)
        return self._fill_general(batch, out)

    def _fast_dead(
        self,
        batch: Sequence[tuple[Hashable, Sequence[int]]],
        keys: list[Any],
        bm: torch.Tensor,
        ptr: int,
        n: int,
    ) -> BatchMask:
        """A draft-free fast step (Python or C++) whose pass flagged rows: dead rows, and for a backend
        with unchecked rows (llguidance) EOS-only rows, whose matchers are checked here."""
        if self._check_eos >= 0:  # the backend's unchecked rows (llguidance): fix the flagged ones
            self._backend.check_rows(keys, bm, _fastpath.EOS_ONLY(ptr, n, self._words, self._check_eos))  # type: ignore[attr-defined]
            self._backend.check_rows(keys, bm, _fastpath.FINISH_PTR(ptr, n, self._words, self._tail_keep_c))  # type: ignore[attr-defined]
        dead = _fastpath.FINISH_PTR(ptr, n, self._words, self._tail_keep_c)
        if not dead:
            same = self._fast_views[n][2]
            return same if same is not None else self._same_mask(n)
        offs = np.arange(n + 1, dtype=np.int64)
        num_drafts, dead_end = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        self._cut_rows(batch, bm.numpy(), offs, dead, num_drafts, dead_end)
        return BatchMask(bitmask=bm, offsets=offs, num_drafts=num_drafts, dead_end=dead_end)

    def _drafts_tail(
        self,
        batch: Sequence[tuple[Hashable, Sequence[int]]],
        bm: torch.Tensor,
        offsets: list[int],
        accepted: list[int],
        dead: list[int],
    ) -> BatchMask:
        """A drafted fast step (Python or C++) with dead rows (copies and padding already done)."""
        offs, num_drafts = np.array(offsets, dtype=np.int64), np.array(accepted, dtype=np.int64)
        dead_end = np.zeros(len(batch), dtype=bool)
        if dead:
            self._cut_rows(batch, bm.numpy(), offs, dead, num_drafts, dead_end)
        return BatchMask(bitmask=bm, offsets=offs, num_drafts=num_drafts, dead_end=dead_end)

    def _fast_view(self, rows: int) -> tuple[torch.Tensor, int, BatchMask | None]:
        hit = self._fast_views.get(rows)
        if hit is None:
            if self._buf.shape[0] < rows:
                self._grow(rows)
            bm = self._buf[:rows]
            hit = self._fast_views[rows] = (bm, bm.data_ptr(), None)
        return hit

    def _grow(self, rows: int) -> None:
        """A larger buffer: every cached view (here and in the C++ fast path) pointed into the old one."""
        self._buf = torch.empty((max(rows, 2 * self._buf.shape[0]), self._words), dtype=torch.int32)
        self._view_cache.clear()
        self._fast_views.clear()
        if self._fast_fill is not None:
            self._fast_fill.invalidate()
        if self._fast_fill2 is not None:
            self._fast_fill2.invalidate()

    def _same_mask(self, n: int) -> BatchMask:
        """The draft-free, no-dead-row result for ``n`` requests: identical every step, so built once."""
        bm, ptr, _ = self._fast_views[n]
        same = BatchMask(
            bitmask=bm,
            offsets=_frozen(np.arange(n + 1, dtype=np.int64)),
            num_drafts=_frozen(np.zeros(n, dtype=np.int64)),
            dead_end=_frozen(np.zeros(n, dtype=bool)),
        )
        self._fast_views[n] = (bm, ptr, same)
        return same

    def _fill_fast_drafts(self, batch: Sequence[tuple[Hashable, Sequence[int]]]) -> BatchMask | None:
        keys_of = self._keys
        assert keys_of is not None
        try:
            keys = [keys_of[rid] for rid, _ in batch]
        except KeyError:
            return None
        drafts = [d for _, d in batch]
        offsets = [0, *accumulate([len(d) + 1 for d in drafts])]
        total = offsets[-1]
        bm, ptr, _ = self._fast_view(total)
        try:
            accepted, copies = _fastpath.fill_drafts(self._backend, keys, bm, offsets, drafts)
        except (
            RuntimeError,
            TypeError,
        ):  # the depth-0 fill (no state changed) or a non-int draft (rolled back)
            return None
        dead = _fastpath.FINISH_PTR(ptr, total, self._words, self._tail_keep_c, copies)
        return self._drafts_tail(batch, bm, offsets, accepted, dead)

    def _cut_rows(
        self,
        batch: Sequence[tuple[Hashable, Sequence[int]]],
        a: np.ndarray,
        offs: np.ndarray,
        dead_rows: list[int],
        num_drafts: np.ndarray,
        dead_end: np.ndarray,
    ) -> None:
        """Finish requests whose row 0 is dead; cut drafts before a dead later row."""
        for i in np.unique(np.searchsorted(offs, dead_rows, side="right") - 1):
            self._cut_dead(batch[i][0], a, int(offs[i]), int(offs[i + 1]), num_drafts, dead_end, i)

    def _fill_general(
        self, batch: Sequence[tuple[Hashable, Sequence[int]]], out: torch.Tensor | None = None
    ) -> BatchMask:
        """Any backend, any ``out``: the reference the fast path is tested against (``_general.py``)."""
        return _general.fill_general(self, batch, out, BatchMask)

    def _views(
        self, rows: int, out: torch.Tensor | None
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None]:
        return _general.views(self, rows, out)

    def _cut_dead(
        self,
        rid: Hashable,
        a: np.ndarray,
        base: int,
        end: int,
        num_drafts: np.ndarray,
        dead_end: np.ndarray,
        i: int,
    ) -> None:
        live = np.asarray(a[base:end].any(axis=1))
        if not live[0]:
            dead_end[i] = True
            num_drafts[i] = 0
            self._requests[rid].finish = FinishReason.DEAD_END
            self._end(rid)
            log.info("request %r: grammar dead end (no token can continue)", rid)
            return
        cut = int(np.argmin(live)) - 1  # drafts up to the one before the dead state survive
        num_drafts[i] = cut
        a[base + cut + 1 : end] = a[base + cut]

    def advance(self, request_id: Hashable, tokens: Sequence[int]) -> int:
        """Commit the tokens verification accepted; returns how many the grammar took.

        Ends the request with STOP once the grammar accepted EOS, or REJECTED_TOKEN if a token was not
        allowed (the engine sampled outside the mask); tokens after that are ignored.
        """
        m = self._active_matcher(request_id)
        req = self._requests[request_id]
        u8 = self._u8.get(request_id) if self._u8f is not None else None
        doc, tb = req.doc, self._token_bytes
        for j, t in enumerate(tokens):
            t = int(t)
            ns = u8
            if u8 is not None:
                row = self._u8tab[u8]
                ns = row[t] if 0 <= t < len(row) else _REJECT
            if ns == _REJECT or not m.accept_token(t):
                req.finish = FinishReason.REJECTED_TOKEN
                # a library limit (e.g. llguidance's 2,000 items per parser row) shows up as a rejected
                # token: keep the library's own message as the request's error
                lib_err = getattr(m, "library_error", None)
                msg = lib_err() if lib_err is not None and ns != _REJECT else None
                if msg:
                    self._errors[request_id] = msg
                self._end(request_id)
                log.warning(
                    "request %r: %s rejected committed token %d",
                    request_id,
                    "the byte filter" if ns == _REJECT else "grammar",
                    t,
                )
                return j
            if u8 is not None:
                assert ns is not None  # the byte filter's next state (set above whenever u8 is)
                u8 = self._u8[request_id] = ns
            if doc is not None and tb is not None and t < len(tb):
                doc += tb[t]
            if m.is_terminated():
                req.finish = FinishReason.STOP
                if req.validator is not None:
                    self._check(req, request_id)
                self._end(request_id)
                return j + 1
        return len(tokens)

    def _check(self, req: _Request, request_id: Hashable) -> None:
        """The grammar accepted its end: check the JSON document; VIOLATION when it fails."""
        assert req.doc is not None and req.validator is not None
        v = check_document(bytes(req.doc), req.validator.validator, req.validator.validator_error)
        req.metrics["grammar_check"] = "passed" if v.ok and v.checked else "partial" if v.ok else "failed"
        if v.error is not None:
            req.metrics["grammar_check_error"] = v.error
        if not v.ok:
            req.finish = FinishReason.VIOLATION
            self._errors[request_id] = (
                f"{req.metrics.get('grammar_engine')} accepted an invalid document: {v.error}"
            )
            log.info("request %r: grammar_violation: %s", request_id, v.error)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


_COUNT_DEAD = _fastpath.COUNT_DEAD
_REJECT = 255  # ByteFilter.REJECT
_ByteFilter: Any  # None where the build predates it
try:
    from deepinfer_core._C.structured import ByteFilter as _ByteFilter
except (ImportError, AttributeError):  # pragma: no cover - depends on the build
    _ByteFilter = None
