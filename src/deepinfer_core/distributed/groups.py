"""Process groups of a DP-attention / EP-MoE serving instance over torch.distributed.

Layout (DeepInfer's production shape: as many EP ranks as DP ranks, no tensor parallelism): the world of
``world_size`` ranks is cut into ``world_size // group_size`` independent instances of ``group_size``
consecutive ranks. Inside an instance three groups span the same ranks:

- ``dp``: attention in data parallel; the step-type vote and the per-step lock-step rounds;
- ``ep``: the MoE in expert parallel; token dispatch / combine (all-to-all) and EPLB weight moves;
- ``engram``: the engram-parallel group holding the Engram tables sharded by rows.

They are separate communicators (``new_group`` over the same ranks) so each kind of traffic has its own
channel; every rank still issues them in the same order (see :mod:`deepinfer_core.distributed.ep`).
gloo on CPU and NCCL on GPU take the same code paths: collectives run on ``groups.device``.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import attrs
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


@attrs.frozen(kw_only=True)
class ParallelGroups:
    """This rank's place in the layout and its three groups (see the module docstring)."""

    world_size: int
    rank: int  # global rank
    group_size: int  # DP size = EP size = engram-parallel size of one instance
    instance: int  # which instance this rank belongs to
    backend: str
    device: torch.device  # where collective tensors live (cpu for gloo, this rank's GPU for NCCL)
    timeout_s: float
    dp: Any = attrs.field(repr=False)
    ep: Any = attrs.field(repr=False)
    engram: Any = attrs.field(repr=False)

    @property
    def group_rank(self) -> int:
        """Rank inside the instance (DP rank = EP rank)."""
        return self.rank - self.instance * self.group_size

    @property
    def ranks(self) -> list[int]:
        """Global ranks of this instance."""
        return list(range(self.instance * self.group_size, (self.instance + 1) * self.group_size))


def _check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}={v!r}: must be an int >= {lo}")
    return v


def init_groups(
    group_size: int | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = 60.0,
    init_method: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    device: torch.device | str | None = None,
) -> ParallelGroups:
    """Initialise torch.distributed (unless already initialised) and build this rank's groups.

    Under ``torchrun`` call it with no arguments (rank, world size and the rendezvous come from the
    environment). From Python give ``init_method`` (e.g. ``"tcp://127.0.0.1:29500"``), ``world_size`` and
    ``rank`` (:func:`deepinfer_core.distributed.launch.spawn` does). ``group_size`` defaults to the whole
    world (one instance). ``backend`` defaults to NCCL when CUDA is available, else gloo. ``timeout_s``
    bounds every collective: a dead or stuck rank makes the others' collectives fail after at most this
    long instead of hanging (the engine then fails the group's requests).
    """
    if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r}: must be a number > 0 (seconds)")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {list(BACKENDS)}")
    timeout = datetime.timedelta(seconds=float(timeout_s))
    if not dist.is_initialized():
        kw: dict[str, Any] = {"backend": backend, "timeout": timeout}
        if init_method is not None:
            if world_size is None or rank is None:
                raise ValueError("init_method: give world_size and rank with it")
            kw.update(
                init_method=init_method,
                world_size=_check_int("world_size", world_size, 1),
                rank=_check_int("rank", rank, 0),
            )
        elif "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(
                "init_groups: not under torchrun (RANK / WORLD_SIZE unset); pass init_method, "
                "world_size and rank, or use deepinfer_core.distributed.spawn"
            )
        dist.init_process_group(**kw)
    elif dist.get_backend() != backend:
        raise ValueError(
            f"backend={backend!r}: torch.distributed is already initialised with {dist.get_backend()!r}"
        )
    world, me = dist.get_world_size(), dist.get_rank()
    size = world if group_size is None else _check_int("group_size", group_size, 1)
    if world % size:
        raise ValueError(f"group_size={size}: must divide the world size {world}")
    if device is None:
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", me % max(torch.cuda.device_count(), 1)))
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        else:
            device = torch.device("cpu")
    # every rank must create every group, in the same order (torch.distributed's rule for new_group)
    mine: dict[str, Any] = {}
    for inst in range(world // size):
        ranks = list(range(inst * size, (inst + 1) * size))
        made = {
            kind: dist.new_group(ranks, timeout=timeout, backend=backend) for kind in ("dp", "ep", "engram")
        }
        if me in ranks:
            mine = made
    groups = ParallelGroups(
        world_size=world,
        rank=me,
        group_size=size,
        instance=me // size,
        backend=backend,
        device=torch.device(device),
        timeout_s=float(timeout_s),
        **mine,
    )
    log.info(
        "rank %d/%d: instance %d of %d ranks (DP = EP = engram group), backend %s, timeout %.1fs",
        me,
        world,
        groups.instance,
        size,
        backend,
        timeout_s,
    )
    return groups


def shutdown() -> None:
    """Tear the process groups down (best effort: after a peer failure it must not hang or raise)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # a broken group may refuse; the process is leaving anyway
            log.warning("destroy_process_group: %s", e)
