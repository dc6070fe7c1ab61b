"""A straightforward, loop-per-layer implementation of the public DeepSeek EPLB greedy (test oracle only).

Written from the published description of the algorithm: pack expert groups onto nodes (heaviest group
first, into the lightest node with room), hand out redundant replicas one at a time to the expert with the
largest load per replica, then pack the replicas onto GPUs the same way as groups onto nodes. Ties go to
the lowest index (stable descending sort, first minimum). Plain Python lists, one layer at a time: slow on
purpose, obviously correct, and independent of the vectorised code under test.
"""

from __future__ import annotations

import numpy as np


def _pack(weights: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    n = len(weights)
    cap = n // num_packs
    if cap == 1:
        return list(range(n)), [0] * n
    order = sorted(range(n), key=lambda i: -weights[i])  # sorted() is stable
    loads = [0.0] * num_packs
    counts = [0] * num_packs
    pack = [0] * n
    rank = [0] * n
    for i in order:
        best = -1
        for p in range(num_packs):
            if counts[p] < cap and (best < 0 or loads[p] < loads[best]):
                best = p
        pack[i] = best
        rank[i] = counts[best]
        loads[best] += weights[i]
        counts[best] += 1
    return pack, rank


def _replicate(weights: list[float], num_phy: int) -> tuple[list[int], list[int], list[int]]:
    n = len(weights)
    phy2log = list(range(n))
    rank = [0] * n
    cnt = [1] * n
    for _ in range(num_phy - n):
        best = 0
        for e in range(1, n):
            if weights[e] / cnt[e] > weights[best] / cnt[best]:
                best = e
        phy2log.append(best)
        rank.append(cnt[best])
        cnt[best] += 1
    return phy2log, rank, cnt


def _layer(w: list[float], num_phy: int, groups: int, nodes: int, gpus: int) -> tuple[list[int], list[int]]:
    num_log = len(w)
    gsize = num_log // groups
    per_node_log = num_log // nodes
    per_node_phy = num_phy // nodes
    per_gpu = num_phy // gpus
    gpus_per_node = gpus // nodes
    gload = [sum(w[g * gsize : (g + 1) * gsize]) for g in range(groups)]
    gpack, grank = _pack(gload, nodes)
    node_experts: list[list[int]] = [[0] * per_node_log for _ in range(nodes)]
    for g in range(groups):
        for j in range(gsize):
            node_experts[gpack[g]][grank[g] * gsize + j] = g * gsize + j
    phy2log = [0] * num_phy
    for node in range(nodes):
        experts = node_experts[node]
        p2l, _, cnt = _replicate([w[e] for e in experts], per_node_phy)
        per_rep = [w[experts[m]] / cnt[m] for m in p2l]
        pack, rank = _pack(per_rep, gpus_per_node)
        for i, m in enumerate(p2l):
            phy2log[node * per_node_phy + pack[i] * per_gpu + rank[i]] = experts[m]
    cnt_all = [0] * num_log
    for e in phy2log:
        cnt_all[e] += 1
    return phy2log, cnt_all


def reference_rebalance(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray]:
    """(phy2log, logcnt) of the public greedy, one layer at a time."""
    if num_groups % num_nodes:
        num_groups = num_nodes = 1
    out = [_layer([float(x) for x in row], num_replicas, num_groups, num_nodes, num_gpus) for row in weight]
    return np.array([o[0] for o in out]), np.array([o[1] for o in out])


def gpu_balance(weight: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int) -> np.ndarray:
    """Per-layer max GPU load over mean GPU load, a replica carrying load / replica count (float64)."""
    per_rep = np.take_along_axis(weight / logcnt, phy2log, axis=1)
    loads = per_rep.reshape(weight.shape[0], num_gpus, -1).sum(axis=2)
    return loads.max(axis=1) / loads.mean(axis=1)
