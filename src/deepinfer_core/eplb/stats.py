"""Placements as plain data, the moe_lb metric, and the sliding window of per-expert load statistics."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from deepinfer_core.eplb.policy import _check_int, rebalance_experts


@attrs.frozen(slots=True)
class EPLBConfig:
    """When to re-plan and how many redundant replicas to keep (defaults from DeepSeek's deployment Q&A).

    ``window_steps``: statistics window; ``replan_interval``: steps between re-plans;
    ``redundant_per_gpu``: extra replicas per GPU, so ``num_replicas = experts + redundant_per_gpu * gpus``.
    """

    window_steps: int
    replan_interval: int
    redundant_per_gpu: int

    def __attrs_post_init__(self) -> None:
        _check_int("window_steps", self.window_steps)
        _check_int("replan_interval", self.replan_interval)
        _check_int("redundant_per_gpu", self.redundant_per_gpu, minimum=0)

    def num_replicas(self, num_experts: int, num_gpus: int) -> int:
        """Physical slots per layer for ``num_experts`` logical experts on ``num_gpus`` GPUs."""
        total = _check_int("num_experts", num_experts) + self.redundant_per_gpu * _check_int(
            "num_gpus", num_gpus
        )
        if total % num_gpus:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_gpus ({num_gpus})")
        return total


# Prefill: 100-step window, re-plan every 1,000 steps, 4 redundant experts per GPU (measured moe_lb 1.074
# at EP4/DP4). Decode: re-plan every 10,000 steps on a 1,000-step window, 1 redundant expert per GPU
# (moe_lb 1.090 at EP64). Both from the deployment Q&A as quoted in the seeds.
PREFILL = EPLBConfig(window_steps=100, replan_interval=1_000, redundant_per_gpu=4)
DECODE = EPLBConfig(window_steps=1_000, replan_interval=10_000, redundant_per_gpu=1)


@attrs.frozen(slots=True, eq=False)
class ExpertPlacement:
    """One plan in EPLB's conventions, with the GPU count needed to read it (slot p on GPU p // per_gpu)."""

    phy2log: np.ndarray  # [layers, replicas]
    log2phy: np.ndarray  # [layers, logical, max replicas], -1 padded
    logcnt: np.ndarray  # [layers, logical]
    num_gpus: int

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_replicas(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.logcnt.shape[1])

    @property
    def slots_per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus

    def gpu_of_slot(self) -> np.ndarray:
        """GPU of each physical slot, [replicas]."""
        return np.arange(self.num_replicas) // self.slots_per_gpu

    def gpu_loads(self, load: np.ndarray) -> np.ndarray:
        """Per-layer GPU loads [layers, gpus] when each expert's load is split evenly over its replicas."""
        load = _as_load(load, self.num_layers, self.num_experts)
        per_replica = np.take_along_axis(load / self.logcnt, self.phy2log, axis=1)
        return per_replica.reshape(self.num_layers, self.num_gpus, self.slots_per_gpu).sum(axis=2)

    @classmethod
    def plan(
        cls, weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, **kwargs: Any
    ) -> ExpertPlacement:
        """Run :func:`rebalance_experts` and wrap its output."""
        phy2log, log2phy, logcnt = rebalance_experts(
            weight, num_replicas, num_groups, num_nodes, num_gpus, **kwargs
        )
        return cls(np.asarray(phy2log), np.asarray(log2phy), np.asarray(logcnt), num_gpus)

    @classmethod
    def from_phy2log(cls, phy2log: np.ndarray, num_experts: int, num_gpus: int) -> ExpertPlacement:
        """Rebuild ``log2phy`` and ``logcnt`` from a slot table (replica ranks in slot order)."""
        phy2log = np.asarray(phy2log, dtype=np.int64)
        if phy2log.ndim != 2:
            raise ValueError(f"phy2log must be 2-D [layers, replicas], got shape {phy2log.shape}")
        layers, reps = phy2log.shape
        if reps % num_gpus:
            raise ValueError(f"replicas ({reps}) must be a multiple of num_gpus ({num_gpus})")
        if phy2log.min() < 0 or phy2log.max() >= num_experts:
            raise ValueError(f"phy2log entries must be in [0, {num_experts})")
        logcnt = np.zeros((layers, num_experts), dtype=np.int64)
        np.add.at(logcnt, (np.arange(layers)[:, None], phy2log), 1)
        if (logcnt == 0).any():
            raise ValueError("every logical expert needs at least one replica in phy2log")
        # Replica rank of each slot: its occurrence index among equal experts, in slot order.
        order = np.argsort(phy2log, axis=1, kind="stable")
        sorted_e = np.take_along_axis(phy2log, order, axis=1)
        first = np.take_along_axis(np.cumsum(logcnt, axis=1) - logcnt, sorted_e, axis=1)
        rank = np.empty_like(phy2log)
        np.put_along_axis(rank, order, np.arange(reps) - first, axis=1)
        maxcnt = reps - num_experts + 1
        log2phy = np.full((layers, num_experts * maxcnt), -1, dtype=np.int64)
        np.put_along_axis(
            log2phy, phy2log * maxcnt + rank, np.broadcast_to(np.arange(reps), phy2log.shape), axis=1
        )
        return cls(phy2log, log2phy.reshape(layers, num_experts, maxcnt), logcnt, num_gpus)


def _as_load(load: Any, layers: int, experts: int) -> np.ndarray:
    arr = np.asarray(load, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.shape != (layers, experts):
        raise ValueError(
            f"load must have shape ({layers}, {experts}) [layers, logical experts], got {arr.shape}"
        )
    if np.any(arr < 0) or not np.all(np.isfinite(arr)):
        raise ValueError("load must be finite and non-negative")
    return arr


def moe_lb(load: Any, placement: ExpertPlacement, *, per_layer: bool = False) -> Any:
    """Slowest rank over mean rank: the seeds' moe_lb, for loads [layers, experts] under ``placement``.

    Layers run one after another and each waits for its slowest rank, so the aggregate is
    ``sum over layers of max GPU load / sum over layers of mean GPU load``. ``per_layer=True`` returns the
    per-layer ratios instead. A layer (or step) with no tokens counts as balanced (1.0).
    """
    loads = placement.gpu_loads(load)
    mx, mean = loads.max(axis=1), loads.mean(axis=1)
    if per_layer:
        return np.where(mean > 0, mx / np.where(mean > 0, mean, 1.0), 1.0)
    total = mean.sum()
    return float(mx.sum() / total) if total > 0 else 1.0


def moe_lb_steps(counts: Any, placement: ExpertPlacement) -> np.ndarray:
    """:func:`moe_lb` of each of many steps at once: counts [steps, layers, experts] -> [steps]."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 3 or c.shape[1:] != (placement.num_layers, placement.num_experts):
        raise ValueError(
            f"counts must be [steps, {placement.num_layers}, {placement.num_experts}], got {c.shape}"
        )
    per_replica = np.take_along_axis(c / placement.logcnt, placement.phy2log[None], axis=2)
    loads = per_replica.reshape(c.shape[0], placement.num_layers, placement.num_gpus, -1).sum(axis=3)
    total_mean = loads.mean(axis=2).sum(axis=1)
    total_max = loads.max(axis=2).sum(axis=1)
    return np.where(total_mean > 0, total_max / np.where(total_mean > 0, total_mean, 1.0), 1.0)


class ExpertLoadWindow:
    """Per-layer, per-expert token counts summed over the last ``window_steps`` recorded steps.

    A ring buffer of ``window_steps`` x [layers, experts] int64 counts plus their running sum, so
    :meth:`record` and :meth:`load` are O(layers x experts) whatever the window length.
    """

    def __init__(self, num_layers: int, num_experts: int, window_steps: int = PREFILL.window_steps) -> None:
        self.num_layers = _check_int("num_layers", num_layers)
        self.num_experts = _check_int("num_experts", num_experts)
        self.window_steps = _check_int("window_steps", window_steps)
        self._ring = np.zeros((self.window_steps, self.num_layers, self.num_experts), dtype=np.int64)
        self._sum = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        self._steps = 0

    @property
    def steps_recorded(self) -> int:
        """Steps recorded since creation (or the last reset)."""
        return self._steps

    @property
    def full(self) -> bool:
        """Whether the window holds ``window_steps`` steps."""
        return self._steps >= self.window_steps

    def record(self, counts: Any) -> None:
        """Add one step's token counts [layers, experts] (non-negative integers)."""
        arr = np.asarray(counts)
        if arr.shape != (self.num_layers, self.num_experts):
            raise ValueError(
                f"counts must have shape ({self.num_layers}, {self.num_experts}), got {arr.shape}"
            )
        if arr.dtype.kind not in "iu":
            if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
                raise ValueError("counts must be integer token counts")
            arr = arr.astype(np.int64)
        if np.any(arr < 0):
            raise ValueError("counts must be non-negative")
        slot = self._steps % self.window_steps
        self._sum += arr - self._ring[slot]
        self._ring[slot] = arr
        self._steps += 1

    def record_many(self, counts: Any) -> None:
        """Record several steps at once, counts [steps, layers, experts] in step order."""
        arr = np.asarray(counts)
        if arr.ndim != 3 or arr.shape[1:] != (self.num_layers, self.num_experts):
            raise ValueError(
                f"counts must be [steps, {self.num_layers}, {self.num_experts}], got {arr.shape}"
            )
        if arr.dtype.kind not in "iu" or np.any(arr < 0):
            raise ValueError("counts must be non-negative integer token counts")
        n = arr.shape[0]
        if n == 0:
            return
        if n >= self.window_steps:
            # Only the last window_steps survive; lay them out as if recorded one by one.
            last = arr[n - self.window_steps :]
            pos = (self._steps + n - self.window_steps + np.arange(self.window_steps)) % self.window_steps
            self._ring[pos] = last
            self._sum = last.sum(axis=0, dtype=np.int64)
        else:
            pos = (self._steps + np.arange(n)) % self.window_steps  # distinct since n < window
            self._sum += arr.sum(axis=0, dtype=np.int64) - self._ring[pos].sum(axis=0)
            self._ring[pos] = arr
        self._steps += n

    def load(self) -> np.ndarray:
        """Token counts [layers, experts] over the window (a copy)."""
        return self._sum.copy()

    def reset(self) -> None:
        """Forget everything recorded."""
        self._ring[:] = 0
        self._sum[:] = 0
        self._steps = 0
