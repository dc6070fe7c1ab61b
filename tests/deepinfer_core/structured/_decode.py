"""A random-logit "model" decoding through the StructuredOutputManager, with mock speculative drafts.

Each step every live request proposes up to ``k`` drafts from a shadow matcher (mostly grammatical, with
random junk tokens mixed in so the manager has to cut), the manager fills ``1 + k`` rows, the "target"
samples each row from masked random logits, and a mock verifier accepts a prefix of the surviving drafts
by coin flips, then appends the bonus token of the next row. The committed text must satisfy the grammar.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_core.structured import FinishReason, GrammarSpec, StructuredOutputManager
from deepinfer_kernels import get_op

apply_token_bitmask = get_op("apply_token_bitmask")


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = (bitmask_row.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return np.flatnonzero(bits.flatten()[:vocab].numpy())


def decode_batch(
    backend: object,
    specs: list[GrammarSpec],
    seed: int,
    *,
    max_drafts: int = 3,
    max_steps: int = 400,
) -> tuple[list[list[int]], list[FinishReason | None], StructuredOutputManager]:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    mgr = StructuredOutputManager(backend, compile_workers=1)
    vocab = mgr.vocab_size
    shadows: list[object] = []
    for i, s in enumerate(specs):
        mgr.add_request(i, s)
        try:
            shadows.append(backend.matcher(backend.compile(s)))
        except ValueError:  # the manager reports it as INVALID_GRAMMAR
            shadows.append(None)
    mgr.wait(range(len(specs)))
    out: list[list[int]] = [[] for _ in specs]
    live = [i for i in range(len(specs)) if mgr.finish_reason(i) is None]
    scratch = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    for _ in range(max_steps):
        if not live:
            break
        batch = []
        for i in live:
            sh, drafts, taken = shadows[i], [], 0
            for _ in range(int(rng.integers(0, max_drafts + 1))):
                if sh.is_terminated():
                    break
                if rng.random() < 0.15:
                    drafts.append(int(rng.integers(0, vocab)))  # junk: usually rejected -> cut
                    break
                sh.fill_next_token_bitmask(scratch, 0)
                ok = allowed_ids(scratch[0], vocab)
                if len(ok) == 0:
                    break
                t = int(rng.choice(ok))
                assert sh.accept_token(t)
                drafts.append(t)
                taken += 1
            sh.rollback(taken)
            batch.append((i, drafts))
        bm = mgr.fill_bitmask(batch)
        logits = torch.randn(bm.num_rows, vocab, generator=gen) * 3.0
        apply_token_bitmask(logits, bm.bitmask)
        for j, (i, drafts) in enumerate(batch):
            if bm.dead_end[j]:
                continue
            base, k = int(bm.offsets[j]), int(bm.num_drafts[j])
            acc = 0
            while acc < k and rng.random() < 0.7:
                acc += 1
            row = logits[base + acc]
            assert not torch.isnan(row).any()
            bonus = int(torch.multinomial(torch.softmax(row, -1), 1, generator=gen))
            commit = [*drafts[:acc], bonus]
            n = mgr.advance(i, commit)
            out[i].extend(commit[:n])
            for t in commit[:n]:  # the shadow follows the committed text
                assert shadows[i].accept_token(t)
        live = [i for i in live if mgr.finish_reason(i) is None]
    return out, [mgr.finish_reason(i) for i in range(len(specs))], mgr
