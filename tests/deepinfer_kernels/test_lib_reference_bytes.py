"""Our formats against the libraries' own pure-torch quantisers, byte for byte (CPU).

Needs the libraries' sources unpacked where ``scripts/build_kernel_libs.sh unpack`` (or ``build``) puts
them, build/kernel_libs/src/kernel_src; skipped otherwise. The libraries' test helpers are loaded from
there at run time (nothing of theirs is copied into this repository):

- FlashMLA tests/quant.py ``quantize_k_cache(..., V32_FP8Sparse)``: the 656-byte V3.2 layout;
- DeepGEMM deep_gemm/utils/math.py ``per_block_cast_to_fp8`` / ``per_token_cast_to_fp8``: the scale rules.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from deepinfer_core.kv.formats import V32Format
from deepinfer_kernels.libs import layouts as L

SRC = Path(__file__).resolve().parents[2] / "build" / "kernel_libs" / "src" / "kernel_src"


def _load(rel: str) -> ModuleType:
    path = SRC / rel
    if not path.is_file():
        pytest.skip(f"{path} not unpacked (bash scripts/build_kernel_libs.sh pack && ... unpack)")
    spec = importlib.util.spec_from_file_location(f"_lib_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-6, 300.0])
def test_v32_bytes_equal_flash_mla_quantiser(scale: float) -> None:
    quant = _load("FlashMLA/tests/quant.py")
    g = torch.Generator().manual_seed(int(scale * 1e6) % 1000)
    x = (torch.randn(3, 16, 1, 576, generator=g) * scale).to(torch.bfloat16)
    x[0, 0, 0, :128] = 0  # an all-zero tile: the 1e-4 floor's scale
    x[1, 2, 0, 128:256] = 448 * 2.0**-5  # amax / 448 an exact power of two
    theirs = quant.quantize_k_cache(x, quant.FP8KVCacheLayout.V32_FP8Sparse)
    ours = V32Format().quantize(x.float().view(3, 16, 576))
    assert torch.equal(theirs.view(torch.uint8).reshape(3, 16, 656), ours)
    # and their decoder reads our bytes as ours does (to bf16, as theirs returns)
    deq = quant.dequantize_k_cache(
        L.flash_mla_kv_cache(ours.view(torch.float8_e4m3fn), 16), quant.FP8KVCacheLayout.V32_FP8Sparse
    )
    assert torch.equal(deq.view(3, 16, 576).float(), V32Format().dequantize(ours).to(torch.bfloat16).float())


def test_flash_mla_index_conversion_equals_theirs() -> None:
    quant = _load("FlashMLA/tests/quant.py")
    g = torch.Generator().manual_seed(3)
    b, s_q, k, page, w = 3, 2, 64, 16, 5
    table = torch.randperm(b * w, generator=g).view(b, w).to(torch.int32)
    pos = torch.randint(0, w * page, (b, s_q, k), generator=g).to(torch.int32)
    pos[0, 0, :7] = -1
    theirs = quant.abs_indices2indices_in_kvcache(pos, table, page)
    assert torch.equal(L.flash_mla_indices(pos, table, page), theirs.to(torch.int32))


def test_fp8_scale_rules_equal_deep_gemm() -> None:
    dg = _load("DeepGEMM/deep_gemm/utils/math.py")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 640, generator=g).to(torch.bfloat16)
    x = torch.randn(77, 640, generator=g).to(torch.bfloat16)
    pairs = [
        (dg.per_block_cast_to_fp8(w, use_ue8m0=False), L.quantize_fp8_blocks(w)),
        (dg.per_token_cast_to_fp8(x, use_ue8m0=False), L.quantize_fp8_tokens(x)),
    ]
    for (t8, ts), (o8, os_) in pairs:
        assert torch.equal(ts, os_)  # the scales are the same float32 values
        # DeepGEMM multiplies by the rounded reciprocal, we divide once: rare one-step differences only
        diff = t8.view(torch.uint8).int() - o8.view(torch.uint8).int()
        assert int(diff.abs().max()) <= 1 and int((diff != 0).sum()) <= t8.numel() // 200
