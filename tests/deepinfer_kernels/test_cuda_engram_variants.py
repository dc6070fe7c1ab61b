"""Both engram_gather kernels ("rows": verified default, "vec": 8 elements a thread) against the reference."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import get_op

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["rows", "vec"])
@pytest.mark.parametrize(
    ("dtype", "blocks"),
    [(torch.bfloat16, 0), (torch.float32, 0), (torch.float8_e4m3fn, 2), (torch.float8_e4m3fn, 32)],
)
@pytest.mark.parametrize("dim", [256, 100])
@pytest.mark.parametrize("n", [1, 3001])
def test_gather_variant_exact(variant: str, dtype: torch.dtype, blocks: int, dim: int, n: int) -> None:
    from deepinfer_kernels.cuda import _tl
    from deepinfer_kernels.cuda import engram as ce

    assert _tl.HAVE_TILELANG
    if blocks and dim % blocks:
        blocks = 4  # 100 = 4 x 25: scale blocks that straddle 8-element chunks
    ref = get_op("engram_gather", "reference")
    g = torch.Generator().manual_seed(n * 7 + dim + blocks)
    rows = 4099
    table = (torch.randn(rows, dim, generator=g) * 4).to(dtype).cuda()
    scales = torch.randint(90, 160, (rows, blocks), generator=g, dtype=torch.uint8).cuda() if blocks else None
    ids = torch.randint(0, rows, (n,), generator=g).cuda()
    for out_dtype in (torch.bfloat16, torch.float32):
        want = ref(table, ids, scales, out_dtype)
        got = torch.empty(n, dim, dtype=out_dtype, device="cuda")
        sc = scales if scales is not None else torch.empty(rows, 1, dtype=torch.uint8, device="cuda")
        ce.gather_rows(table, sc, ids, got, blocks, variant=variant)
        assert torch.equal(got, want), f"{variant} {out_dtype}: {(got != want).sum().item()} values differ"


def test_public_op_follows_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_kernels.cuda import engram as ce

    monkeypatch.setattr(ce, "GATHER_VARIANT", "vec")
    g = torch.Generator().manual_seed(3)
    table = torch.randn(777, 256, generator=g).to(torch.bfloat16).cuda()
    ids = torch.randint(0, 777, (5, 9), generator=g).cuda()
    assert torch.equal(
        get_op("engram_gather", "cuda")(table, ids), get_op("engram_gather", "reference")(table, ids)
    )
    with pytest.raises(ValueError, match="variant: must be one of"):
        ce.gather_rows(
            table,
            torch.empty(777, 1, dtype=torch.uint8, device="cuda"),
            ids.reshape(-1),
            torch.empty(45, 256, device="cuda"),
            0,
            "warp",
        )
