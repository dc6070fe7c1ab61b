"""Which of the cuda backend's one-kernel decode paths an executor turns on by default.

Each switch (``executor.fused_attention``, ``fused_moe``, ``fused_head``) routes part of the sync-free decode
step through a TileLang kernel that has passed its H200 tests against the reference (2026-12-02): the decode
attention over one key buffer (``sink_attention_rows``), the MoE's expert products and the LM head
(``moe_grouped_gemm``). A kernel takes only some shapes (its module's ``kernel_takes``); outside them the
op falls back to its torch reference, which is exact but slower than the unfused path (the grouped
reference is a masked product per expert). So a switch is on by default only where the model's shapes
run the kernel: the released widths do (64 heads x 512, K a multiple of 64, N of 128), the tiny test
models do not, and their steps stay as they were. The probes are empty tensors of the model's shapes on
its device (``kernel_takes`` reads shapes, dtype and device only).
"""

from __future__ import annotations

import torch

from deepinfer_core.model.config import LAYER_SWA
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_core.protocols.model import Backend


def kernel_defaults(model: DeepSeekV41, backend: Backend | None, sync_free: bool) -> dict[str, bool]:
    """{switch: on} for ``fused_attention``, ``fused_moe`` and ``fused_head``: on where the backend is the
    cuda one, the step is sync-free and every layer's shapes run the kernel."""
    off = dict.fromkeys(("fused_attention", "fused_moe", "fused_head"), False)
    if not sync_free or getattr(backend, "name", None) != "cuda":
        return off
    try:
        from deepinfer_kernels.cuda import grouped_gemm, sink_attention
    except ImportError:  # the cuda backend without its TileLang modules: the reference paths
        return off
    cfg = model.cfg
    p = next(model.parameters())

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=p.dtype, device=p.device)

    d = cfg.head_dim
    q = empty(1, cfg.num_attention_heads, d)
    # one key buffer per layer: the window, plus the top-k entries on compressed layers
    keys = {
        cfg.sliding_window + (0 if cfg.layer_kind(lid) == LAYER_SWA else cfg.index_topk)
        for lid in range(cfg.num_hidden_layers)
    }
    attn = all(sink_attention.kernel_takes(q, empty(1, k, d), None) for k in keys)
    moe = [layer.ffn for layer in model.layers if hasattr(layer.ffn, "w1")]
    experts = bool(moe) and all(
        grouped_gemm.kernel_takes(
            empty(1, f.w1.shape[2]), empty(f.w1.shape[0], 2 * f.w1.shape[1], f.w1.shape[2])
        )
        and grouped_gemm.kernel_takes(empty(1, f.w2.shape[2]), f.w2)
        for f in moe
    )
    head = grouped_gemm.kernel_takes(empty(1, cfg.hidden_size), model.head_weight[None])
    return {"fused_attention": attn, "fused_moe": experts, "fused_head": head}
