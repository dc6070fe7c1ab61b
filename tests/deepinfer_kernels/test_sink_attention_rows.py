"""``sink_attention_rows``: the reference against a per-row, per-head float64 softmax oracle and against the
model's ``sink_attention`` (CPU); the TileLang kernel against the reference, inside a CUDA graph, and in
the executor's decode step (GPU, skipped here)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.model.layers.attention import sink_attention
from deepinfer_kernels import get_backend


def oracle(q, k_a, m_a, k_b, m_b, sink, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for n in range(q.shape[0]):
        keys = k_a[n] if k_b is None else torch.cat([k_a[n], k_b[n]])
        ok = m_a[n] if k_b is None else torch.cat([m_a[n], m_b[n]])
        keys = keys[ok].double()
        for h in range(q.shape[1]):
            lg = torch.cat([keys @ q[n, h].double() * scale, sink[h : h + 1].double()])
            w = torch.exp(lg - lg.max())
            out[n, h] = (w[:-1] / w.sum()) @ keys
    return out


def inputs(n, h, d, a, b, seed, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, d, generator=g, dtype=torch.float64)
    k_a = torch.randn(n, a, d, generator=g, dtype=torch.float64)
    m_a = torch.rand(n, a, generator=g) < 0.75
    k_b = torch.randn(n, b, d, generator=g, dtype=torch.float64) if b else None
    m_b = (torch.rand(n, b, generator=g) < 0.5) if b else None
    m_a[0] = False  # a row that sees no window key
    if n > 1 and b:
        m_a[1] = False
        m_b[1] = False  # and one that sees no key at all: only the sink (output 0)
    sink = torch.randn(h, generator=g, dtype=torch.float64) * 2
    cast = [q, k_a, m_a, k_b, m_b, sink]
    return [
        None if t is None else (t.to(device) if t.dtype == torch.bool else t.to(device, dtype)) for t in cast
    ]


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 4),
    h=st.integers(1, 4),
    d=st.sampled_from([4, 16]),
    a=st.integers(1, 9),
    b=st.integers(0, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_oracle_and_the_model(n, h, d, a, b, seed):
    q, k_a, m_a, k_b, m_b, sink = inputs(n, h, d, a, b, seed)
    got = get_backend("reference").op("sink_attention_rows")(q, k_a, m_a, k_b, m_b, sink, 0.3)
    torch.testing.assert_close(got, oracle(q, k_a, m_a, k_b, m_b, sink, 0.3), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, sink_attention(q, k_a, m_a, k_b, m_b, sink, 0.3), rtol=1e-10, atol=1e-12)


def test_bad_inputs_name_the_field():
    op = get_backend("reference").op("sink_attention_rows")
    q, k_a, m_a, k_b, m_b, sink = inputs(2, 2, 4, 3, 2, 0)
    with pytest.raises(ValueError, match="k_a"):
        op(q, k_a[:, :, :3], m_a, k_b, m_b, sink, 1.0)
    with pytest.raises(ValueError, match="mask_b"):
        op(q, k_a, m_a, k_b, m_b.int(), sink, 1.0)
    with pytest.raises(ValueError, match="sink"):
        op(q, k_a, m_a, k_b, m_b, sink[:1], 1.0)
    with pytest.raises(ValueError, match="k_b"):
        op(q, k_a, m_a, k_b.float(), m_b, sink, 1.0)


def _cuda_ops():
    return get_backend("cuda").op("sink_attention_rows"), get_backend("reference").op("sink_attention_rows")


@pytest.mark.gpu
@pytest.mark.parametrize("b", [0, 64, 512])
def test_kernel_matches_reference(b: int) -> None:
    from deepinfer_kernels.cuda.sink_attention import kernel_takes

    cuda, ref = _cuda_ops()
    for n in (1, 3, 64, 70):
        q, k_a, m_a, k_b, m_b, sink = inputs(n, 64, 512, 128, b, n + b, torch.bfloat16, "cuda")
        assert kernel_takes(q, k_a, k_b)
        got = cuda(q, k_a, m_a, k_b, m_b, sink, 512**-0.5)
        want = ref(
            q.double(),
            k_a.double(),
            m_a,
            None if k_b is None else k_b.double(),
            m_b,
            sink.double(),
            512**-0.5,
        )
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        # bf16 weights and output against float64: relative to the output's norm; absolute when every row
        # sees no key (n = 1 without top-k keys: the one row is all-masked, its output 0)
        err, size = (got.double() - want).norm().item(), want.norm().item()
        assert err <= 1e-2 * size + 1e-6, (n, b, err, size)
        if n > 1 and b:
            assert got[1].abs().max().item() == 0  # every key masked: only the sink, output 0


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph() -> None:
    cuda, _ = _cuda_ops()
    q, k_a, m_a, k_b, m_b, sink = inputs(8, 64, 512, 128, 512, 5, torch.bfloat16, "cuda")
    cuda(q, k_a, m_a, k_b, m_b, sink, 0.05)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = cuda(q, k_a, m_a, k_b, m_b, sink, 0.05)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, cuda(q, k_a, m_a, k_b, m_b, sink, 0.05))


@pytest.mark.gpu
def test_executor_fused_attention_keeps_the_step() -> None:
    """A model of V4.1's attention widths (64 heads of 512, window 128, top-k 64), bf16: greedy decode with
    ``executor.fused_attention`` on against off, graphs on; the kernel really ran (it was compiled)."""
    from deepinfer_core.model.config import flash_config
    from deepinfer_core.model.model import DeepSeekV41
    from deepinfer_kernels.cuda import _tl
    from tests.deepinfer_core.model.test_cuda_graphs import greedy_plain_and_flagged

    # test_cuda_graphs.v41_heads_config's layers with V4.1's 64 heads and a top-k of 64 (a kernel block)
    cfg = flash_config(
        vocab_size=2048,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=64,
        q_lora_rank=256,
        o_lora_rank=256,
        o_groups=2,
        compress_ratios=[0, 2, 1, 1],
        kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2, 3],
        num_encoder_layers=2,
        index_n_heads=16,
        candidate_source_layer_id=2,
        candidate_topk_blocks=8,
        index_topk=64,
        n_routed_experts=8,
        moe_intermediate_size=256,
        engram_layer_ids=[1],
        engram_table_sizes=[1009],
        num_nextn_predict_layers=0,
        dspark_target_layer_ids=[],
        dspark_noise_token_id=2047,
    )
    model = DeepSeekV41.from_config(cfg, seed=4, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(9)
    prompts = {i: torch.randint(0, 2048, (150 + 40 * i,), generator=g) for i in range(3)}
    (tp, lp), (tf, lf), fused = greedy_plain_and_flagged(model, True, prompts, 6, 3, fused_attention=True)
    assert any(k[0] == "sink_attention_rows" for k in _tl._CACHE)
    assert not fused.ex.graphs().failed
    assert ((lp[0] - lf[0]).norm() / lp[0].norm()).item() < 3e-2  # the first decode step, same inputs
    same = sum(a == b for x, y in zip(tp, tf) for a, b in zip(x, y))
    assert same >= 0.8 * sum(map(len, tp))  # bf16 rounding order may flip a near-tie later on


def test_executor_fused_attention_wiring_on_the_reference_backend() -> None:
    """``executor.fused_attention`` routes each decode layer's attention through the backend op, with the
    window and top-k keys in one buffer: on the reference backend (its torch reference) the greedy decode
    equals the default path's (float32)."""
    from deepinfer_core.model.model import DeepSeekV41
    from tests.deepinfer_core.model.test_cuda_graphs import v41_heads_config
    from tests.deepinfer_kernels.wiring import SpyBackend, reference_decode

    model = DeepSeekV41.from_config(v41_heads_config(4), seed=2, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(5)
    prompts = {i: torch.randint(0, 2048, (40 + 11 * i,), generator=g) for i in range(3)}
    calls: list[int] = []  # the keys of each call's one set (-1: two sets)
    spy = SpyBackend("sink_attention_rows", lambda *a: calls.append(a[1].shape[1] if a[3] is None else -1))
    runs, per_run = [], []
    for fused in (False, True):
        runs.append(reference_decode(model, prompts, 4, 2, spy, fused_attention=fused))
        per_run.append(len(calls))
    # off: never called; on: once per layer of each of the 4 decode steps, always one key set: the window
    # alone (SWA layers) or window and top-k gathered into one buffer (kv_gather(out=))
    assert per_run[0] == 0 and per_run[1] == 4 * model.cfg.num_hidden_layers
    w = model.cfg.sliding_window
    assert -1 not in calls and w in calls and max(calls) > w
    assert runs[0][0] == runs[1][0]
    assert max(((a - b).norm() / a.norm()).item() for a, b in zip(runs[0][1], runs[1][1])) < 1e-5
