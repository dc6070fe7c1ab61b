"""Parallel sampling (``SamplingParams.n`` > 1): one request, n samples, grouped back into one output.

``SampleGroups`` is owned by ``LLMEngine`` (rebuilt with the ``RequestTable`` by ``reset``). A request with
``n`` > 1 becomes n child requests (id ``rid + "\\x1f" + i``; sample i seeded ``seed + i``, vLLM's rule, or
from the engine seed when the request has none) added to the ``RequestTable``; the ``OutputBuilder`` groups
their outputs back under ``rid`` (engine/output_builder.py). Aborting the group ends every child through
``RequestTable.end``.

The prompt is prefilled once: with prefix caching on and a prompt of at least one block, samples 1..n-1
are held back until sample 0 has its first token (its prefill done, its prompt blocks published), then
queued; the scheduler admits them onto sample 0's prompt blocks by refcount (its prefix sharing), and each
computes only the prompt's tail (``prefix_tail`` tokens: the partial last block, and with SWA the window
the model replays) into blocks of its own, so no sample writes a shared block.
"""

from __future__ import annotations

import attrs

from deepinfer_core.engine.output_builder import OutputBuilder
from deepinfer_core.engine.outputs import ABORT, RequestOutput
from deepinfer_core.engine.request_table import RequestTable
from deepinfer_core.engine.requests import EngineRequest
from deepinfer_core.sampling_params import RequestOutputKind

SEP = "\x1f"  # child ids: rid + SEP + index (a control character no client id is expected to hold)


class SampleGroups:
    """The n > 1 requests' samples: fanned out at ``add``, the held ones queued by ``admit_held``."""

    def __init__(self, table: RequestTable, outputs: OutputBuilder, *, hold_min_prompt: int | None) -> None:
        """``hold_min_prompt``: the prompt length (a block) from which samples 1..n-1 wait for sample 0's
        prefill (None: prefix caching off, nothing is held)."""
        self.table = table
        self.outputs = outputs
        self.hold_min_prompt = hold_min_prompt
        self.held: dict[str, list[EngineRequest]] = {}  # group id -> samples 1..n-1 not queued yet

    def add(self, req: EngineRequest, kind: RequestOutputKind | None) -> None:
        """A valid request with n > 1: its group, then its n samples."""
        rid, text, ids, sp = req.request_id, req.prompt, req.prompt_token_ids, req.params
        self.outputs.group(rid, text, ids, sp, kind)
        kids = []
        for i in range(sp.n):
            cid = f"{rid}{SEP}{i}"
            csp = attrs.evolve(sp, n=1, best_of=None, seed=None if sp.seed is None else (sp.seed + i) % 2**63)
            self.outputs.add(cid, text, ids, csp, parent=rid, index=i)
            kids.append(EngineRequest(cid, text, ids, csp))
        self.table.add(kids[0])
        hold = self.hold_min_prompt
        if hold is not None and sp.so_args is None and len(ids) >= hold:
            self.held[rid] = kids[1:]
        else:
            for k in kids[1:]:
                self.table.add(k)

    def admit_held(self) -> None:
        """Queue the held samples of groups whose sample 0 has its first token (or ended)."""
        for rid, kids in list(self.held.items()):
            first = self.table.reqs.get(f"{rid}{SEP}0")
            if (
                first is not None
                and first.seq >= 0
                and first.reason is None
                and (self.table.live_info(first.request_id) or (1,))[0] == 0
            ):
                continue
            del self.held[rid]
            for k in kids:
                self.table.add(k)

    def abort(self, rid: str) -> bool:
        """End every sample of group ``rid`` (held ones are reported aborted by the next step)."""
        ended = False
        for k in self.held.pop(rid, []):
            self.outputs.failed(k.request_id, k.prompt, k.prompt_token_ids, None, ABORT)
            ended = True
        for cid in self.outputs.children(rid):
            req = self.table.reqs.get(cid)
            ended = (req is not None and self.table.end(req)) or ended
        return ended

    @property
    def num_held(self) -> int:
        return sum(len(k) for k in self.held.values())

    def fail_held(self, reason: str) -> list[RequestOutput]:
        """``reset``: the held samples' outputs, failed with ``reason``; nothing is held afterwards."""
        out = [self.outputs.reset_output(k, reason) for kids in self.held.values() for k in kids]
        self.held.clear()
        return out
