"""Migration-aware re-planning: keep experts where they are when that costs little balance, and list moves.

A from-scratch re-plan (what the public EPLB does every interval) reshuffles almost every slot, so almost
every expert's weights cross the NVLink domain. :func:`replan_with_migration` instead starts from the old
placement, fixes only the replica counts that changed, and swaps replicas between GPUs only until each
layer's heaviest GPU is within ``tolerance`` of the from-scratch plan's. Per layer it keeps whichever of
the two (migration-aware, from-scratch) moves fewer experts among those within tolerance.

Scope: GPU-level (global policy, one domain, the production EP64 case); node groups are not preserved.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from deepinfer_core.eplb.policy import _check_int, refine_swaps
from deepinfer_core.eplb.stats import ExpertPlacement, _as_load

DEFAULT_MIGRATION_PASSES = 256


@attrs.frozen(slots=True, eq=False)
class MovePlan:
    """Weight moves that turn one slot table into another, one row per destination slot to fill.

    Columns (int64 arrays, same length): ``layer``, ``expert`` (logical id), ``src_gpu``, ``dst_gpu``,
    ``src_slot`` / ``dst_slot`` (global physical slot; the local index on its GPU is ``slot % slots_per_gpu``).
    Sources refer to the *old* table: an executor must read them before overwriting anything.
    """

    layer: np.ndarray
    expert: np.ndarray
    src_gpu: np.ndarray
    dst_gpu: np.ndarray
    src_slot: np.ndarray
    dst_slot: np.ndarray
    slots_per_gpu: int
    expert_bytes: int = 0

    def __len__(self) -> int:
        return int(self.layer.size)

    @property
    def num_remote(self) -> int:
        """Moves that cross GPUs (the rest are copies within one GPU)."""
        return int(np.count_nonzero(self.src_gpu != self.dst_gpu))

    @property
    def moved_bytes(self) -> int:
        """Bytes sent between GPUs: remote moves x ``expert_bytes``."""
        return self.num_remote * self.expert_bytes

    def as_tuples(self) -> list[tuple[int, int, int, int]]:
        """The moves as (layer, expert, from GPU, to GPU)."""
        return list(
            zip(self.layer.tolist(), self.expert.tolist(), self.src_gpu.tolist(), self.dst_gpu.tolist())
        )

    def apply(self, old_phy2log: np.ndarray) -> np.ndarray:
        """The slot table after the moves (reads every source from ``old_phy2log``, as an executor must)."""
        new = np.array(old_phy2log, dtype=np.int64, copy=True)
        if not np.array_equal(old_phy2log[self.layer, self.src_slot], self.expert):
            raise ValueError("move sources do not hold the moved experts in old_phy2log")
        new[self.layer, self.dst_slot] = self.expert
        return new


@attrs.frozen(slots=True, eq=False)
class MigrationPlan:
    """Result of :func:`replan_with_migration`: the chosen plan and the from-scratch one, with their moves."""

    placement: ExpertPlacement
    moves: MovePlan
    scratch: ExpertPlacement
    scratch_moves: MovePlan
    balance: np.ndarray  # per-layer max/mean GPU load of ``placement`` on the planning load
    scratch_balance: np.ndarray  # same for ``scratch``
    kept_scratch: np.ndarray  # bool [layers]: layers where the from-scratch plan was used


def _occurrence(keys: np.ndarray) -> np.ndarray:
    """For each element, how many equal keys come before it in array order."""
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    start = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
    sizes = np.diff(np.r_[start, sk.size])
    occ = np.empty_like(keys)
    occ[order] = np.arange(sk.size) - np.repeat(start, sizes)
    return occ


def align_within_gpus(old_phy2log: np.ndarray, new_phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Reorder each GPU's slots of ``new`` so experts it already held stay in their old slots.

    The GPU-level placement (which experts each GPU holds) is unchanged; only slot order within a GPU.
    """
    layers, reps = new_phy2log.shape
    rows = layers * num_gpus
    per = reps // num_gpus
    e_max = int(max(old_phy2log.max(), new_phy2log.max())) + 1
    row = np.repeat(np.arange(rows), per)
    o = old_phy2log.reshape(-1)
    n = new_phy2log.reshape(-1)
    ko, kn = row * e_max + o, row * e_max + n
    cnt_o = np.bincount(ko, minlength=rows * e_max)
    cnt_n = np.bincount(kn, minlength=rows * e_max)
    keep = _occurrence(ko) < cnt_n[ko]  # old slot whose expert the GPU still needs
    incoming = _occurrence(kn) >= cnt_o[kn]  # new copies the GPU did not hold before
    out = np.where(keep, o, -1)
    # Row-major order and equal counts per row: the i-th free slot of a GPU takes its i-th incoming expert.
    out[np.flatnonzero(~keep)] = n[incoming]
    return out.reshape(layers, reps)


def diff_placements(
    old_phy2log: np.ndarray, new_phy2log: np.ndarray, num_gpus: int, expert_bytes: int = 0
) -> MovePlan:
    """Moves filling every slot whose expert changes; sources prefer the same GPU, else spread round-robin."""
    old_phy2log = np.asarray(old_phy2log, dtype=np.int64)
    new_phy2log = np.asarray(new_phy2log, dtype=np.int64)
    if old_phy2log.shape != new_phy2log.shape:
        raise ValueError(f"old and new phy2log shapes differ: {old_phy2log.shape} vs {new_phy2log.shape}")
    layers, reps = old_phy2log.shape
    per = reps // num_gpus
    e_max = int(max(old_phy2log.max(), new_phy2log.max())) + 1
    lay, dst = np.nonzero(new_phy2log != old_phy2log)
    expert = new_phy2log[lay, dst]
    dst_gpu = dst // per
    # Holders of each (layer, expert) in the old table, grouped by key in slot order.
    hold_key = (np.arange(layers)[:, None] * e_max + old_phy2log).reshape(-1)
    order = np.argsort(hold_key, kind="stable")
    first = np.searchsorted(hold_key[order], np.arange(layers * e_max))
    count = np.bincount(hold_key, minlength=layers * e_max)
    key = lay * e_max + expert
    if np.any(count[key] == 0):
        raise ValueError("new placement holds an expert that no GPU holds in the old placement")
    pick = order[first[key] + _occurrence(key) % count[key]] % reps
    # A copy already on the destination GPU makes the move local.
    local_tab = np.full(layers * num_gpus * e_max, reps, dtype=np.int64)
    slot_ids = np.broadcast_to(np.arange(reps), old_phy2log.shape)
    lg_key = ((np.arange(layers)[:, None] * num_gpus + slot_ids // per) * e_max + old_phy2log).reshape(-1)
    np.minimum.at(local_tab, lg_key, slot_ids.reshape(-1))
    local = local_tab[(lay * num_gpus + dst_gpu) * e_max + expert]
    src = np.where(local < reps, local, pick)
    return MovePlan(
        lay.astype(np.int64), expert, src // per, dst_gpu, src, dst.astype(np.int64), per, int(expert_bytes)
    )


def _adjust_counts(
    old: np.ndarray, w: np.ndarray, c_old: np.ndarray, c_new: np.ndarray, num_gpus: int
) -> np.ndarray:
    """Old slot table with replica counts changed to ``c_new``, touching as few slots as possible.

    Surplus replicas leave the heaviest GPUs; the new ones go, heaviest first, to the lightest GPU that
    has a freed slot (the public greedy with per-GPU capacities). Vectorised over layers.
    """
    layers, reps = old.shape
    per = reps // num_gpus
    num_e = c_old.shape[1]
    lidx = np.arange(layers)[:, None]
    per_rep = w / c_new  # load per replica once the new counts are in place
    item = per_rep[lidx, old]
    gpu_load = item.reshape(layers, num_gpus, per).sum(axis=2)
    slot_load = np.repeat(gpu_load, per, axis=1)
    surplus = np.maximum(c_old - c_new, 0)
    key = (lidx * num_e + old).reshape(-1)
    order = np.lexsort((-slot_load.reshape(-1), key))  # by expert, heaviest GPU first
    occ = np.empty(key.size, dtype=np.int64)
    sk = key[order]
    start = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
    occ[order] = np.arange(sk.size) - np.repeat(start, np.diff(np.r_[start, sk.size]))
    removed = (occ < surplus.reshape(-1)[key]).reshape(layers, reps)
    out = np.where(removed, -1, old)
    deficit = np.maximum(c_new - c_old, 0)
    n_add = deficit.sum(axis=1)
    if n_add.max(initial=0) == 0:
        return out
    # Additions per layer, heaviest per-replica load first, padded with -1.
    width = int(n_add.max())
    add_e = np.full((layers, width), -1, dtype=np.int64)
    for_sort = np.where(deficit > 0, -per_rep, np.inf)
    ranked = np.argsort(for_sort, axis=1, kind="stable")
    rep = np.take_along_axis(deficit, ranked, axis=1)
    rl, rc = np.nonzero(rep > 0)
    reps_each = rep[rl, rc]
    el = np.repeat(rl, reps_each)
    ee = np.repeat(ranked[rl, rc], reps_each)
    pos = np.arange(el.size) - np.repeat(np.cumsum(n_add) - n_add, n_add)
    add_e[el, pos] = ee
    loads = np.where(removed, 0.0, item).reshape(layers, num_gpus, per).sum(axis=2)
    free = removed.reshape(layers, num_gpus, per)
    r = np.arange(layers)
    for j in range(width):
        e = add_e[:, j]
        live = e >= 0
        if not live.any():
            break
        masked = np.where(free.any(axis=2), loads, np.inf)
        g = masked.argmin(axis=1)
        s = free[r, g].argmax(axis=1)
        rr, gg, ss, ee2 = r[live], g[live], s[live], e[live]
        out[rr, gg * per + ss] = ee2
        free[rr, gg, ss] = False
        loads[rr, gg] += per_rep[rr, ee2]
    return out


def replan_with_migration(
    old: ExpertPlacement,
    weight: Any,
    *,
    tolerance: float = 0.01,
    expert_bytes: int = 0,
    max_passes: int = DEFAULT_MIGRATION_PASSES,
) -> MigrationPlan:
    """Re-plan ``old`` for new loads ``weight`` [layers, experts], moving few experts.

    Each layer's plan has max/mean GPU load at most ``(1 + tolerance)`` times the from-scratch plan's
    (:func:`rebalance_experts`, global policy); among plans that qualify, the one with fewer moved experts.
    ``expert_bytes`` (bytes of one expert's weights) sets ``MovePlan.moved_bytes``.
    """
    if not isinstance(old, ExpertPlacement):
        raise TypeError(f"old must be an ExpertPlacement, got {type(old).__name__}")
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < 1):
        raise ValueError(f"tolerance must be a float in [0, 1), got {tolerance!r}")
    _check_int("expert_bytes", expert_bytes, minimum=0)
    _check_int("max_passes", max_passes, minimum=0)
    layers, reps, num_gpus, num_e = old.num_layers, old.num_replicas, old.num_gpus, old.num_experts
    w = _as_load(weight, layers, num_e)
    per = reps // num_gpus
    scratch_raw = ExpertPlacement.plan(w, reps, 1, 1, num_gpus)
    scratch_tab = align_within_gpus(old.phy2log, scratch_raw.phy2log, num_gpus)
    scratch = ExpertPlacement.from_phy2log(scratch_tab, num_e, num_gpus)
    c_new = scratch.logcnt
    scratch_max = scratch.gpu_loads(w).max(axis=1)
    per_rep = w / c_new
    cur = _adjust_counts(old.phy2log, w, old.logcnt, c_new, num_gpus)
    item_w = np.take_along_axis(per_rep, cur, axis=1)
    slots = np.broadcast_to(np.arange(reps).reshape(1, num_gpus, per), (layers, num_gpus, per)).copy()
    target = scratch_max * (1 + tolerance)
    slots = refine_swaps(item_w, slots, max_passes, target=target)
    mig_tab = align_within_gpus(
        old.phy2log, np.take_along_axis(cur, slots.reshape(layers, reps), axis=1), num_gpus
    )
    mig = ExpertPlacement.from_phy2log(mig_tab, num_e, num_gpus)
    mig_max = mig.gpu_loads(w).max(axis=1)
    changed_mig = (mig_tab != old.phy2log).sum(axis=1)
    changed_scr = (scratch_tab != old.phy2log).sum(axis=1)
    use_scratch = (mig_max > target * (1 + 1e-12)) | (changed_scr < changed_mig)
    final_tab = np.where(use_scratch[:, None], scratch_tab, mig_tab)
    final = ExpertPlacement.from_phy2log(final_tab, num_e, num_gpus)
    mean = w.sum(axis=1) / num_gpus
    safe = np.where(mean > 0, mean, 1.0)
    bal = np.where(mean > 0, final.gpu_loads(w).max(axis=1) / safe, 1.0)
    sbal = np.where(mean > 0, scratch_max / safe, 1.0)
    return MigrationPlan(
        placement=final,
        moves=diff_placements(old.phy2log, final_tab, num_gpus, expert_bytes),
        scratch=scratch,
        scratch_moves=diff_placements(old.phy2log, scratch_tab, num_gpus, expert_bytes),
        balance=bal,
        scratch_balance=sbal,
        kept_scratch=use_scratch,
    )
