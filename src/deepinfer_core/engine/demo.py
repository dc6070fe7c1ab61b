"""Demo: offline generation through the reference engine on the built-in tiny model (no download)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from deepinfer_core.extras import MissingExtraError, install_hint
from deepinfer_core.structured import require_any_engine

if TYPE_CHECKING:
    from deepinfer_core.engine import LLM, RequestOutput
    from deepinfer_core.sampling_params import SamplingParams


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def demo() -> None:
    from deepinfer_core.engine import LLM

    # LLM pins torch to one CPU thread while it works (num_threads=1, the default): the tiny model is
    # dispatch-bound, so more threads only contend.
    llm = LLM(seed=0, num_blocks=128, max_num_seqs=8, async_scheduling=True)
    prompts, params, outs = _batch(llm)
    _exact_and_speculative(prompts, params, outs)
    st = llm.engine.stats
    print(
        f"  the batch took {st.steps} steps: {st.execute_s:.2f} s running the model, "
        f"{st.schedule_s + st.build_s + st.sample_s + st.update_s:.3f} s in the engine around it "
        f"(scheduling, batch building, masks, sampling)"
    )


def _batch(llm: LLM) -> tuple[list[str], list[SamplingParams], list[RequestOutput]]:
    """Five requests batched together (the structured ones when the extra is installed)."""
    from deepinfer_core.sampling_params import SamplingParams

    what = {
        "tiny": "the shipped checkpoint, trained on Python sources: code prompts read best",
        "tiny-random": "random weights: the text is noise by design",
    }.get(llm.config.model, "a checkpoint directory")
    print(
        f"  model {llm.config.model!r} ({what}), {llm.config.dtype}, FP4/FP8 KV caches; 5 requests batched "
        f"together, scheduled one step ahead"
    )
    prompts = ["import os\n\n\ndef ", "class Stack:\n    def ", "Give me a ticket code: ", "", "Which pet? "]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=16, so_args={"regex": r"[0-9]{3}-[a-z]{2,4}"}),
        SamplingParams(max_tokens=4),
        SamplingParams(temperature=1.0, seed=3, max_tokens=16, so_args={"choice": ["cat", "dog", "axolotl"]}),
    ]
    labels = [
        "greedy",
        "sampled, T=0.8 top-p 0.9",
        "regex [0-9]{3}-[a-z]{2,4}",
        "empty prompt",
        "choice of cat/dog/axolotl",
    ]
    try:
        require_any_engine()
        structured = True
    except MissingExtraError:  # a plain install: no structured extra
        structured = False
    if not structured:
        keep = [i for i, sp in enumerate(params) if sp.so_args is None]
        prompts, params, labels = (
            [prompts[i] for i in keep],
            [params[i] for i in keep],
            [labels[i] for i in keep],
        )
        print(f"  (the regex and choice requests are left out: {install_hint('structured')} adds them)")
    # The empty prompt is refused on purpose and shown below: keep the engine's warning about it quiet.
    eng_log = logging.getLogger("deepinfer_core.engine")
    level = eng_log.level
    eng_log.setLevel(logging.ERROR)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        eng_log.setLevel(level)
    _show(llm, prompts, labels, outs)
    return prompts, params, outs


def _show(llm: LLM, prompts: list[str], labels: list[str], outs: list[RequestOutput]) -> None:
    from deepinfer_core.display import printable, printable_completion

    token_bytes = llm.engine.tokenizer.token_bytes()
    for p, label, o in zip(prompts, labels, outs):
        if o.ok:
            text = printable_completion(o.text, o.token_ids, token_bytes)
            print(
                f"  {label:26s} {printable(p)!r} -> {text!r} ({len(o.token_ids)} tokens, "
                f"ended by {o.finish_reason})"
            )
        else:
            print(f"  {label:26s} {p!r} -> refused alone, as it should be: {o.error}")


def _exact_and_speculative(
    prompts: list[str], params: list[SamplingParams], outs: list[RequestOutput]
) -> None:
    from deepinfer_core.engine import LLM

    # Exact mode (float64, unquantised caches): the engine's greedy tokens are the argmax of the
    # cache-free full forward, token for token.
    exact = LLM(seed=0, dtype="float64", quantize=False, num_blocks=32, max_num_seqs=2)
    o = exact.generate(prompts[:1], params[:1], use_tqdm=False)[0]
    seq = torch.tensor(list(o.prompt_token_ids) + list(o.token_ids[:-1]))
    ref = exact.engine.model.forward_full(seq)[0][len(o.prompt_token_ids) - 1 :].argmax(-1).tolist()
    same = _common_prefix(list(outs[0].token_ids), list(o.token_ids))
    n = len(o.token_ids)
    default = (
        f"gives the same {n} tokens"
        if same == n
        else f"keeps the same first {same} of {n} tokens (quantised caches move the logits slightly)"
    )
    print(
        f"  exact mode (float64, unquantised caches): greedy tokens == argmax of the cache-free forward: "
        f"{ref == list(o.token_ids)}; the default float32 + FP4/FP8 engine {default}"
    )
    # Speculative decoding (DSpark drafts verified in the step) must not change the greedy tokens.
    spec = LLM(seed=0, dtype="float64", quantize=False, num_blocks=32, max_num_seqs=2, speculative=True)
    so = spec.generate(prompts[:1], params[:1], use_tqdm=False)[0]
    book = spec.engine.drafts
    assert book is not None  # speculative=True keeps a draft book
    note = " (a rejected draft costs only its verify slot: the tokens are the same either way)"
    print(
        f"  speculative=True: same greedy tokens: {so.token_ids == o.token_ids}; {book.accepted} of "
        f"{book.verified} drafts accepted, {spec.engine.stats.steps} steps instead of "
        f"{exact.engine.stats.steps}{note}"
    )


if __name__ == "__main__":
    demo()
