"""The offline API: ``LLM(...).generate(prompts, sampling_params)`` -> one ``RequestOutput`` per prompt."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.outputs import RequestOutput
from deepinfer_core.envs import Envs
from deepinfer_core.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


def _is_token_list(x: object) -> bool:
    return isinstance(x, list | tuple) and len(x) > 0 and all(isinstance(t, int | np.integer) and not isinstance(t, bool)
                                                              for t in x)


class LLM:
    """Offline generation on the built-in tiny model (random weights from ``seed``, byte tokenizer).

    Keyword arguments are :class:`EngineConfig` fields, e.g.
    ``LLM(model="tiny", seed=0, backend="reference", num_blocks=256, max_num_seqs=16, async_scheduling=True)``.

    ``num_threads``: torch's CPU threads while the engine is built and while ``generate`` runs (restored
    after). Default 1: the reference model is dispatch-bound, and torch's default of one thread per core
    was several times slower (docs/performance.md, engine); ``None`` leaves torch's setting alone.
    """

    def __init__(self, model: str = "tiny", *, num_threads: int | None = 1, envs: Envs | None = None,
                 **kwargs: Any) -> None:
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ValueError(f"num_threads={num_threads!r}: must be an int >= 1, or None (torch's setting)")
        self.num_threads = num_threads
        self.config = EngineConfig(model=model, **kwargs)
        with self._threads():
            self.engine = LLMEngine(self.config, envs=envs)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

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
        sampling_params: SamplingParams | dict[str, Any] | Sequence[SamplingParams | dict[str, Any]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        ``prompts``: a str, a list of str, a list of token-id lists (or one token-id list).
        ``sampling_params``: one for all prompts, or one per prompt (a dict of SamplingParams fields is
        accepted too). A bad prompt or parameter fails that request alone: its output has ``error`` set.
        """
        if isinstance(prompts, str) or _is_token_list(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if isinstance(sampling_params, list | tuple):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts; "
                                 "give one, or one per prompt")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        ids = []
        for p, sp in zip(prompts, params):
            rid = str(self._next_id)
            self._next_id += 1
            ids.append(rid)
            self.engine.add_request(rid, p, sp)
        done: dict[str, RequestOutput] = {}
        eng = self.engine
        t0, n_tok = time.perf_counter(), 0
        with self._threads(), tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm,
                                   dynamic_ncols=True) as bar:
            while eng.has_unfinished():
                for o in eng.step():
                    done[o.request_id] = o
                    n_tok += len(o.token_ids)
                    bar.update(1)
                    dt = time.perf_counter() - t0
                    bar.set_postfix_str(f"{n_tok / dt:.0f} out tok/s" if dt > 0 else "")
        failed = sum(1 for o in done.values() if not o.ok)
        if failed:
            log.warning("generate: %d of %d requests failed (see RequestOutput.error)", failed, len(ids))
        return [done[r] for r in ids]
