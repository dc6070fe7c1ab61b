"""Batch-invariant products (model/invariant.py) and the executor's batch-invariant mode (``invariant_rows``).

Oracles: a row computed alone (its own call) against the same row inside other batches, bitwise; the
chunked products against the plain ones (close: only the summation order may differ); the default mode
as the control that the comparison can fail (it differs on this CPU: a float32 GEMM over 1 row and over
several rows round differently). GPU (marked ``gpu``): the same on the cuda backend, graphs on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.invariant import RowChunkedProducts, default_rows, row_chunked
from deepinfer_core.model.model import DeepSeekV41

from .session import Session

# ---------------------------------------------------------------- the products (CPU)

_W: dict = {}


def _weight(k: int, n: int, dt: torch.dtype) -> torch.Tensor:
    key = (k, n, dt)
    if key not in _W:
        _W[key] = torch.randn(n, k, generator=torch.Generator().manual_seed(k * 7 + n)).to(dt)
    return _W[key]


_OPS = {
    "matmul": lambda x: x @ _weight(x.shape[-1], 96, x.dtype).t(),
    "mm": lambda x: torch.mm(x, _weight(x.shape[-1], 40, x.dtype).t()),
    "linear": lambda x: F.linear(x, _weight(x.shape[-1], 72, x.dtype)),
    "einsum_weight": lambda x: torch.einsum("tc,skc->tsk", x, _weight(x.shape[-1], 48, x.dtype).view(2, 24, -1)),
    "sigmoid": lambda x: torch.sigmoid(x[:, :24]),
    "exp": lambda x: x[:, 5:30].exp(),
    "silu": lambda x: F.silu(x[:, :20]),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", sorted(_OPS))
@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 70), pos=st.integers(0, 69), rows=st.sampled_from([1, 8, 32]), seed=st.integers(0, 999)
)
def test_a_row_of_a_chunked_product_is_the_same_in_any_batch(
    op: str, dtype: torch.dtype, n: int, pos: int, rows: int, seed: int
) -> None:
    pos = min(pos, n - 1)
    g = torch.Generator().manual_seed(seed)
    others = torch.randn(n, 256, generator=g).to(dtype)
    row = torch.randn(1, 256, generator=g).to(dtype)
    f = _OPS[op]
    with row_chunked(rows) as mode:
        alone = f(row)
        batch = torch.cat((others[:pos], row, others[pos + 1 :]))
        got = f(batch)
    assert mode is not None and mode.calls >= 2  # the products did go through the mode
    assert torch.equal(got[pos : pos + 1], alone)
    # and they are the same products: equal to the plain op up to summation order
    torch.testing.assert_close(got, f(batch), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


def test_the_plain_products_do_depend_on_the_batch_on_this_cpu() -> None:
    # the control of the test above: without the mode a float32 row's product changes with the batch
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 256, generator=g), torch.randn(512, 256, generator=g)
    assert not all(torch.equal((x[:n] @ w.t())[:1], x[:1] @ w.t()) for n in (2, 3, 7, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_per_row_products_are_row_invariant_on_this_cpu_as_they_are(dtype: torch.dtype) -> None:
    # why the mode leaves them alone: each item is its own GEMM of a fixed shape, whatever the item count
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(70, 8, 64, generator=g).to(dtype), torch.randn(70, 40, 64, generator=g).to(dtype)
    for eq in ("nhd,nad->nha", "nha,nad->nhd"):
        y = q if eq.startswith("nhd") else torch.einsum("nhd,nad->nha", q, k)
        full = torch.einsum(eq, y, k)
        for n in (1, 2, 7, 33, 70):
            for p in {0, n - 1}:
                assert torch.equal(torch.einsum(eq, y[p : p + 1], k[p : p + 1]), full[p : p + 1]), (eq, n, p)


def test_products_that_are_not_per_row_pass_through_unchanged() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(10, 16, generator=g), torch.randn(10, 16, generator=g)
    v = torch.randn(16, generator=g)
    out = torch.empty(10, 10)
    cases = [
        lambda: torch.einsum("nd,nd->d", a, b),  # a sum over the rows: not a row product
        lambda: torch.einsum(
            "nd,nd->n", a, b
        ),  # a batched product per row (its own shape whatever the batch)
        lambda: torch.bmm(a.view(10, 4, 4), b.view(10, 4, 4)),  # likewise
        lambda: torch.einsum("nd,dn->nd", a, b.t()),  # the row index not leading an operand
        lambda: a @ v,  # a matrix-vector product
        lambda: torch.bmm(a[None], b.t()[None], out=out[None]),  # written through out=
    ]
    for f in cases:
        want = f()
        with row_chunked(4) as mode:
            got = f()
        assert torch.equal(got, want) and mode is not None and mode.calls == 0


def test_off_is_a_no_op_and_defaults_per_device() -> None:
    with row_chunked(0) as mode:
        assert mode is None
    assert default_rows(torch.device("cuda")) == 64 and default_rows(torch.device("cpu")) > 0
    assert isinstance(RowChunkedProducts(4), RowChunkedProducts)


# ---------------------------------------------------------------- the executor's mode (CPU)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def model(request: pytest.FixtureRequest) -> DeepSeekV41:
    return DeepSeekV41.from_config(tiny_config(), seed=11, dtype=request.param)


def _prompts(seed: int, count: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(3, 40))) for _ in range(count)]


def _target_logits(
    model: DeepSeekV41, rows: int, prompts: list[np.ndarray], order: list[int], q: int
) -> torch.Tensor:
    """Prefill each request of ``order`` alone, then one step of ``q`` tokens each (decode q = 1, a verify
    step q > 1) of them all; the logits rows of request 0."""
    s = Session(model, quantize=True, num_blocks=256, slots=len(order) + 1)
    s.ex.invariant_rows = rows
    for sid in order:
        s.step([(sid, torch.from_numpy(prompts[sid][:-q]), 0, 1)])
    _, per = s.step([(sid, torch.from_numpy(prompts[sid][-q:]), len(prompts[sid]) - q, q) for sid in order])
    return per[order.index(0)]


@settings(max_examples=6, deadline=None)
@given(st.integers(2, 24), st.data())
def test_executor_row_logits_are_bitwise_the_same_in_any_batch(model: DeepSeekV41, size: int, data) -> None:
    prompts = _prompts(3, 24, model.cfg.vocab_size)
    others = data.draw(st.permutations(range(1, 24)))[: size - 1]
    order = list(others)
    order.insert(data.draw(st.integers(0, size - 1)), 0)
    q = data.draw(st.sampled_from([1, 1, 3]))  # decode steps, and verify-shaped steps (3 rows a request)
    rows = data.draw(st.sampled_from([8, 32]))
    alone = _target_logits(model, rows, prompts, [0], q)
    assert torch.equal(_target_logits(model, rows, prompts, order, q), alone)


@pytest.mark.parametrize("path", ["tiled", "varlen"])
def test_executor_prefill_chunks_are_batch_invariant_too(model: DeepSeekV41, path: str) -> None:
    # prefill steps (the per-request tiled path, and varlen: every request of the step at once, the cuda
    # backend's default): the target's prompt in one step with other prompts
    prompts = _prompts(4, 6, model.cfg.vocab_size)
    prompts[5] = prompts[5][:5]

    def run(order: list[int], target: int = 0) -> torch.Tensor:
        s = Session(model, quantize=True, num_blocks=256, slots=8)
        s.ex.invariant_rows = 32
        s.ex.prefill_path = path
        _, per = s.step([(sid, torch.from_numpy(prompts[sid]), 0, 1) for sid in order])
        return per[order.index(target)]

    alone = run([0])
    assert len(prompts[0]) > 7  # the per-request path alone too
    for order in ([3, 0, 1], [0, 4, 2, 1], [1, 2, 3, 4, 0]):
        assert torch.equal(run(order), alone), order
    # the one thing the mode does not make invariant: which path a step takes. A 5-token chunk alone is a
    # row-path step; next to a long prompt the step takes the per-request path (other attention code, other
    # bits). So the engine cuts a step where its requests' paths change (engine/run.py StepRunner._parts)
    short = run([5], 5)
    assert not torch.equal(run([5, 1], 5), short) or model.embed.dtype != torch.float32


def test_the_default_mode_is_the_control(model: DeepSeekV41) -> None:
    # without the mode the same comparison fails on this CPU for float32 (the products of a lone row are a
    # GEMV); bf16's CPU GEMMs happen to agree here, so only the float32 model is the control
    if model.embed.dtype != torch.float32:
        pytest.skip("bf16 CPU GEMMs agree over these batches without the mode")
    prompts = _prompts(3, 24, model.cfg.vocab_size)
    alone = _target_logits(model, 0, prompts, [0], 1)
    assert not torch.equal(_target_logits(model, 0, prompts, [5, 0, 7, 9], 1), alone)


def test_the_graph_path_is_batch_invariant_on_the_cpu(model: DeepSeekV41) -> None:
    # the cuda backend's flow without CUDA: sync-free steps (the MoE's static mode) and every decode step
    # through the padded static inputs a captured graph reads (DecodeGraphs(capture=False)); in the mode
    # the graphs' buckets are whole chunks, so a lone request runs padded to the chunk a full batch fills
    from deepinfer_core.model import cuda_graphs as cg

    prompts = _prompts(6, 20, model.cfg.vocab_size)
    rows = 8

    def run(order: list[int]) -> torch.Tensor:
        s = Session(model, quantize=True, num_blocks=256, slots=len(order) + 1)
        ex = s.ex
        ex.invariant_rows = rows
        ex.sync_free = ex.cuda_graphs = True
        ex._graphs = cg.DecodeGraphs(ex.state, capture=False)  # made again for the mode, still uncaptured
        for sid in order:
            s.step([(sid, torch.from_numpy(prompts[sid][:-1]), 0, 1)])
        _, per = s.step(
            [(sid, torch.from_numpy(prompts[sid][-1:]), len(prompts[sid]) - 1, 1) for sid in order]
        )
        g = ex.graphs()
        assert not g.capture and all(b % rows == 0 for b in g.buckets) and g.graphs  # the graph path ran
        return per[order.index(0)]

    alone = run([0])
    for order in ([4, 0], [*range(1, 8), 0], [3, 0, *range(4, 20), 1, 2]):  # 2, 8 (one chunk) and 20 rows
        assert torch.equal(run(order), alone), order


# ---------------------------------------------------------------- GPU: the cuda backend, graphs on


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_products_are_row_invariant() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for k, n in ((4096, 1024), (1024, 4096), (4096, 129280)):
        w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(200, k, generator=g, device="cuda", dtype=torch.bfloat16)
        with row_chunked(64):
            alone = x[:1] @ w.t()
            for m in (2, 17, 64, 65, 200):
                assert torch.equal((x[:m] @ w.t())[:1], alone), (k, n, m)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_executor_row_logits_are_the_same_in_any_batch(graphs: bool) -> None:
    from deepinfer_core.model.executor import ModelExecutor
    from deepinfer_kernels import get_backend

    model = DeepSeekV41.from_config(tiny_config(), seed=11, dtype=torch.bfloat16, device="cuda")
    prompts = _prompts(5, 130, model.cfg.vocab_size)

    def run(order: list[int]) -> torch.Tensor:
        s = Session(model, quantize=True, num_blocks=2048, slots=len(order) + 1)
        s.ex = ModelExecutor(
            model, 2048, 16, len(order) + 1, quantize=True, backend=get_backend("cuda"), cuda_graphs=graphs
        )
        s.ex.invariant_rows = 64
        for sid in order:
            s.step([(sid, torch.from_numpy(prompts[sid][:-1]), 0, 1)])
        for _ in range(2):  # the second decode step replays the captured graph
            _, per = s.step(
                [(sid, torch.from_numpy(prompts[sid][-1:]), len(prompts[sid]) - 1, 1) for sid in order]
            )
        return per[order.index(0)].float().cpu()

    alone = run([0])
    for order in ([3, 0, 1], [*range(1, 32), 0, *range(32, 64)], [*range(1, 100), 0]):
        assert torch.equal(run(order), alone), len(order)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["torch_grouped_mm", "backend_moe_grouped_gemm"])
def test_cuda_grouped_expert_products_do_not_depend_on_group_sizes(impl: str) -> None:
    # the static MoE's grouped products are not row-chunked (one kernel over all experts' rows): a row's
    # result must not depend on how many rows its expert or the others got (no split-K, one tile config)
    from deepinfer_core.model.layers.moe_static import _torch_grouped
    from deepinfer_kernels import get_backend

    if impl == "torch_grouped_mm" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm needs sm_90")
    gg = _torch_grouped if impl == "torch_grouped_mm" else get_backend("cuda").op("moe_grouped_gemm")
    g = torch.Generator(device="cuda").manual_seed(0)
    e, k, n = 8, 1024, 512
    w = torch.randn(e, n, k, generator=g, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(300, k, generator=g, device="cuda", dtype=torch.bfloat16)
    want = gg(rows[:1], w, torch.ones(e, dtype=torch.int32, device="cuda"))  # expert 0: the one row
    for counts in (
        [1, 0, 0, 0, 0, 0, 0, 0],
        [5, 3, 0, 9, 1, 0, 2, 7],
        [64, 64, 0, 0, 64, 1, 1, 1],
        [150, 50, 0, 0, 0, 0, 0, 100],
    ):
        ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        for at in (0, counts[0] - 1):  # the watched row first and last of expert 0's group
            x = rows[1 : 1 + sum(counts)].clone()
            x[at] = rows[0]
            assert torch.equal(gg(x, w, ends)[at : at + 1], want), (counts, at)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["varlen", "tiled"])
def test_cuda_prefill_logits_are_the_same_in_any_batch(path: str) -> None:
    """Prefill steps on the cuda backend (varlen: every request of the step at once, the default there;
    tiled: request by request): a prompt's logits alone == beside other prompts in one step. The varlen
    path batches the attention's per-tile products across requests (batched GEMMs whose kernel may depend
    on the batch count: what this checks)."""
    from deepinfer_core.model.executor import ModelExecutor
    from deepinfer_kernels import get_backend

    model = DeepSeekV41.from_config(tiny_config(), seed=11, dtype=torch.bfloat16, device="cuda")
    prompts = _prompts(6, 40, model.cfg.vocab_size)
    prompts = [np.concatenate([p] * 8) for p in prompts]  # 24-312 tokens: the prefill path, several tiles

    def run(order: list[int]) -> torch.Tensor:
        s = Session(model, quantize=True, num_blocks=2048, slots=len(order) + 1)
        s.ex = ModelExecutor(model, 2048, 16, len(order) + 1, quantize=True, backend=get_backend("cuda"))
        s.ex.invariant_rows = 64
        s.ex.prefill_path = path
        _, per = s.step([(sid, torch.from_numpy(prompts[sid]), 0, 1) for sid in order])
        return per[order.index(0)].float().cpu()

    alone = run([0])
    for order in ([3, 0, 1], [*range(1, 16), 0], [*range(1, 40), 0]):
        assert torch.equal(run(order), alone), (path, len(order))
