"""The engine's greedy tokens with each kernel library switched on equal the TileLang path's (GPU).

``DEEPINFER_KERNEL_LIBS=<lib>`` against ``none`` on the same engine setup (the shipped tiny model, bf16,
the fused MoE path on so ``moe_grouped_gemm`` is the cuda op). Each library's adapter entry points are
counted: a library the engine's path does not reach skips with that reason instead of passing unexercised
(today: FlashMLA, whose V3.2 cache this model does not use, and DeepSelect / DeepGEMM's logits, which the
model's own indexer selection does not call: see docs/cuda_backend.md, "Kernel libraries").
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from deepinfer_core.engine import LLM
from deepinfer_core.envs import Envs
from deepinfer_core.sampling_params import SamplingParams
from tests.deepinfer_core.engine.helpers import random_prompts

pytestmark = pytest.mark.gpu

ENTRY_POINTS = {
    "flash_mla": ("flash_mla_adapter", ("sparse_decode_raw", "dense_decode")),
    "deep_gemm": (
        "deep_gemm_adapter",
        ("grouped_fp8_masked", "grouped_fp8_contiguous", "mqa_logits", "paged_mqa_logits"),
    ),
    "deep_select": ("deep_select_adapter", ("topk",)),
}


def _greedy(monkeypatch: pytest.MonkeyPatch, libs: str) -> list[list[int]]:
    monkeypatch.setenv("DEEPINFER_KERNEL_LIBS", libs)
    llm = LLM(
        backend="cuda",
        num_blocks=128,
        max_num_seqs=8,
        envs=Envs(use_nextn_decode=0, fused_moe=True, fused_head=False),
    )
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.token_ids for o in llm.generate(random_prompts(36, 4, 20, 60), sp, use_tqdm=False)]


@pytest.mark.parametrize("lib", sorted(ENTRY_POINTS))
def test_greedy_tokens_equal_with_library_on(lib: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec(lib) is None:
        pytest.skip(f"{lib} not importable (scripts/build_kernel_libs.sh build {lib})")
    mod_name, names = ENTRY_POINTS[lib]
    mod = importlib.import_module(f"deepinfer_kernels.cuda.{mod_name}")
    calls: dict[str, int] = {}
    for name in names:
        real = getattr(mod, name)

        def counted(*a: object, _real: object = real, _name: str = name, **kw: object) -> object:
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **kw)  # type: ignore[operator]

        monkeypatch.setattr(mod, name, counted)
    base = _greedy(monkeypatch, "none")
    assert not calls
    on = _greedy(monkeypatch, lib)
    if not calls:
        pytest.skip(f"the engine's path does not reach {lib} (none of {names} was called)")
    assert on == base, f"{lib} changed the greedy tokens (calls: {calls})"
