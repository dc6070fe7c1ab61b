"""Parallel sampling (``SamplingParams.n`` > 1): one request, n samples, grouped back into one output.

``SampleGroups`` is owned by ``LLMEngine``. A request with ``n`` > 1 becomes n child requests (id
``rid + "\\x1f" + i``; sample i seeded ``seed + i``, vLLM's rule, or from the engine seed when the request
has none); the output builder groups their outputs back under ``rid`` (engine/output_builder.py).

The prompt is prefilled once: with prefix caching on and a prompt of at least one block, samples 1..n-1
are held back until sample 0 has its first token (its prefill done, its prompt blocks published), then
queued; the scheduler admits them onto sample 0's prompt blocks by refcount (its prefix sharing), and each
computes only the prompt's tail (``prefix_tail`` tokens: the partial last block, and with SWA the window
the model replays) into blocks of its own, so no sample writes a shared block.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from deepinfer_core.engine.outputs import ABORT, ERROR, RequestOutput
from deepinfer_core.engine.requests import EngineRequest
from deepinfer_core.sampling_params import RequestOutputKind, SamplingParams

SEP = "\x1f"  # child ids: rid + SEP + index (a control character no client id is expected to hold)


class GroupHost(Protocol):
    """What ``SampleGroups`` uses of the engine."""

    output_builder: Any
    prefix: Any
    config: Any
    _reqs: dict[str, EngineRequest]

    def _add_one(self, req: EngineRequest) -> None: ...

    def _live_info(self, rid: str) -> tuple[int, int | None] | None: ...

    def _fail_early(
        self, rid: str, text: str | None, ids: tuple[int, ...], msg: str | None, reason: str = ...
    ) -> None: ...

    def abort(self, request_id: str) -> bool: ...


class SampleGroups:
    def __init__(self, host: GroupHost) -> None:
        self.host = host
        self.held: dict[str, list[EngineRequest]] = {}  # group id -> samples 1..n-1 not queued yet

    def add(
        self,
        rid: str,
        text: str | None,
        ids: tuple[int, ...],
        sp: SamplingParams,
        kind: RequestOutputKind | None,
    ) -> None:
        h = self.host
        h.output_builder.group(rid, text, ids, sp, kind)
        kids = []
        for i in range(sp.n):
            cid = f"{rid}{SEP}{i}"
            csp = attrs.evolve(sp, n=1, best_of=None, seed=None if sp.seed is None else (sp.seed + i) % 2**63)
            h.output_builder.add(cid, text, ids, csp, parent=rid, index=i)
            kids.append(EngineRequest(cid, text, ids, csp))
        h._add_one(kids[0])
        if h.prefix is not None and sp.so_args is None and len(ids) >= h.config.block_size:
            self.held[rid] = kids[1:]
        else:
            for k in kids[1:]:
                h._add_one(k)

    def admit_held(self) -> None:
        """Queue the held samples of groups whose sample 0 has its first token (or ended)."""
        h = self.host
        for rid, kids in list(self.held.items()):
            first = h._reqs.get(f"{rid}{SEP}0")
            if (
                first is not None
                and first.seq >= 0
                and first.reason is None
                and (h._live_info(first.request_id) or (1,))[0] == 0
            ):
                continue
            del self.held[rid]
            for k in kids:
                h._add_one(k)

    def abort(self, rid: str) -> bool:
        """End every sample of group ``rid`` (held ones are reported aborted by the next step)."""
        h = self.host
        ended = False
        for k in self.held.pop(rid, []):
            h._fail_early(k.request_id, k.prompt, k.prompt_token_ids, None, ABORT)
            ended = True
        for cid in h.output_builder.children(rid):
            ended = (cid in h._reqs and h.abort(cid)) or ended
        return ended

    @property
    def num_held(self) -> int:
        return sum(len(k) for k in self.held.values())

    def fail_held(self, reason: str) -> list[RequestOutput]:
        """``reset``: the held samples' outputs, failed with ``reason``; nothing is held afterwards."""
        out = [
            RequestOutput(
                request_id=k.request_id,
                prompt=k.prompt,
                prompt_token_ids=k.prompt_token_ids,
                finish_reason=ERROR,
                error=reason,
            )
            for kids in self.held.values()
            for k in kids
        ]
        self.held.clear()
        return out
