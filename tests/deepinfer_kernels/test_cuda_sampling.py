"""cuda ``sample`` (TileLang) against the torch reference on the same GPU: same tokens, batch-invariant; the
sort-free survivor finder against the full-sort oracle on the GPU, captured in a CUDA graph, with no host
synchronisation."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import get_op
from deepinfer_kernels.ops.sampling import sample_sorted
from deepinfer_kernels.ops.sampling_filter import survivor_threshold, survivors_sorted

pytestmark = pytest.mark.gpu


def _ops():
    from deepinfer_kernels.cuda import _tl

    assert _tl.HAVE_TILELANG
    cuda, ref = get_op("sample", "cuda"), get_op("sample", "reference")
    assert cuda is not ref
    return cuda, ref


def _batch(b: int, vocab: int, g: torch.Generator, dtype: torch.dtype):
    logits = (torch.randn(b, vocab, generator=g) * 3).to(dtype)
    if b > 2:
        logits[1, vocab // 2 :] = float("-inf")  # grammar-masked half
        logits[2] = float("-inf")  # nothing allowed -> -1
    temperature = torch.rand(b, generator=g) * 1.5
    temperature[::4] = 0.0  # greedy rows
    top_k = torch.randint(-1, 60, (b,), generator=g)
    top_k[::3] = 0
    top_p = torch.rand(b, generator=g) * 0.5 + 0.5
    top_p[::2] = 1.0
    seeds = torch.randint(0, 2**62, (b,), generator=g)
    positions = torch.randint(0, 100_000, (b,), generator=g)
    return [t.cuda() for t in (logits, temperature, top_k, top_p, seeds, positions)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "vocab"), [(1, 129_280), (33, 129_280), (16, 1000), (0, 1000)])
def test_same_tokens_as_reference(b: int, vocab: int, dtype: torch.dtype) -> None:
    cuda, ref = _ops()
    g = torch.Generator().manual_seed(b * 1000 + vocab)
    for _ in range(3):
        args = _batch(b, vocab, g, dtype)
        got, want = cuda(*args), ref(*args)
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {b} rows differ"
        oracle = sample_sorted(*args)  # the survivors by the full sort, on the same GPU
        assert torch.equal(got, oracle), f"{(got != oracle).sum().item()} of {b} rows differ from the sort"
        if b > 2:
            assert got[2] == -1 and got[1] < vocab // 2


def test_batch_invariant() -> None:
    cuda, _ = _ops()
    g = torch.Generator().manual_seed(9)
    args = _batch(24, 129_280, g, torch.float32)
    full = cuda(*args)
    for idx in (torch.tensor([5]), torch.tensor([23, 0, 7]), torch.arange(24).flip(0)):
        part = cuda(*[a[idx.cuda()] for a in args])
        assert torch.equal(part, full[idx.cuda()])


def test_distribution_follows_softmax() -> None:
    """Many positions of one request: token frequencies match softmax(logits / T) (chi-square, 8 tokens)."""
    cuda, _ = _ops()
    n = 20_000
    logits = (
        torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3]], device="cuda").expand(n, -1).contiguous()
    )
    t = torch.full((n,), 0.8, device="cuda")
    toks = cuda(
        logits,
        t,
        torch.zeros(n, dtype=torch.int64, device="cuda"),
        torch.ones(n, device="cuda"),
        torch.full((n,), 1234, device="cuda"),
        torch.arange(n, device="cuda"),
    )
    counts = torch.bincount(toks, minlength=8).double().cpu()
    p = torch.softmax(logits[0].double().cpu() / 0.8, dim=0)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 24.3  # chi-square(7 dof) 99.9% quantile


def _ties_batch(b: int, vocab: int, g: torch.Generator):
    """Rows full of ties (a small integer grid) and bf16 values, every top-k / top-p regime."""
    logits = torch.randint(-3, 3, (b, vocab), generator=g).float()
    logits[b // 2 :] = (torch.randn(b - b // 2, vocab, generator=g) * 4).to(torch.bfloat16).float()
    logits[torch.rand(b, vocab, generator=g) < 0.2] = float("-inf")
    temperature = torch.rand(b, generator=g) + 0.3
    top_k = torch.tensor([-1, 1, 50, 5_000, vocab, 2 * vocab, 0, 100_000])[torch.arange(b) % 8]
    top_p = torch.tensor([0.9, 1.0, 0.5, 1e-6, 0.99, 0.0, 0.95, 1.0])[torch.arange(b) % 7]
    return [t.cuda() for t in (logits, temperature, top_k, top_p)]


@pytest.mark.parametrize("vocab", [1000, 129_280])
def test_finder_matches_the_sort_on_gpu(vocab: int) -> None:
    """The finder's boundary (value, id) equals the last survivor of the full stable sort on the GPU."""
    g = torch.Generator().manual_seed(vocab)
    for _ in range(3):
        args = _ties_batch(32, vocab, g)
        _, _, vals, idx, keep = survivors_sorted(*args)
        last = (keep.sum(dim=1) - 1).clamp(min=0)[:, None]
        _, tv, ti, mode = survivor_threshold(*args)
        live = mode != 2
        assert torch.equal(tv[live], vals.gather(1, last).squeeze(1)[live])
        assert torch.equal(ti.long()[live], idx.gather(1, last).squeeze(1)[live])


def test_no_host_synchronisation() -> None:
    """The finder and both ``sample`` ops on device tensors: any synchronising call (``.item()``, a
    ``nonzero``, a device-to-host copy) raises under the sync debug mode."""
    cuda, ref = _ops()
    g = torch.Generator().manual_seed(4)
    args = _batch(16, 129_280, g, torch.bfloat16)
    cuda(*args)  # compile the kernel first (compilation may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        survivor_threshold(*args[:4])
        cuda(*args)
        ref(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_in_a_cuda_graph(dtype: torch.dtype) -> None:
    """Both ``sample`` ops captured once in a CUDA graph, then replayed on new logits / parameters copied
    into the captured buffers: the same tokens as eager calls and as the sort oracle, every replay."""
    cuda, ref = _ops()
    g = torch.Generator().manual_seed(11)
    b, vocab = 24, 129_280
    static = _batch(b, vocab, g, dtype)
    for op in (cuda, ref):
        op(*static)  # warm-up: kernel compilation and allocator pools outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_cuda = cuda(*static)
        out_ref = ref(*static)
    for _ in range(3):
        fresh = _batch(b, vocab, g, dtype)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = sample_sorted(*fresh)
        assert torch.equal(out_cuda, want)
        assert torch.equal(out_ref, want)
        assert torch.equal(out_cuda, cuda(*fresh))
