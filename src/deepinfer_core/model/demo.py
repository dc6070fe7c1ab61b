"""Demo: the tiny V4.1 model served through the executor, checked against its cache-free forward."""

from __future__ import annotations

import time

import numpy as np
import torch


def demo() -> None:
    from deepinfer_core.kv import PagedKVPool
    from deepinfer_core.model import DeepSeekV41, ForwardBatch, ModelExecutor, flash_config, tiny_config
    from deepinfer_core.model.cache import CacheFormats
    from deepinfer_core.tokenizer import ByteTokenizer

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = tiny_config()
        model = DeepSeekV41.from_config(cfg, seed=0, dtype=torch.float32)
        tok = ByteTokenizer()
        prompts = ["The sliding window keeps the last sixteen tokens; the compressor pools pairs into entries.",
                   "MoE routes each token to two of eight experts."]
        ids = [torch.tensor(tok.encode(p)) for p in prompts]
        pool = PagedKVPool(64, 16)
        ex = ModelExecutor(model, 64, 16, num_state_slots=4, quantize=False)
        gen = 6
        for i, t in enumerate(ids):
            pool.allocate(i, len(t) + gen)
        tables = pool.block_tables([0, 1])
        out = ex.execute(ForwardBatch(token_ids=torch.cat(ids).numpy(), query_lens=[len(t) for t in ids],
                                      start_pos=[0, 0], block_tables=tables, state_slots=[0, 1], num_logits=[1, 1]))
        print(f"  tiny config: {cfg.num_hidden_layers} layers {[cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]}")
        print(f"  prefill of {[len(t) for t in ids]} tokens in one batch; expert load layer 4: {out.expert_counts[4].tolist()}")
        seqs = [t.tolist() for t in ids]
        for _ in range(gen):  # greedy decode both requests together
            nxt = out.logits.argmax(-1).tolist()
            for s, n in zip(seqs, nxt):
                s.append(n)
            out = ex.execute(ForwardBatch(token_ids=np.array(nxt), query_lens=[1, 1],
                                          start_pos=[len(s) - 1 for s in seqs], block_tables=tables,
                                          state_slots=[0, 1], num_logits=[1, 1]))
        for i, s in enumerate(seqs):  # the last step's logits follow every token of s
            full = model.forward_full(torch.tensor(s))[0][-1]
            print(f"  request {i}: greedy ids {s[-gen:]}; cached decode vs full forward max |dlogit| = "
                  f"{(out.logits[i] - full).abs().max().item():.2e} after {len(s)} tokens (random weights)")
        f = flash_config()
        fmt = CacheFormats.make(f.head_dim, f.index_head_dim, quantize=True, dtype=torch.float32)
        ring = f.sliding_window + 6
        print(f"  V4.1-Flash bytes/token: main KV FP4 {fmt.main.bytes_per_token}, SWA ring FP8 "
              f"{fmt.swa.bytes_per_token}, indexer MXFP4 {fmt.index.bytes_per_token}; persisted SWA "
              f"{f.encoder_layers} x {ring} x {fmt.swa.bytes_per_token} = "
              f"{f.encoder_layers * ring * fmt.swa.bytes_per_token:,} B per sequence")
        print(f"  ({time.perf_counter() - t0:.1f} s)")
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    demo()
