"""Demo: offline generation through the reference engine on the tiny model (random weights, byte tokenizer)."""

from __future__ import annotations

import time

import torch


def demo() -> None:
    from deepinfer_core.engine import LLM
    from deepinfer_core.sampling_params import SamplingParams

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is dispatch-bound: one thread is fastest on a shared CPU
    try:
        llm = LLM(seed=0, num_blocks=128, max_num_seqs=8, async_scheduling=True)
        prompts = ["The sliding window keeps the last sixteen tokens.", "MoE routes each token to two experts.",
                   "Give me a ticket code: ", "", "Which pet? "]
        params = [
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=7, max_tokens=16, so_args={"regex": r"[0-9]{3}-[a-z]{2,4}"}),
            SamplingParams(max_tokens=4),
            SamplingParams(temperature=1.0, seed=3, max_tokens=16, so_args={"choice": ["cat", "dog", "axolotl"]}),
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for p, sp, o in zip(prompts, params, outs):
            how = "greedy" if sp.greedy else f"T={sp.temperature} seed={sp.seed}"
            if sp.so_args:
                how += f" {sp.so_args}"
            shown = repr(o.text) if o.ok else f"ERROR {o.error}"
            print(f"  [{how}] {p!r} -> {shown} ({len(o.token_ids)} tokens, {o.finish_reason})")
        # exact mode (float64, raw KV): the greedy stream equals the argmax of the cache-free full forward
        exact = LLM(seed=0, dtype="float64", quantize=False, num_blocks=32, max_num_seqs=2)
        o = exact.generate(prompts[:1], params[:1], use_tqdm=False)[0]
        seq = torch.tensor(list(o.prompt_token_ids) + list(o.token_ids[:-1]))
        ref = exact.engine.model.forward_full(seq)[0][len(o.prompt_token_ids) - 1:].argmax(-1).tolist()
        agree = sum(a == b for a, b in zip(outs[0].token_ids, o.token_ids))
        print(f"  float64 raw-KV engine: greedy stream == argmax of forward_full: {ref == list(o.token_ids)}; "
              f"default float32 + FP4/FP8 KV agrees on {agree}/{len(o.token_ids)} tokens (random weights)")
        # speculative decoding (DSpark drafts verified in the step): the same greedy stream
        spec = LLM(seed=0, dtype="float64", quantize=False, num_blocks=32, max_num_seqs=2, speculative=True)
        so = spec.generate(prompts[:1], params[:1], use_tqdm=False)[0]
        book = spec.engine.drafts
        print(f"  speculative=True: same greedy stream: {so.token_ids == o.token_ids}; {book.verified} drafts "
              f"verified, {book.accepted} accepted (random weights: low acceptance); "
              f"{spec.engine.stats.steps} steps vs {exact.engine.stats.steps}")
        st = llm.engine.stats
        print(f"  {st.steps} steps; time in execute {st.execute_s:.2f} s, schedule+build+sample+update "
              f"{st.schedule_s + st.build_s + st.sample_s + st.update_s:.3f} s; ({time.perf_counter() - t0:.1f} s)")
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    demo()
