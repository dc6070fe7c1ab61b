"""Reference of ``mtp_redistribute``: spread a fixed number of drafts over requests on the device.

Under asynchronous scheduling the CPU plans step N+1 while step N runs, so it only fixes how many drafts
the step verifies in total; the device reassigns that total using the confidences step N just produced.
The result must equal the CPU greedy (``_C.spec.plan(..., total=total)``) on the same confidences, so
the order is the same: cumulative rate descending, ties by flat index (request-major), which is exactly
a stable descending sort of the row-major matrix. Cumulative products are formed left to right in
float64, as the C++ does, so both see bit-identical keys (a parallel scan could associate differently
and flip near-ties).
"""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register


def check_inputs(
    total: int | torch.Tensor, confidences: torch.Tensor, num_drafts: torch.Tensor | None
) -> tuple[int, int, torch.Tensor]:
    """Validate the arguments of ``mtp_redistribute`` (errors name the argument); returns
    ``(requests, drafts, total as a 0-d int64 tensor on the confidences' device)``."""
    if confidences.dim() != 2:
        raise ValueError(f"confidences: must be [requests, drafts], got shape {tuple(confidences.shape)}")
    if not confidences.is_floating_point():
        raise ValueError(f"confidences: must be floating point, got {confidences.dtype}")
    R, D = confidences.shape
    dev = confidences.device
    if isinstance(total, torch.Tensor):
        if total.numel() != 1:
            raise ValueError(f"total: must be a scalar, got shape {tuple(total.shape)}")
        total_t = total.reshape(()).to(device=dev, dtype=torch.int64)
    else:
        if int(total) != total or total < 0 or total > R * D:
            raise ValueError(f"total={total!r}: must be an integer in [0, {R * D}] (requests x drafts)")
        total_t = torch.tensor(int(total), device=dev, dtype=torch.int64)
    if num_drafts is not None and num_drafts.shape != (R,):
        raise ValueError(f"num_drafts: must have shape ({R},), got {tuple(num_drafts.shape)}")
    return R, D, total_t


@register("mtp_redistribute")
def mtp_redistribute(
    total: int | torch.Tensor, confidences: torch.Tensor, num_drafts: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-request verify lengths (int32 [R]) keeping the ``total`` drafts of highest cumulative rate.

    ``confidences``: float [R, D] per-draft acceptance probabilities in [0, 1]; ``num_drafts``: int [R]
    valid drafts per row (default all D). ``total`` may be a Python int or a 0-d device tensor (so the
    CPU-chosen total need not be synchronised); a total above the number of valid drafts selects them
    all (checking that would cost a device sync). Batched: the only Python loop is over draft positions.
    """
    R, D, total_t = check_inputs(total, confidences, num_drafts)
    dev = confidences.device
    pos = torch.arange(D, device=dev)
    if num_drafts is None:
        valid = torch.ones(R, D, dtype=torch.bool, device=dev)
    else:
        valid = pos[None, :] < num_drafts.to(dev)[:, None]
    conf = confidences.to(torch.float64)
    # Left-to-right running product over <= 5 positions, same association as the C++ greedy.
    cum = torch.empty_like(conf)
    run = torch.ones(R, dtype=torch.float64, device=dev)
    for k in range(D):
        run = run * conf[:, k]
        cum[:, k] = run
    key = torch.where(valid, cum, torch.full_like(cum, -1.0)).reshape(-1)
    order = torch.sort(key, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=dev)
    chosen = (rank < total_t) & valid.reshape(-1)
    return chosen.view(R, D).sum(dim=1, dtype=torch.int32)
