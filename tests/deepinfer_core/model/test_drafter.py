"""DSpark drafter: cached drafting equals the cache-free oracle; a drafter built to copy the target has
every draft accepted; random drafters give valid confidences and leave greedy output unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_core.model.batch import BatchError
from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.spec import MTPVarlen, StepTimeProfile

from .session import Session
from .spec_driver import greedy_plain, greedy_spec, spec_step

TOL = 1e-9


def _tokens(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_cached_drafts_equal_the_oracle(model64: DeepSeekV41) -> None:
    """Drafts after a chunked prefill and after a partly rejected verify step equal ``draft_full``
    (cache-free target forward + drafter), confidences to 1e-9."""
    seq = _tokens(31, 100)
    s = Session(model64)
    s.run(0, seq, [60])
    out = spec_step(s, [(0, seq[60:], 60, 1, 0, True)])
    y = int(out.next_token[0])
    assert y == int(model64.forward_full(seq)[0][-1].argmax())
    want = model64.drafter.draft_full(model64, seq, y)
    assert torch.equal(out.drafts[0], want.tokens[0])
    assert (out.draft_confidence[0] - want.confidence[0]).abs().max() < TOL
    # the drafts depend on the target's context (not only on y): change one token inside the window
    other = seq.clone()
    other[-3] = (other[-3] + 1) % 512
    assert (model64.drafter.draft_full(model64, other, y).confidence - want.confidence).abs().max() > 1e-6
    # feed y + 3 drafts; whatever is accepted, the next drafts follow the accepted prefix
    d = out.drafts[0, :3]
    out2 = spec_step(s, [(0, torch.cat((torch.tensor([y]), d)), 100, 4, 3, True)])
    a, y2 = int(out2.num_accepted[0]), int(out2.next_token[0])
    prefix = torch.cat((seq, torch.tensor([y]), d[:a]))
    assert y2 == int(model64.forward_full(prefix)[0][-1].argmax())
    want2 = model64.drafter.draft_full(model64, prefix, y2)
    assert torch.equal(out2.drafts[0], want2.tokens[0])
    assert (out2.draft_confidence[0] - want2.confidence[0]).abs().max() < TOL


def test_random_drafter_keeps_greedy_output_and_gives_probabilities(model64: DeepSeekV41) -> None:
    prompts = {0: _tokens(41, 90), 1: _tokens(42, 70)}
    plain = greedy_plain(Session(model64), prompts, 24)
    policy = MTPVarlen(StepTimeProfile.published(), max_drafts=5)
    confs = []

    def lengths(conf: np.ndarray) -> np.ndarray:
        assert conf.shape == (2, 5) and np.isfinite(conf).all() and ((conf > 0) & (conf < 1)).all()
        confs.append(conf)
        return policy.plan(conf, None).lengths

    spec, acc = greedy_spec(Session(model64), prompts, 24, lengths)
    assert spec == plain
    assert len(confs) == len(acc) and len(acc) < 24  # it did verify drafts


def _copying_drafter_model(seed: int) -> tuple[DeepSeekV41, torch.Tensor]:
    """A target whose greedy next token is perm[current token], and a drafter that predicts the same.

    Target: embeddings scaled by 1e4 dominate every stream (each sublayer reads a normed input, so its
    output is O(1)), the final hidden is ~ the token's embedding e_x, and head[v] = e[perm^-1 v] makes
    v = perm[x] the argmax (e_x . e_x ~ 256 against cross terms of sd ~16). Drafter: a full-rank Markov
    head (rank = vocab) with W1 = identity and W2 = 1e4 * the permutation matrix adds 1e4 to perm[x_(k-1)],
    which dominates its own O(100) logits; so draft k = perm^(k+1)[y], exactly the target's chain.
    """
    cfg = tiny_config(dspark_markov_rank=512)
    m = DeepSeekV41.from_config(cfg, seed=seed, dtype=torch.float64)
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(seed))
    inv = torch.argsort(perm)
    with torch.no_grad():
        e = m.embed.clone()
        m.head.copy_(e[inv])
        m.embed.mul_(1e4)
        m.drafter.markov_in.copy_(torch.eye(512, dtype=torch.float64))
        m.drafter.markov_out.copy_(1e4 * torch.eye(512, dtype=torch.float64)[inv])  # row v = e_(perm^-1 v)
    return m, perm


def test_copying_drafter_has_every_draft_accepted() -> None:
    m, perm = _copying_drafter_model(7)
    prompts = {0: _tokens(51, 40), 1: _tokens(52, 33)}
    plain = greedy_plain(Session(m), prompts, 18)
    for sid, p in prompts.items():  # the construction holds: greedy follows the permutation chain
        chain = [int(perm[p[-1]])]
        while len(chain) < 18:
            chain.append(int(perm[chain[-1]]))
        assert plain[sid] == chain
    spec, acc = greedy_spec(Session(m), prompts, 18)
    assert spec == plain
    assert all(a == [5, 5] for a in acc), acc  # every draft of every step accepted


def test_sampled_drafts_are_distributions_and_verify_within_bounds(model64: DeepSeekV41) -> None:
    seq = _tokens(61, 80)
    s = Session(model64)
    out = spec_step(s, [(0, seq, 0, 1, 0, True)], temperature=[1.0])
    assert ((out.draft_confidence > 0) & (out.draft_confidence < 1)).all()
    probs = s.ex.spec.probs[s.slot[0]]
    assert probs.shape == (5, 512) and torch.allclose(probs.sum(-1), torch.ones(5, dtype=torch.float64))
    assert (probs[torch.arange(5), out.drafts[0]] > 0).all()  # each draft was drawn from its distribution
    y, d = int(out.next_token[0]), out.drafts[0]
    out2 = spec_step(s, [(0, torch.cat((torch.tensor([y]), d)), 80, 6, 5, True)], temperature=[1.0])
    assert 0 <= int(out2.num_accepted[0]) <= 5 and 0 <= int(out2.next_token[0]) < 512


def test_verifying_drafts_the_executor_did_not_make_is_refused(model64: DeepSeekV41) -> None:
    seq = _tokens(71, 60)
    s = Session(model64)
    out = spec_step(s, [(0, seq, 0, 1, 0, True)])
    y, d = int(out.next_token[0]), out.drafts[0].clone()
    d[1] = (d[1] + 1) % 512
    with pytest.raises(BatchError, match="verify_lens") as e:
        spec_step(s, [(0, torch.cat((torch.tensor([y]), d[:3])), 60, 4, 3, True)])
    assert e.value.request == 0
    with pytest.raises(BatchError, match="num_logits"):
        spec_step(s, [(0, torch.cat((torch.tensor([y]), out.drafts[0, :3])), 60, 2, 3, True)])
    with pytest.raises(BatchError, match="temperature"):
        spec_step(s, [(0, torch.tensor([y]), 60, 1, 0, True)], temperature=[-1.0])
    # the right drafts still verify after the refusals (nothing was written)
    ok = spec_step(s, [(0, torch.cat((torch.tensor([y]), out.drafts[0, :3])), 60, 4, 3, True)])
    assert int(ok.num_accepted[0]) >= 0


def test_partly_right_drafter_gives_partial_acceptance_and_the_same_output() -> None:
    """The copying drafter with its Markov code corrupted for half the tokens: chains break at those
    tokens, so acceptance varies from step to step (rollbacks of every depth), yet greedy output is the
    target's."""
    m, _perm = _copying_drafter_model(8)
    g = torch.Generator().manual_seed(9)
    bad = torch.randperm(512, generator=g)[:256]
    with torch.no_grad():
        m.drafter.markov_in[bad] = torch.eye(512, dtype=torch.float64)[
            torch.randint(0, 512, (256,), generator=g)
        ]
    prompts = {0: _tokens(53, 40), 1: _tokens(54, 35)}
    plain = greedy_plain(Session(m), prompts, 30)
    spec, acc = greedy_spec(Session(m), prompts, 30)
    assert spec == plain
    seen = {a for step in acc for a in step}
    assert 0 in seen and len(seen & {1, 2, 3, 4}) >= 2, seen
    # the sampling path (speculative sampling against stored draft distributions) at a temperature so
    # low that every distribution is one-hot to float64 precision must emit the same tokens and accept
    # the same drafts: a misaligned draft / target row would accept or reject differently
    cold, acc_cold = greedy_spec(Session(m), prompts, 30, temperature=1e-3)
    assert cold == plain and acc_cold == acc


def test_drafts_in_a_batch_equal_drafts_alone(model64: DeepSeekV41) -> None:
    """Two requests drafting and verifying together get the drafts and confidences each gets alone."""
    seqs = {0: _tokens(81, 70), 1: _tokens(82, 55)}
    both = Session(model64)
    alone = {sid: Session(model64) for sid in seqs}
    ob = spec_step(both, [(sid, t, 0, 1, 0, True) for sid, t in seqs.items()])
    oa = {sid: spec_step(alone[sid], [(sid, t, 0, 1, 0, True)]) for sid, t in seqs.items()}
    for i, sid in enumerate(seqs):
        assert torch.equal(ob.drafts[i], oa[sid].drafts[0])
        assert (ob.draft_confidence[i] - oa[sid].draft_confidence[0]).abs().max() < TOL
    # a verify step of different lengths per request (2 and 5 drafts)
    items = {
        sid: (sid, torch.cat((ob.next_token[i : i + 1], ob.drafts[i, :v])), len(seqs[sid]), v + 1, v, True)
        for (i, sid), v in zip(enumerate(seqs), (2, 5))
    }
    ob2 = spec_step(both, list(items.values()))
    for i, sid in enumerate(seqs):
        oa2 = spec_step(alone[sid], [items[sid]])
        assert int(ob2.num_accepted[i]) == int(oa2.num_accepted[0]) and int(ob2.next_token[i]) == int(
            oa2.next_token[0]
        )
        assert torch.equal(ob2.drafts[i], oa2.drafts[0])
        assert (ob2.draft_confidence[i] - oa2.draft_confidence[0]).abs().max() < TOL
    with pytest.raises(BatchError, match="no drafts to verify"):
        spec_step(Session(model64), [(0, seqs[0][:4], 0, 4, 3, True)])


def test_bf16_model_drafts_with_float32_probabilities() -> None:
    """A bf16 model (the GPU benchmark dtype): coefficients, draft and target probabilities are kept in
    float32, so confidences are float32 probabilities and greedy spec output equals plain greedy."""
    m = DeepSeekV41.from_config(tiny_config(), seed=3, dtype=torch.bfloat16)
    prompts = {0: _tokens(91, 50)}
    s = Session(m)
    out = spec_step(s, [(0, prompts[0], 0, 1, 0, True)])
    assert out.draft_confidence.dtype == torch.float32
    assert ((out.draft_confidence > 0) & (out.draft_confidence < 1)).all()
    assert s.ex.spec.probs[s.slot[0]].dtype == torch.float32
    spec, _ = greedy_spec(Session(m), prompts, 6)
    assert spec == greedy_plain(Session(m), prompts, 6)


def test_executor_without_draft_context_keeps_plain_outputs_and_refuses_drafts(model64: DeepSeekV41) -> None:
    """``draft_context=False`` (what a non-speculating engine builds): no drafter state or per-step work,
    the same logits as an executor that keeps the drafter's context, and a draft request is refused
    naming the field; the engine builds it exactly when it does not speculate."""
    from deepinfer_core.engine import LLMEngine
    from deepinfer_core.engine.config import EngineConfig
    from deepinfer_core.envs import Envs
    from deepinfer_core.model.batch import BatchError
    from deepinfer_core.model.executor import ModelExecutor

    assert model64.drafter is not None
    g = torch.Generator().manual_seed(31)
    p = torch.randint(0, 512, (40,), generator=g)
    keep, plain = Session(model64), Session(model64)
    plain.ex = ModelExecutor(model64, 128, 16, 8, backtrack_tokens=6, quantize=False, draft_context=False)
    assert keep.ex.spec is not None and plain.ex.spec is None
    assert plain.ex.cache_bytes()["drafter_rings"] == 0
    a, b = keep.run(0, p, [25, 1, 1, 1], 0), plain.run(0, p, [25, 1, 1, 1], 0)
    assert torch.equal(a, b)
    with pytest.raises(BatchError, match="draft"):
        spec_step(plain, [(0, p[28:29], 28, 1, 0, True)])
    for spec in (False, True):
        eng = LLMEngine(
            EngineConfig(model="tiny-random", speculative=spec, num_blocks=64, max_num_seqs=2),
            envs=Envs(use_nextn_decode=2 if spec else 0),
        )
        assert (eng.executor.spec is not None) == spec
