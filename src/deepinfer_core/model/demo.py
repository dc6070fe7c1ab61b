"""Demo: the tiny V4.1 model served through the executor, checked against its cache-free forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from deepinfer_core.model import DeepSeekV41, ForwardOutput, ModelExecutor
    from deepinfer_core.tokenizer import ByteTokenizer


def demo() -> None:
    from deepinfer_core.model import DeepSeekV41, tiny_config
    from deepinfer_core.tokenizer import ByteTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = DeepSeekV41.from_config(tiny_config(), seed=0, dtype=torch.float32)
        tok = ByteTokenizer()
        _demo_batch(model, tok)
        _demo_part2(model, tok)
        _demo_cache_bytes()
    finally:
        torch.set_num_threads(threads)


def _demo_batch(model: DeepSeekV41, tok: ByteTokenizer) -> None:
    """Two prompts prefilled in one batch, then decoded greedily together through the paged caches, each
    request's last logits checked against the cache-free forward."""
    from deepinfer_core.kv import PagedKVPool
    from deepinfer_core.model import ForwardBatch, ModelExecutor

    cfg = model.cfg
    prompts = [
        "The sliding window keeps the last sixteen tokens; the compressor pools pairs into entries.",
        "MoE routes each token to two of eight experts.",
    ]
    ids = [torch.tensor(tok.encode(p)) for p in prompts]
    pool = PagedKVPool(64, 16)
    ex = ModelExecutor(model, 64, 16, num_state_slots=4, quantize=False)
    gen = 6
    for i, t in enumerate(ids):
        pool.allocate(i, len(t) + gen)
    tables = pool.block_tables([0, 1])
    out = ex.execute(
        ForwardBatch(
            token_ids=torch.cat(ids).numpy(),
            query_lens=[len(t) for t in ids],
            start_pos=[0, 0],
            block_tables=tables,
            state_slots=[0, 1],
            num_logits=[1, 1],
        )
    )
    print(
        f"  tiny config (random weights): {cfg.num_hidden_layers} layers, attention kinds "
        f"{[cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]}"
    )
    print(
        f"  prefill of two prompts ({' + '.join(str(len(t)) for t in ids)} tokens) in one batch; tokens "
        f"routed to each of the 8 experts at layer 4: {out.expert_counts[4].tolist()}"
    )
    seqs = [t.tolist() for t in ids]
    out = _decode_greedy(ex, out, seqs, tables, gen)
    for i, s in enumerate(seqs):  # the last step's logits follow every token of s
        full = model.forward_full(torch.tensor(s))[0][-1]
        print(
            f"  request {i}: {gen} greedy tokens decoded through the paged caches {s[-gen:]}; logits equal "
            f"the cache-free forward's to {(out.logits[i] - full).abs().max().item():.1e} (largest difference, "
            f"{len(s)} tokens)"
        )


def _decode_greedy(
    ex: ModelExecutor, out: ForwardOutput, seqs: list[list[int]], tables: np.ndarray, gen: int
) -> ForwardOutput:
    """``gen`` greedy decode steps of every request together, from the prefill's ``out``; each step's
    token is appended to its request's ``seqs`` entry. Returns the last step's output."""
    from deepinfer_core.model import ForwardBatch

    for _ in range(gen):
        nxt = out.logits.argmax(-1).tolist()
        for s, n in zip(seqs, nxt):
            s.append(n)
        out = ex.execute(
            ForwardBatch(
                token_ids=np.array(nxt),
                query_lens=[1, 1],
                start_pos=[len(s) - 1 for s in seqs],
                block_tables=tables,
                state_slots=[0, 1],
                num_logits=[1, 1],
            )
        )
    return out


def _demo_cache_bytes() -> None:
    """The full-size V4.1-Flash config's cache bytes per token and persisted SWA bytes per sequence."""
    from deepinfer_core.model import flash_config
    from deepinfer_core.model.cache import CacheFormats

    f = flash_config()
    fmt = CacheFormats.make(f.head_dim, f.index_head_dim, quantize=True, dtype=torch.float32)
    ring = f.sliding_window + 6
    print(
        f"  full-size V4.1-Flash cache bytes per token: main KV FP4 {fmt.main.bytes_per_token}, SWA ring FP8 "
        f"{fmt.swa.bytes_per_token}, indexer MXFP4 {fmt.index.bytes_per_token}; persisted SWA "
        f"{f.encoder_layers} x {ring} x {fmt.swa.bytes_per_token} = "
        f"{f.encoder_layers * ring * fmt.swa.bytes_per_token:,} B per sequence"
    )


def _demo_part2(model: DeepSeekV41, tok: ByteTokenizer) -> None:
    """DSpark drafts verified losslessly (MTPVarlen picks how many), under an EPLB placement."""
    from deepinfer_core.eplb import rebalance_experts
    from deepinfer_core.kv import PagedKVPool
    from deepinfer_core.model import ForwardBatch, ModelExecutor

    cfg = model.cfg
    load = np.random.default_rng(0).pareto(1.0, (cfg.num_hidden_layers, cfg.n_routed_experts)) + 0.1
    phy2log, log2phy, logcnt = rebalance_experts(load, 12, 1, 1, 4)
    model.set_expert_placement(phy2log, log2phy, logcnt)
    print(
        f"  mHC: the residual carried as {cfg.hc_mult} streams mixed by Sinkhorn-normalised matrices "
        f"({cfg.hc_sinkhorn_iters} iterations); Engram n-gram tables at layers {list(cfg.engram_layer_ids)}; "
        f"experts placed by EPLB on 12 slots (8 experts + 4 replicas), copies per expert at layer 0: "
        f"{logcnt[0].tolist()}"
    )
    prompt = torch.tensor(
        tok.encode("Speculative decoding drafts five tokens and verifies them in one step.")
    )
    pool = PagedKVPool(32, 16)
    pool.allocate(0, len(prompt) + 40)
    ex = ModelExecutor(model, 32, 16, num_state_slots=2, quantize=False)
    table = pool.block_tables([0])
    out = ex.execute(
        ForwardBatch(
            token_ids=prompt.numpy(),
            query_lens=[len(prompt)],
            start_pos=[0],
            block_tables=table,
            state_slots=[0],
            num_logits=[1],
            draft=[True],
        )
    )
    emitted, steps = _speculate(ex, out, table, len(prompt), cfg.dspark_block_size)
    full = model.forward_full(torch.cat((prompt, torch.tensor(emitted[:-1]))))[0]
    greedy = full[len(prompt) - 1 :].argmax(-1).tolist()
    print(
        f"  {len(emitted)} tokens in {steps} verify steps, identical to plain greedy decoding (verification is "
        f"lossless): {greedy == emitted}"
    )
    model.set_expert_placement(None)


def _speculate(
    ex: ModelExecutor, out: ForwardOutput, table: np.ndarray, q: int, max_drafts: int
) -> tuple[list[int], int]:
    """Verify steps from the prefill's ``out`` (request 0, ``q`` tokens in) until 12 tokens are emitted:
    MTPVarlen picks how many of the drafter's proposals to verify. Returns (emitted tokens, steps)."""
    from deepinfer_core.model import ForwardBatch
    from deepinfer_core.spec import MTPVarlen, StepTimeProfile

    policy = MTPVarlen(StepTimeProfile.published(), max_drafts=max_drafts)
    emitted, steps = [int(out.next_token[0])], 0
    while len(emitted) < 12:
        conf = out.draft_confidence.numpy()
        n = int(policy.plan(conf, None).lengths[0])
        d = out.drafts[0, :n]
        fed = np.concatenate(([emitted[-1]], d.numpy()))
        out = ex.execute(
            ForwardBatch(
                token_ids=fed,
                query_lens=[n + 1],
                start_pos=[q],
                block_tables=table,
                state_slots=[0],
                num_logits=[n + 1],
                verify_lens=[n],
                draft=[True],
            )
        )
        a = int(out.num_accepted[0])
        emitted += [*d[:a].tolist(), int(out.next_token[0])]
        q += a + 1
        steps += 1
        if steps == 1:
            print(
                f"  speculative step 1: the DSpark drafter proposed {d.tolist()} with confidences "
                f"{[round(float(c), 2) for c in conf[0]]}; MTPVarlen verified {n}, the target accepted {a} "
                f"(an untrained drafter rarely matches; the point is the next line)"
            )
    return emitted, steps


if __name__ == "__main__":
    demo()
