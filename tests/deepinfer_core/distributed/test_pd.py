"""P/D hand-off in one process: PROMPT engine -> Handoff -> COMPLETION engine, against a NORMAL engine
(batch-invariant mode, fresh prompts and seeds). The torchrun test sends the same packages over gloo."""

from __future__ import annotations

import random

import attrs
import pytest
import torch

from deepinfer_core.distributed.pd import CompletionEngine, PromptEngine
from deepinfer_core.engine import LLM, EngineConfig
from deepinfer_core.sampling_params import SamplingParams

CFG = EngineConfig(seed=3, num_blocks=128, max_num_seqs=8, batch_invariant=True)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _case(seed: int) -> tuple[list[str], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [
        "".join(rng.choice("abcdefghij klmnopq,.") for _ in range(rng.randint(17, 90))) for _ in range(4)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(3, 7), ignore_eos=True),
        SamplingParams(temperature=0.9, seed=seed, max_tokens=rng.randint(3, 7), ignore_eos=True),
        SamplingParams(temperature=1.1, top_k=30, max_tokens=rng.randint(3, 7), ignore_eos=True),  # no seed
        SamplingParams(temperature=0.8, seed=seed + 1, max_tokens=1, ignore_eos=True),
    ]  # ends on the P side
    return prompts, params


def test_handoff_tokens_equal_normal_engine() -> None:
    seed = random.randrange(2**31)
    prompts, params = _case(seed)
    pe, ce = PromptEngine(CFG), CompletionEngine(CFG)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        pe.add_request(str(i), p, sp)
    done, handoffs = {}, []
    while pe.has_unfinished():
        outs, ready = pe.step()
        done.update({o.request_id: o for o in outs})
        handoffs += ready
    assert sorted(done) == ["3"] and done["3"].finish_reason == "length" and len(done["3"].token_ids) == 1
    assert sorted(h.request_id for h in handoffs) == ["0", "1", "2"]
    for h in handoffs:
        assert h.num_tokens == len(h.prompt_token_ids) and h.params.seed is not None and h.nbytes > 0
        ce.add_handoff(h)
    while ce.has_unfinished():
        done.update({o.request_id: o for o in ce.step() if o.finished})
    # the NORMAL engine gets the resolved seed of the unseeded request (the PROMPT engine picked it)
    seeds = {h.request_id: h.params.seed for h in handoffs}
    ref_params = [attrs.evolve(sp, seed=seeds.get(str(i), sp.seed)) for i, sp in enumerate(params)]
    want = [
        o.token_ids
        for o in LLM(
            **{k: getattr(CFG, k) for k in ("seed", "num_blocks", "max_num_seqs", "batch_invariant")}
        ).generate(prompts, ref_params, use_tqdm=False)
    ]
    got = [done[str(i)].token_ids for i in range(len(prompts))]
    assert got == want, f"seed {seed}"
    assert all(done[str(i)].ok and done[str(i)].prompt == prompts[i] for i in range(len(prompts)))


def test_handoff_errors() -> None:
    pe = PromptEngine(CFG)
    pe.add_request("a", "some prompt text", SamplingParams(max_tokens=4, ignore_eos=True))
    ready = []
    while pe.has_unfinished():
        ready += pe.step()[1]
    (h,) = ready
    with pytest.raises(ValueError, match="block_size"):
        CompletionEngine(attrs.evolve(CFG, block_size=8)).add_handoff(h)
    with pytest.raises(ValueError, match="not supported with P/D"):
        PromptEngine(attrs.evolve(CFG, speculative=True, num_speculative_tokens=2))


def test_replay_handoff_persisted_half_equals_normal_engine() -> None:
    # DeepInfer's shape: blocks before the hit + the encoder rings at it; the COMPLETION side replays the
    # rest (exact mode: the decoder tail's whole dependency span). float64, so summation order cannot
    # flip a token between the replayed chunking and the NORMAL engine's one-chunk prefill.
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    cfg = attrs.evolve(CFG, dtype="float64")
    params = [
        SamplingParams(temperature=0.0 if i == 0 else 0.9, seed=seed + i, max_tokens=4, ignore_eos=True)
        for i in range(3)
    ]
    pe, ce = PromptEngine(cfg, mode="replay", replay="exact"), CompletionEngine(cfg, replay="exact")
    # the tokenizer merges characters, so a prompt's token count is drawn through it: keep drawing until
    # each prompt is long enough for a hit (the case under test), without capping it at a fixed length
    prompts: list[str] = []
    while len(prompts) < 3:
        p = "".join(rng.choice("abcdefghij klmnopq,.") for _ in range(rng.randint(85, 220)))
        if pe.hit_of(len(pe.engine.tokenizer.encode(p))) > 0:
            prompts.append(p)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        pe.add_request(str(i), p, sp)
    handoffs = []
    while pe.has_unfinished():
        outs, ready = pe.step()
        assert outs == []
        handoffs += ready
    ex = pe.engine.executor
    # (a request whose rings position the engine's prefix cache also wanted, differently, hands its full
    # state instead: see PromptEngine; with distinct prompts that should not happen)
    assert [h.mode for h in handoffs] == ["replay"] * 3, f"seed {seed}"
    for h in handoffs:
        assert h.hit == pe.hit_of(h.num_tokens) and h.hit % cfg.block_size == 0
        assert h.hit > 0, f"seed {seed}: prompt of {h.num_tokens} tokens got no hit (the test needs one)"
        assert set(h.state) == {"rings"}  # the persisted half only: encoder rings
        assert tuple(h.state["rings"].shape) == (
            pe.engine.model_config.encoder_layers,
            ex.swa_ring,
            ex.fmt.swa.bytes_per_token,
        )
        assert all(t.shape[0] == h.hit // cfg.block_size for t in h.blocks.values())
        ce.add_handoff(h)
    done = {}
    while ce.has_unfinished():
        done.update({o.request_id: o for o in ce.step() if o.finished})
    assert ce.replayed_tokens > 0
    want = [
        o.token_ids
        for o in LLM(
            **{k: getattr(cfg, k) for k in ("seed", "num_blocks", "max_num_seqs", "batch_invariant", "dtype")}
        ).generate(prompts, params, use_tqdm=False)
    ]
    assert [done[str(i)].token_ids for i in range(3)] == want, f"seed {seed}"


def test_replay_handoff_with_prefix_hits_on_the_prompt_side() -> None:
    # prompts sharing a prefix: the PROMPT engine's own prefix cache skips (or runs encoder-only) part of a
    # later prompt, possibly where the hand-off's rings would be taken; such a request hands its full
    # state instead. Either way the tokens equal a NORMAL engine's.
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    cfg = attrs.evolve(CFG, dtype="float64")
    a = "".join(rng.choice("abcdefghij klmnopq,.") for _ in range(130))
    rounds = [[a], [a + " and more", a[:110] + "xy z", a[:70]]]
    sp = SamplingParams(temperature=0.8, seed=seed % 997, max_tokens=4, ignore_eos=True)
    pe, ce = PromptEngine(cfg, mode="replay"), CompletionEngine(cfg)
    done, modes = {}, []
    for k, prompts in enumerate(rounds):  # one round after the other, so later prompts hit earlier blocks
        for i, p in enumerate(prompts):
            pe.add_request(f"{k}.{i}", p, sp)
        while pe.has_unfinished():
            outs, ready = pe.step()
            done.update({o.request_id: o for o in outs})
            for h in ready:
                modes.append(h.mode)
                ce.add_handoff(h)
        while ce.has_unfinished():
            done.update({o.request_id: o for o in ce.step() if o.finished})
    prefix = getattr(pe.engine, "prefix", None)
    if prefix is not None:
        assert prefix.stats.hits > 0, f"seed {seed}: no prefix hit on the PROMPT side (the test needs one)"
    llm = LLM(
        **{k: getattr(cfg, k) for k in ("seed", "num_blocks", "max_num_seqs", "batch_invariant", "dtype")}
    )
    for k, prompts in enumerate(rounds):
        want = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert [done[f"{k}.{i}"].token_ids for i in range(len(prompts))] == want, (
            f"seed {seed}: round {k} ({modes})"
        )
