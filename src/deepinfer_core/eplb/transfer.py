"""Carry out a :class:`~deepinfer_core.eplb.migration.MovePlan` over a torch.distributed group.

Every rank calls :func:`execute_moves` with the same move list and its own expert weights (one or more
tensors shaped [layers, slots_per_gpu, ...], e.g. gate_up, down and their scales). Group rank ``g`` is GPU
``g`` of the plan. Moves go in bounded batches of point-to-point ``isend``/``irecv`` (at most
``batch_size`` moves in flight group-wide), so the extra memory is one batch of receives plus a snapshot of
only the slots that are both read and overwritten. Afterwards a fingerprint of every moved slot, taken at
the source before sending and at the destination after receiving, is compared across the group.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import numpy as np
import torch
import torch.distributed as dist

from deepinfer_core.eplb.migration import MovePlan

logger = logging.getLogger(__name__)


@attrs.frozen(slots=True)
class TransferReport:
    """What one rank did: moves sent / received / copied locally, bytes sent, batches, verification."""

    sent: int
    received: int
    local: int
    bytes_sent: int
    batches: int
    verified: bool


def fingerprint(tensors: Sequence[torch.Tensor]) -> int:
    """Exact, order-sensitive checksum of the bytes of ``tensors`` (equal iff copied bit for bit, w.h.p.)."""
    total = 0
    for t in tensors:
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
        # Position weights make swapped bytes count; int64 cannot overflow below ~5e11 bytes per slot.
        pos = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 65521 + 1
        total += int((b * pos).sum().item())
    return total


def _check_weights(weights: Sequence[torch.Tensor], moves: MovePlan) -> None:
    if not weights:
        raise ValueError("weights must hold at least one tensor")
    layers_needed = int(moves.layer.max()) + 1 if len(moves) else 0
    for i, t in enumerate(weights):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2 or t.shape[1] != moves.slots_per_gpu or t.shape[0] < layers_needed:
            raise ValueError(
                f"weights[{i}] must be [layers >= {layers_needed}, slots_per_gpu={moves.slots_per_gpu}, ...], "
                f"got {tuple(t.shape)}"
            )
        if not t.is_contiguous():
            raise ValueError(f"weights[{i}] must be contiguous (slots are sent as views)")


def execute_moves(
    moves: MovePlan,
    weights: torch.Tensor | Sequence[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    batch_size: int = 32,
    verify: bool = True,
) -> TransferReport:
    """Apply ``moves`` to this rank's ``weights`` in place; collective over ``group`` (default: world).

    Raises ``RuntimeError`` naming the first mismatching moves if verification fails.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    tensors = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    _check_weights(tensors, moves)
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if len(moves) and (moves.src_gpu.max() >= world or moves.dst_gpu.max() >= world):
        raise ValueError(f"moves name GPUs beyond the group size {world}")
    per = moves.slots_per_gpu
    lay, src_l, dst_l = moves.layer, moves.src_slot % per, moves.dst_slot % per
    mine_src = moves.src_gpu == rank
    mine_dst = moves.dst_gpu == rank

    # Slots this rank both reads (as a source) and overwrites: keep their old content aside.
    written = {(int(a), int(b)) for a, b in zip(lay[mine_dst], dst_l[mine_dst])}
    snapshot: dict[tuple[int, int], list[torch.Tensor]] = {}
    for a, b in zip(lay[mine_src].tolist(), src_l[mine_src].tolist()):
        if (a, b) in written and (a, b) not in snapshot:
            snapshot[(a, b)] = [t[a, b].clone() for t in tensors]

    def source(i: int) -> list[torch.Tensor]:
        key = (int(lay[i]), int(src_l[i]))
        return snapshot.get(key) or [t[key[0], key[1]] for t in tensors]

    fp = np.zeros((len(moves), 2), dtype=np.int64)
    peer = (lambda g: dist.get_global_rank(group, g)) if group is not None else (lambda g: g)
    sent = received = local = 0
    bytes_sent = 0
    n_batches = 0
    for start in range(0, len(moves), batch_size):
        n_batches += 1
        reqs = []
        for i in range(start, min(start + batch_size, len(moves))):
            s_gpu, d_gpu = int(moves.src_gpu[i]), int(moves.dst_gpu[i])
            if s_gpu == rank and d_gpu == rank:
                src = source(i)
                if verify:
                    fp[i, 0] = fingerprint(src)
                for t, x in zip(tensors, src):
                    t[int(lay[i]), int(dst_l[i])].copy_(x)
                local += 1
            elif s_gpu == rank:
                src = source(i)
                if verify:
                    fp[i, 0] = fingerprint(src)
                for k, x in enumerate(src):
                    tag = (i - start) * len(tensors) + k
                    reqs.append(dist.isend(x.contiguous(), peer(d_gpu), group=group, tag=tag))
                    bytes_sent += x.numel() * x.element_size()
                sent += 1
            elif d_gpu == rank:
                for k, t in enumerate(tensors):
                    tag = (i - start) * len(tensors) + k
                    reqs.append(dist.irecv(t[int(lay[i]), int(dst_l[i])], peer(s_gpu), group=group, tag=tag))
                received += 1
        for r in reqs:
            if r is not None:  # None: this rank is not in the group (never here: peers are members)
                r.wait()
    logger.debug(
        "rank %d: sent %d, received %d, local %d in %d batches", rank, sent, received, local, n_batches
    )
    if verify and len(moves):
        for m in np.flatnonzero(mine_dst).tolist():
            fp[m, 1] = fingerprint([t[int(lay[m]), int(dst_l[m])] for t in tensors])
        # gloo reduces CPU tensors; NCCL needs them on the device.
        dev = torch.device("cpu") if dist.get_backend(group) == "gloo" else tensors[0].device
        both_t = torch.from_numpy(fp).to(dev)
        dist.all_reduce(both_t, group=group)
        both = both_t.cpu().numpy()
        bad = np.flatnonzero(both[:, 0] != both[:, 1])
        if bad.size:
            first = [moves.as_tuples()[j] for j in bad[:5]]
            raise RuntimeError(
                f"{bad.size} expert moves arrived corrupted, first (layer, expert, from, to): {first}"
            )
    return TransferReport(sent, received, local, bytes_sent, n_batches, bool(verify))
