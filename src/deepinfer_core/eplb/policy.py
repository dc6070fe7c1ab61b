"""Expert placement policy with DeepSeek EPLB's signature and output conventions, vectorised over layers.

``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus) -> (phy2log, log2phy, logcnt)``
follows the public algorithm step for step (same greedy, same tie-breaking: stable descending sort, lowest
index wins), so its plan is never worse than the public one; it then refines the final packing of replicas
onto GPUs with swap passes that can only lower the heaviest GPU. Every step is a loop over *slots* (or swap
passes) whose body is one numpy operation over all layers (and nodes) at once: no Python loop per expert
per layer.

Conventions (identical to the public EPLB):
- ``weight`` [layers, logical experts], non-negative loads (token counts).
- ``phy2log`` [layers, num_replicas]: logical expert held by physical slot ``p``; slot ``p`` lives on GPU
  ``p // (num_replicas // num_gpus)``.
- ``log2phy`` [layers, logical, num_replicas - logical + 1]: physical slots of each logical expert by replica
  rank, padded with -1.
- ``logcnt`` [layers, logical]: replica count per logical expert (>= 1, sums to ``num_replicas``).
Numpy in gives numpy out; a torch tensor in gives int64 torch tensors out (CPU), so torch callers can switch.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# Each swap pass costs one or two [rows, 8..packs/2, cap, 8 x cap] array ops. On Zipf loads at EP64, 12
# passes take the mean overload from 0.1-1.5% (public greedy) to 0.04-0.09% for about the greedy's own
# time again; more passes help little (benchmarks/eplb.py, docs/performance.md).
DEFAULT_REFINE_PASSES = 12


def _as_weight(weight: Any) -> tuple[np.ndarray, bool]:
    """float64 numpy view of ``weight`` and whether it came in as a torch tensor."""
    is_torch = type(weight).__module__.startswith("torch")
    arr = weight.detach().cpu().double().numpy() if is_torch else np.asarray(weight, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"weight must be 2-D [layers, logical experts], got shape {arr.shape}")
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"weight must have at least one layer and one expert, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("weight must be finite (no NaN or inf)")
    if np.any(arr < 0):
        raise ValueError("weight must be non-negative (loads are token counts)")
    return arr, is_torch


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of a batch of permutations [rows, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def balanced_packing(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Greedy packing of ``n`` items per row into ``num_packs`` packs of exactly ``n / num_packs`` items.

    The public greedy: items by descending weight (stable), each to the lightest pack that still has room
    (lowest index on ties). Returns ``slots`` [rows, num_packs, n / num_packs]: item index at (pack, rank).
    """
    rows, n = weight.shape
    cap = n // num_packs
    if cap == 1:  # as the public code: nothing to balance, item i goes to pack i
        return np.broadcast_to(np.arange(n).reshape(1, n, 1), (rows, n, 1)).copy()
    order = np.argsort(-weight, axis=1, kind="stable")
    sorted_w = np.take_along_axis(weight, order, axis=1)
    # Flat (row, pack) indexing: one cheap take/put per array per item instead of 2-D fancy indexing.
    # Full packs are set to +inf in ``masked`` so argmin skips them; ``masked`` doubles as the load.
    masked = np.zeros(rows * num_packs)
    counts = np.zeros(rows * num_packs, dtype=np.int64)
    slot_flat = np.empty(rows * num_packs * cap, dtype=np.int64)
    base = np.arange(rows) * num_packs
    for j in range(n):
        f = base + masked.reshape(rows, num_packs).argmin(axis=1)
        c = counts[f]
        slot_flat[f * cap + c] = order[:, j]
        counts[f] = c + 1
        masked[f] = np.where(c + 1 < cap, masked[f] + sorted_w[:, j], np.inf)
    return slot_flat.reshape(rows, num_packs, cap)


def _apply_swaps(
    slots: np.ndarray,
    item_w: np.ndarray,
    loads: np.ndarray,
    rows: np.ndarray,
    pa: np.ndarray,
    ia: np.ndarray,
    pb: np.ndarray,
    ib: np.ndarray,
) -> None:
    """Swap item (pa, ia) with (pb, ib) in each listed row; the listed packs of a row must be distinct."""
    sa, sb = slots[rows, pa, ia], slots[rows, pb, ib]
    slots[rows, pa, ia], slots[rows, pb, ib] = sb, sa
    wa, wb = item_w[rows, pa, ia], item_w[rows, pb, ib]
    item_w[rows, pa, ia], item_w[rows, pb, ib] = wb, wa
    loads[rows, pa] += wb - wa
    loads[rows, pb] += wa - wb


def _best_swap(
    half_gap: np.ndarray, wh: np.ndarray, wg: np.ndarray, bias: np.ndarray | None
) -> tuple[np.ndarray, ...]:
    """Best single swap between a heavy pack's items ``wh`` [..., ca] and other items ``wg`` [..., cb].

    Moving ``d = w_x - w_y`` from a pack of load ``lh`` to one of load ``lg`` leaves the pair maximum at
    ``(lh + lg) / 2 + |d - gap / 2|`` (gap = lh - lg), below ``lh`` exactly when ``|d - gap / 2| < gap / 2``.
    ``half_gap`` and ``bias`` (= lg / 2, to rank swaps with different partners) are per item of ``wg``.
    Returns (flat argmin over [ca, cb], its score |d - gap/2|, the half gap of the chosen partner).
    """
    score = np.subtract(wh[..., :, None], wg[..., None, :])  # in place below: one [.., ca, cb] buffer
    score -= half_gap[..., None, :]
    np.abs(score, out=score)
    ranked = score + bias[..., None, :] if bias is not None else score
    flat = ranked.reshape(*ranked.shape[:-2], -1)
    best = flat.argmin(axis=-1)
    s = np.take_along_axis(score.reshape(flat.shape), best[..., None], axis=-1)[..., 0]
    hg = np.take_along_axis(half_gap, (best % wg.shape[-1])[..., None], axis=-1)[..., 0]
    return best, s, hg


def _pass_pairs(
    it: int,
    act: np.ndarray,
    slots: np.ndarray,
    item_w: np.ndarray,
    loads: np.ndarray,
    target: np.ndarray,
    tol: np.ndarray,
) -> np.ndarray:
    """k-th heaviest pack with the (k + it)-th lightest, all disjoint pairs at once. Rows that swapped."""
    packs, cap = item_w.shape[1:]
    half = packs // 2
    la = loads[act]
    order = np.argsort(la, axis=1)
    # Rotate the pairing each pass so a heavy pack meets a different light partner next time.
    heavy, light = order[:, ::-1][:, :half], np.roll(order[:, :half], -(it % half), axis=1)
    lh = np.take_along_axis(la, heavy, axis=1)
    hg = (lh - np.take_along_axis(la, light, axis=1)) / 2
    wh, wl = item_w[act[:, None], heavy], item_w[act[:, None], light]  # [k, half, cap]
    best, sc, _ = _best_swap(np.broadcast_to(hg[..., None], wl.shape), wh, wl, None)
    ok = (sc < hg - tol[act, None]) & (lh > target[act, None])
    rr, kk = np.nonzero(ok)
    if rr.size:
        ia, ib = np.divmod(best[rr, kk], cap)
        _apply_swaps(slots, item_w, loads, act[rr], heavy[rr, kk], ia, light[rr, kk], ib)
    return ok.any(axis=1)


def _pass_top(
    act: np.ndarray,
    slots: np.ndarray,
    item_w: np.ndarray,
    loads: np.ndarray,
    target: np.ndarray,
    tol: np.ndarray,
) -> np.ndarray:
    """The m heaviest packs each take their best swap with any of the m lightest; clashes wait a pass."""
    packs, cap = item_w.shape[1:]
    m = min(packs // 2, 8)
    la = loads[act]
    order = np.argsort(la, axis=1)
    heavy, light = order[:, ::-1][:, :m], order[:, :m]
    lh = np.take_along_axis(la, heavy, axis=1)  # [k, m]
    ll = np.take_along_axis(la, light, axis=1)
    hg = np.repeat((lh[:, :, None] - ll[:, None, :]) / 2, cap, axis=2)  # per light item [k, m, m*cap]
    bias = np.broadcast_to(np.repeat(ll / 2, cap, axis=1)[:, None, :], hg.shape)
    wh = item_w[act[:, None], heavy]  # [k, m, cap]
    wl = np.broadcast_to(item_w[act[:, None], light].reshape(act.size, 1, m * cap), hg.shape)
    best, sc, hgb = _best_swap(hg, wh, wl, bias)
    ok = (sc < hgb - tol[act, None]) & (lh > target[act, None])
    partner = np.take_along_axis(light, best % (m * cap) // cap, axis=1)
    # Keep the swaps disjoint: a partner already taken by a heavier pack waits for the next pass.
    for j in range(1, m):
        ok[:, j] &= ~((partner[:, :j] == partner[:, j : j + 1]) & ok[:, :j]).any(axis=1)
    rr, kk = np.nonzero(ok)
    if rr.size:
        ia, jb = np.divmod(best[rr, kk], m * cap)
        _apply_swaps(slots, item_w, loads, act[rr], heavy[rr, kk], ia, partner[rr, kk], jb % cap)
    return ok.any(axis=1)


def refine_swaps(
    weight: np.ndarray,
    slots: np.ndarray,
    max_passes: int = DEFAULT_REFINE_PASSES,
    target: np.ndarray | None = None,
) -> np.ndarray:
    """Lower heavy packs by swapping one of their items with a lighter item of another pack.

    A swap between packs a (heavier) and b moves ``d = w_x - w_y > 0`` from a to b and is taken only if
    ``max(load_a - d, load_b + d) < load_a``: no pack ever exceeds the previous load of the heavier one, so
    a row's maximum never rises and pack sizes never change. Passes alternate between two kinds, each
    applying many disjoint swaps at once: the k-th heaviest pack with the (k + pass)-th lightest (all
    pairs), and the 8 heaviest packs each with its best partner among the 8 lightest. A row where two
    passes in a row find nothing is at a local optimum and stops. ``slots`` [rows, packs, cap] is updated
    in place.

    Only packs heavier than their row's ``target`` are relieved, and a row stops once its maximum is at or
    below it. The default target is the mean pack load x (1 + 1e-4): closer to perfect is noise next to
    any per-step routing variation. The migration planner passes a looser target to move no more than needed.
    """
    rows, packs, cap = slots.shape
    if packs < 2 or max_passes <= 0:
        return slots
    item_w = np.take_along_axis(weight, slots.reshape(rows, -1), axis=1).reshape(rows, packs, cap)
    loads = item_w.sum(axis=2)
    mean = loads.mean(axis=1)
    if target is None:
        target = mean * (1 + 1e-4)
    # Improvements smaller than this are float noise: accepting them could cycle.
    tol = 1e-9 * np.maximum(mean, 1e-300)
    fails = np.zeros(rows, dtype=np.int64)
    for it in range(max_passes):
        act = np.flatnonzero((fails < 2) & (loads.max(axis=1) > target))
        if act.size == 0:
            break
        if it % 2 == 1:
            swapped = _pass_pairs(it // 2, act, slots, item_w, loads, target, tol)
        else:
            swapped = _pass_top(act, slots, item_w, loads, target, tol)
        fails[act] = np.where(swapped, 0, fails[act] + 1)
    return slots


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give ``num_phy - n`` extra replicas, each to the expert with the largest load per replica.

    This is the public greedy (D'Hondt apportionment); it minimises the largest per-replica load. Returns
    ``phy2log`` [rows, num_phy], ``rank`` [rows, num_phy] (replica index of each slot), ``logcnt`` [rows, n].
    """
    rows, n = weight.shape
    phy2log = np.empty((rows, num_phy), dtype=np.int64)
    phy2log[:, :n] = np.arange(n)
    rank = np.zeros((rows, num_phy), dtype=np.int64)
    logcnt = np.ones((rows, n), dtype=np.int64)
    r = np.arange(rows)
    per_replica = weight.copy()
    for i in range(n, num_phy):
        e = per_replica.argmax(axis=1)
        phy2log[:, i] = e
        c = logcnt[r, e]
        rank[:, i] = c
        logcnt[r, e] = c + 1
        per_replica[r, e] = weight[r, e] / (c + 1)
    return phy2log, rank, logcnt


def _hierarchical(
    w: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int, refine_passes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    layers, num_log = w.shape
    group_size = num_log // num_groups
    phy_per_gpu = num_phy // num_gpus
    log_per_node = num_log // num_nodes

    # Step 1: pack expert groups onto nodes; relabel experts so each node owns a contiguous range ("mlog").
    tokens_per_group = w.reshape(layers, num_groups, group_size).sum(axis=2)
    gslots = balanced_packing(tokens_per_group, num_nodes).reshape(layers, num_groups)  # node-major groups
    group_pos = _inverse(gslots)  # position of each group in node-major order
    log2mlog = (group_pos * group_size)[:, :, None] + np.arange(group_size)
    log2mlog = log2mlog.reshape(layers, num_log)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate within each node (rows = layer x node).
    tokens_per_mlog = np.take_along_axis(w, mlog2log, axis=1).reshape(layers * num_nodes, log_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_phy // num_nodes)

    # Step 3: pack the node's replicas onto its GPUs, then refine with swaps (within the node).
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, axis=1)
    slots = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    slots = refine_swaps(tokens_per_phy, slots, refine_passes)
    pphy2phy = slots.reshape(layers * num_nodes, -1)  # GPU-major physical order -> replica index
    assert pphy2phy.shape[1] == (num_gpus // num_nodes) * phy_per_gpu
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    node_base = np.arange(0, num_log, log_per_node).reshape(1, num_nodes, 1)
    pphy2mlog = (pphy2mlog.reshape(layers, num_nodes, -1) + node_base).reshape(layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, axis=1)
    return pphy2log, pphyrank, logcnt


def build_log2phy(phy2log: np.ndarray, phyrank: np.ndarray, num_log: int) -> np.ndarray:
    """``log2phy`` [layers, logical, R - logical + 1] from ``phy2log`` and each slot's replica rank."""
    layers, num_phy = phy2log.shape
    maxlogcnt = num_phy - num_log + 1
    log2phy = np.full((layers, num_log * maxlogcnt), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy, phy2log * maxlogcnt + phyrank, np.broadcast_to(np.arange(num_phy), phy2log.shape), axis=1
    )
    return log2phy.reshape(layers, num_log, maxlogcnt)


def rebalance_experts(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    refine_passes: int = DEFAULT_REFINE_PASSES,
) -> tuple[Any, Any, Any]:
    """Place ``num_replicas`` physical experts per layer; see the module docstring for the conventions.

    Hierarchical policy (groups packed onto nodes, replicas within a node, replicas onto the node's GPUs)
    when ``num_groups % num_nodes == 0``; otherwise the global policy (one group, one node). With
    ``refine_passes=0`` the plan is exactly the public greedy's.
    """
    w, is_torch = _as_weight(weight)
    num_replicas = _check_int("num_replicas", num_replicas)
    num_groups = _check_int("num_groups", num_groups)
    num_nodes = _check_int("num_nodes", num_nodes)
    num_gpus = _check_int("num_gpus", num_gpus)
    refine_passes = _check_int("refine_passes", refine_passes, minimum=0)
    layers, num_log = w.shape
    if num_replicas < num_log:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be >= the number of logical experts ({num_log})"
        )
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})")
    if num_groups % num_nodes == 0:
        if num_log % num_groups:
            raise ValueError(f"logical experts ({num_log}) must be a multiple of num_groups ({num_groups})")
        if num_gpus % num_nodes:
            raise ValueError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
        phy2log, phyrank, logcnt = _hierarchical(
            w, num_replicas, num_groups, num_nodes, num_gpus, refine_passes
        )
    else:
        phy2log, phyrank, logcnt = _hierarchical(w, num_replicas, 1, 1, num_gpus, refine_passes)
    log2phy = build_log2phy(phy2log, phyrank, num_log)
    logger.debug(
        "rebalance_experts: %d layers, %d experts -> %d slots on %d GPUs",
        layers,
        num_log,
        num_replicas,
        num_gpus,
    )
    if is_torch:
        import torch

        return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
    return phy2log, log2phy, logcnt
