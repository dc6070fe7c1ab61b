"""Test driver for DSpark steps: verify + draft through a Session's executor."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_core.model.batch import ForwardBatch, ForwardOutput

from .session import Session


def spec_step(
    s: Session,
    items: list[tuple[int, torch.Tensor, int, int, int, bool]],
    temperature: list[float] | None = None,
) -> ForwardOutput:
    """items: (seq_id, tokens, start_pos, num_logits, verify_len, draft)."""
    for sid, toks, start, *_ in items:
        s._ensure(sid, start + len(toks))
    ids = [it[0] for it in items]
    b = ForwardBatch(
        token_ids=np.concatenate([it[1].numpy() for it in items]),
        query_lens=[len(it[1]) for it in items],
        start_pos=[it[2] for it in items],
        block_tables=s.pool.block_tables(ids),
        state_slots=[s.slot[sid] for sid in ids],
        num_logits=[it[3] for it in items],
        verify_lens=[it[4] for it in items],
        draft=[it[5] for it in items],
        temperature=temperature,
    )
    return s.ex.execute(b)


def greedy_plain(s: Session, prompts: dict[int, torch.Tensor], n: int) -> dict[int, list[int]]:
    """Greedy decode without speculation: n tokens per prompt."""
    _out, per = s.step([(sid, p, 0, 1) for sid, p in prompts.items()])
    toks = {sid: [int(per[i][-1].argmax())] for i, sid in enumerate(prompts)}
    for k in range(n - 1):
        items = [(sid, torch.tensor(toks[sid][-1:]), len(p) + k, 1) for sid, p in prompts.items()]
        _, per = s.step(items)
        for i, sid in enumerate(prompts):
            toks[sid].append(int(per[i][-1].argmax()))
    return toks


def greedy_spec(
    s: Session, prompts: dict[int, torch.Tensor], n: int, lengths_of=None, temperature: float = 0.0
):
    """Greedy decode with DSpark drafts verified losslessly; ``lengths_of(conf [R, B]) -> [R]`` picks how
    many drafts to verify (default all); ``temperature`` > 0 goes through the sampling path instead.
    Returns (tokens per prompt, accepted counts per step)."""
    sids = list(prompts)
    temp = [temperature] * len(sids)
    out = spec_step(s, [(sid, p, 0, 1, 0, True) for sid, p in prompts.items()], temp)
    q = {sid: len(prompts[sid]) for sid in sids}
    toks = {sid: [int(out.next_token[i])] for i, sid in enumerate(sids)}
    accepted: list[list[int]] = []
    while min(len(t) for t in toks.values()) < n:
        conf = out.draft_confidence.cpu().numpy()
        lens = [out.drafts.shape[1]] * len(sids) if lengths_of is None else [int(v) for v in lengths_of(conf)]
        drafts = out.drafts.cpu()
        items = [
            (
                sid,
                torch.cat((torch.tensor(toks[sid][-1:]), drafts[i, : lens[i]])),
                q[sid],
                lens[i] + 1,
                lens[i],
                True,
            )
            for i, sid in enumerate(sids)
        ]
        out = spec_step(s, items, temp)
        step_acc = []
        for i, sid in enumerate(sids):
            a = int(out.num_accepted[i])
            assert 0 <= a <= lens[i]
            toks[sid] += [*drafts[i, :a].tolist(), int(out.next_token[i])]
            q[sid] += a + 1
            step_acc.append(a)
        accepted.append(step_acc)
    return {sid: t[:n] for sid, t in toks.items()}, accepted
