"""The offline API: ``LLM(...).generate(prompts, sampling_params)`` -> one ``RequestOutput`` per prompt."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.outputs import RequestOutput
from deepinfer_core.envs import Envs
from deepinfer_core.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


def _is_token_list(x: object) -> bool:
    """One prompt given as token ids: a non-empty list / tuple of ints, or a 1-D integer array."""
    if isinstance(x, np.ndarray):
        return x.ndim == 1 and x.dtype.kind in "iu"
    return (
        isinstance(x, list | tuple)
        and len(x) > 0
        and all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in x)
    )


def _as_prompt_list(prompts: object) -> list[object]:
    """The prompts of one ``generate`` call. A str, bytes, dict or token-id list / 1-D array is ONE prompt
    (bytes and odd dicts then fail as that request's error, never split); a 2-D integer array is one
    prompt per row; any other iterable is a list of prompts."""
    if isinstance(prompts, str | bytes | bytearray | memoryview | Mapping) or _is_token_list(prompts):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        return list(prompts) if prompts.ndim == 2 else [prompts]
    if hasattr(prompts, "__iter__"):
        return list(prompts)
    return [prompts]  # fails alone as a bad prompt


class LLM:
    """Offline generation, vLLM's ``LLM`` API, on the reference engine.

    ``model``: ``"tiny"`` (default: the trained checkpoint shipped in the package, with its BPE tokenizer;
    no download), ``"tiny-random"`` (the same config with weights drawn from ``seed``, byte tokenizer) or
    a release-format checkpoint directory (``config.json``, safetensors, ``tokenizer.json``).

    Keyword arguments are :class:`EngineConfig` fields, e.g.
    ``LLM(model="tiny", seed=0, backend="reference", num_blocks=256, max_num_seqs=16, async_scheduling=True)``.

    ``num_threads``: torch's CPU threads while the engine is built and while ``generate`` runs (restored
    after). Default 1: the reference model is dispatch-bound, so more threads buy little (the README job:
    0.94x the wall time for 1.9x the CPU on an idle 2-core machine) and on a shared, loaded machine were
    several times slower (docs/performance.md, engine); ``None`` leaves torch's setting alone.
    """

    def __init__(
        self, model: str = "tiny", *, num_threads: int | None = 1, envs: Envs | None = None, **kwargs: Any
    ) -> None:
        if num_threads is not None and (
            isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
        ):
            raise ValueError(f"num_threads={num_threads!r}: must be an int >= 1, or None (torch's setting)")
        self.num_threads = num_threads
        self.config = EngineConfig(model=model, **kwargs)
        with self._threads():
            self.engine = LLMEngine(self.config, envs=envs, num_threads=None)  # set here, around each call
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0
        self._generating = threading.Lock()  # concurrent generate calls run one after another

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        prev = torch.get_num_threads()
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            torch.set_num_threads(prev)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams
        | dict[str, Any]
        | Sequence[SamplingParams | dict[str, Any]]
        | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        ``prompts``: a str, a list of str, a list of token-id lists (or one token-id list / 1-D int array,
        or a 2-D int array: one prompt per row); vLLM's dict forms ``{"prompt": str}`` and
        ``{"prompt_token_ids": [...]}`` too. Concurrent calls from several threads run one after another.
        ``sampling_params``: one for all prompts, or one per prompt (a dict of SamplingParams fields is
        accepted too). A bad prompt or parameter fails that request alone: its output has ``error`` set.
        """
        items = _as_prompt_list(prompts)
        if isinstance(sampling_params, list | tuple):
            if len(sampling_params) != len(items):
                raise ValueError(
                    f"sampling_params: {len(sampling_params)} given for {len(items)} prompts; "
                    "give one, or one per prompt"
                )
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(items)
        with self._generating, self._threads():
            return self._generate(items, params, use_tqdm)

    def _generate(self, prompts: list[object], params: list[Any], use_tqdm: bool) -> list[RequestOutput]:
        eng = self.engine
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        foreign: list[RequestOutput] = []  # outputs of requests added through the step-level API
        try:
            for p, sp in zip(prompts, params):
                rid = str(self._next_id)
                while eng.is_live(rid):
                    self._next_id += 1
                    rid = str(self._next_id)
                self._next_id += 1
                ids.append(rid)
                eng.add_request(rid, p, sp, output_kind=RequestOutputKind.FINAL_ONLY)  # type: ignore[arg-type]
            mine = set(ids)
            t0, n_tok = time.perf_counter(), 0
            with tqdm(
                total=len(ids), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True
            ) as bar:
                while len(done) < len(ids):
                    for o in eng.step():
                        if o.request_id not in mine:  # another caller's request on the step-level API
                            foreign.append(o)
                            continue
                        if not o.finished:  # cannot happen for FINAL_ONLY requests; never count one early
                            continue
                        done[o.request_id] = o
                        n_tok += len(o.token_ids)
                        bar.update(1)
                        dt = time.perf_counter() - t0
                        bar.set_postfix_str(f"{n_tok / dt:.0f} out tok/s" if dt > 0 else "")
            # async scheduling plans one step ahead: the last request can end while a plan for it is still
            # in flight; with nothing else live, one more step applies it, so the engine is left idle
            for _ in range(4):
                if eng.num_live or not eng.has_unfinished():
                    break
                foreign.extend(eng.step())
        except BaseException:  # KeyboardInterrupt, or a bug: leave nothing of this call behind
            for rid in ids:
                if rid not in done:
                    eng.abort(rid)
            raise
        finally:
            eng.hand_back(foreign)  # the step-level caller gets them from its next step()
        failed = sum(1 for o in done.values() if not o.ok)
        if failed:
            log.warning("generate: %d of %d requests failed (see RequestOutput.error)", failed, len(ids))
        return [done[r] for r in ids]
