"""Balancers benchmark: the cluster simulator on the documented traces, against perfectly balanced bounds.

1. Cost models: step times drawn from the documented reference engines (3% noise), fitted by
   ``scheduler.CostModel.fit``; the simulator's engines and the balancers then use the fitted models.
2. Prefill: 16 engines (4 in --quick), traces steady / shifting / bursty at 70% and 90% of capacity;
   round robin, one least-work pool, the tiered balancer; efficiency = bound / makespan, TTFT per tier.
   Then capacity under a TTFT SLO: the largest load (share of the perfectly balanced capacity, by
   bisection) at which every tier's p99 TTFT meets its target (SLO_S), 8 engines, 600 s traces.
3. Decode: one lockstep group of 32 ranks (8), 64 slots each, ~75% busy; five placement policies;
   efficiency = sum(mean step) / sum(max step), with and without the per-step base. Then a drain with a
   60 s grace (forwarding) and a drain refused above 0.8 utilisation.
4. KV store hit rate against TTL (both classes, and the 3 d / 7 d default) and against capacity, by
   replaying documented sessions through InMemoryKVStore.

Usage: python benchmarks/balancers.py [--quick] [--plot]   (--plot writes docs/img/balancers_*.png)
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from _common import emit, log, parser
from deepinfer_core.balancers import (
    DecodeBalancer,
    LeastKVDecode,
    LeastRequestsDecode,
    LeastStepTimeDecode,
    LeastWorkPrefill,
    PrefillBalancer,
    RoundRobinDecode,
    RoundRobinPrefill,
    ScaleInRefused,
    decode_trace,
    prefill_request_ns,
    prefill_trace,
    simulate_decode,
    simulate_prefill,
)
from deepinfer_core.balancers.hitrate import DAY, replay_hit_rate, session_trace
from deepinfer_core.kvstore import InMemoryKVStore, TTLPolicy
from deepinfer_core.scheduler import CostModel

BENCH = "balancers"
IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
# Documented reference engines (docs/balancers.md): a prefill instance and one decode rank.
PREFILL_TRUE = CostModel(base_ns=5e6, token_ns=8000.0, quad_ns=0.05, ctx_ns=0.05)
DECODE_TRUE = CostModel(base_ns=10e6, token_ns=8e4, quad_ns=0.0, ctx_ns=1.6)
# TTFT p99 targets per tier (<16K, 16-64K, 64-256K, >=256K), seconds: a few times each tier's own
# prefill time on the reference instance (a chosen SLO, not DeepSeek's)
SLO_S = (2.0, 5.0, 15.0, 60.0)


def _store(ttl: TTLPolicy, capacity_blocks: int | None = None):
    """The hit-rate replay's store for its clock: in memory, one byte per block (capacity in blocks)."""
    return lambda clock: InMemoryKVStore(ttl, capacity_bytes=capacity_blocks, clock=clock)


def fit(true: CostModel, q: np.ndarray, c: np.ndarray, rng: np.random.Generator, name: str) -> CostModel:
    ns = np.array([true.predict(int(a), int(b)) for a, b in zip(q, c)]) * (
        1 + 0.03 * rng.standard_normal(q.size)
    )
    m = CostModel.fit(q, c, ns)
    err = float(np.median(np.abs(np.array([m.predict(int(a), int(b)) for a, b in zip(q, c)]) / ns - 1)))
    emit(BENCH, {"engine": name, "samples": int(q.size)}, "fit_median_rel_err", err, "ratio")
    for k, v in zip(("base_ns", "token_ns", "quad_ns", "ctx_ns"), m.as_tuple()):
        emit(BENCH, {"engine": name}, f"fitted_{k}", v, "ns")
    return m


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    args = ap.parse_args()
    quick = args.quick
    rng = np.random.default_rng(0)
    qp = rng.integers(256, 32769, 400)
    pc = fit(PREFILL_TRUE, qp, rng.integers(0, 512 * 1024, 400), rng, "prefill")
    # a decode profile: B requests at mean context c take base + token*B + ctx*B*c, the cost model at
    # q = B, c (its q^2 term is ~0 there: each request's chunk is one token), so the same fit applies
    qd = rng.integers(1, 65, 400)
    dc = fit(DECODE_TRUE, qd, rng.integers(0, 131072, 400), rng, "decode")

    # ---- prefill
    n_pre = 4 if quick else 16
    dur = 120.0 if quick else 900.0
    probe = prefill_trace(600, 10, seed=1)
    mean_s = (
        float(
            np.mean(
                [prefill_request_ns(pc, t - c, c) for t, c in zip(probe.total_tokens, probe.cached_tokens)]
            )
        )
        * 1e-9
    )
    emit(BENCH, {"trace": "mix"}, "prefill_mean_request_s", mean_s, "s")
    pre_rows = []
    cases = [(shape, rho) for rho in (0.7, 0.9) for shape in ("steady", "shifting", "bursty")]
    for shape, rho in tqdm(cases, desc="prefill", disable=quick):
        tr = prefill_trace(dur, rho * n_pre / mean_s, shape=shape, seed=2)
        for bal in (RoundRobinPrefill(n_pre, pc), LeastWorkPrefill(n_pre, pc), PrefillBalancer(n_pre, pc)):
            t0 = time.perf_counter()
            res = simulate_prefill(tr, bal, pc, num_engines=n_pre, round_s=10.0)
            p = {"trace": shape, "load": rho, "engines": n_pre, "policy": res.policy, "requests": len(tr)}
            emit(BENCH, p, "prefill_efficiency", res.efficiency, "ratio")
            for t in range(4):
                emit(BENCH, {**p, "tier": t}, "ttft_p99", res.ttft_quantile(0.99, t), "s")
            emit(BENCH, p, "ttft_p50", res.ttft_quantile(0.5), "s")
            emit(BENCH, p, "sim_wall", time.perf_counter() - t0, "s")
            pre_rows.append(
                (shape, rho, res.policy, res.efficiency, [res.ttft_quantile(0.99, t) for t in range(4)])
            )

    # ---- prefill capacity under a TTFT SLO: the largest load every tier's p99 meets, by bisection
    slo_rows = []
    n_slo = 4 if quick else 8
    sdur = 120.0 if quick else 600.0
    for shape in tqdm(("steady", "shifting", "bursty"), desc="prefill slo", disable=quick):
        for make in (
            lambda: RoundRobinPrefill(n_slo, pc),
            lambda: LeastWorkPrefill(n_slo, pc),
            lambda: PrefillBalancer(n_slo, pc),
        ):
            lo, hi = 0.2, 1.0
            name = make().name
            for _ in range(3 if quick else 6):
                mid = (lo + hi) / 2
                tr = prefill_trace(sdur, mid * n_slo / mean_s, shape=shape, seed=7)
                res = simulate_prefill(tr, make(), pc, num_engines=n_slo, round_s=10.0)
                ok = all(not (res.ttft_quantile(0.99, t) > SLO_S[t]) for t in range(4))  # NaN: tier unused
                lo, hi = (mid, hi) if ok else (lo, mid)
            p = {"trace": shape, "engines": n_slo, "policy": name, "slo_s": list(SLO_S), "duration_s": sdur}
            emit(BENCH, p, "prefill_load_under_slo", lo, "share of capacity")
            slo_rows.append((shape, name, lo))

    # ---- decode
    m = 8 if quick else 32
    slots, kvcap = 64, 6 * 1024 * 1024
    ddur = 60.0 if quick else 300.0
    rate = m * 0.75 * slots / (750 * 0.015)
    tr = decode_trace(ddur, rate, seed=3)
    dec_rows = []
    for cls in tqdm(
        (RoundRobinDecode, LeastRequestsDecode, LeastKVDecode, LeastStepTimeDecode, DecodeBalancer),
        desc="decode",
        disable=quick,
    ):
        bal = cls(m, dc, max_running=slots, kv_capacity=kvcap)
        t0 = time.perf_counter()
        r = simulate_decode(tr, bal, dc)
        p = {"ranks": m, "slots": slots, "policy": r.policy, "requests": len(tr)}
        emit(BENCH, p, "decode_efficiency", r.efficiency, "ratio")
        emit(BENCH, p, "decode_variable_efficiency", r.variable_efficiency, "ratio")
        emit(BENCH, p, "decode_tokens_per_s", r.tokens / r.time_s, "tok/s")
        emit(BENCH, p, "sim_wall", time.perf_counter() - t0, "s")
        dec_rows.append((r.policy, r.efficiency, r.variable_efficiency))
    for grace in (60.0, 5.0):  # the Q&A's minute, and a short one so that requests are left to forward
        bal = DecodeBalancer(m, dc, max_running=slots, kv_capacity=kvcap, grace_s=grace)
        r = simulate_decode(tr, bal, dc, drain=(ddur / 4, 0))
        p = {"ranks": m, "grace_s": grace, "drain_at_s": ddur / 4}
        emit(BENCH, p, "drain_forwarded", r.forwarded, "requests")
        emit(BENCH, p, "drain_finished_of", r.finished / len(tr), "ratio")
        emit(BENCH, p, "drain_tokens_of", r.tokens / int(tr.output_tokens.sum()), "ratio")
        emit(BENCH, p, "drain_efficiency", r.efficiency, "ratio")
    busy = DecodeBalancer(m, dc, max_running=slots, kv_capacity=kvcap)
    busy.report(np.full(m, int(0.85 * slots)), np.zeros(m, np.int64))
    try:
        busy.drain(0, 0.0)
        refused = 0
    except ScaleInRefused:
        refused = 1
    emit(BENCH, {"utilisation": 0.85}, "scale_in_refused", refused, "bool")

    # ---- hit rate vs TTL and capacity
    sess = session_trace(600 if quick else 6000, 21 * DAY, seed=0)
    days = [0.25, 1, 3, 7] if quick else [0.125, 0.25, 0.5, 1, 2, 3, 5, 7, 10, 14]
    ttl_rows = []
    for d in tqdm(days, desc="ttl", disable=quick):
        h = replay_hit_rate(sess, _store(TTLPolicy({"agent": d * DAY, "chatbot": d * DAY})))
        for cls in ("agent", "chatbot", "overall"):
            emit(BENCH, {"ttl_days": d, "class": cls}, "hit_rate", getattr(h, cls), "ratio")
        ttl_rows.append((d, h))
    default = replay_hit_rate(sess, _store(TTLPolicy()))
    for cls in ("agent", "chatbot", "overall"):
        emit(
            BENCH,
            {"ttl": "agent 3 d / chatbot 7 d", "class": cls},
            "hit_rate",
            getattr(default, cls),
            "ratio",
        )
    h3 = dict(ttl_rows)[3]
    h7 = dict(ttl_rows)[7]
    emit(BENCH, {"class": "chatbot"}, "hit_rate_loss_3d_vs_7d", h7.chatbot - h3.chatbot, "ratio")
    emit(BENCH, {"class": "agent"}, "hit_rate_loss_3d_vs_7d", h7.agent - h3.agent, "ratio")
    # capacity as a share of the distinct blocks the trace ever writes (each session's last context)
    last = {}
    for s_id, ctx in zip(sess.session.tolist(), sess.context.tolist()):
        last[s_id] = max(last.get(s_id, 0), ctx // 1024)
    distinct = int(sum(last.values()))
    emit(BENCH, {"sessions": len(last)}, "distinct_blocks", distinct, "blocks")
    cap_rows = []
    for frac in [0.002, 0.05] if quick else [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3]:
        h = replay_hit_rate(sess, _store(TTLPolicy(), max(1, int(frac * distinct))))
        emit(BENCH, {"capacity_of_footprint": frac}, "hit_rate", h.overall, "ratio")
        cap_rows.append((frac, h))
    log(f"prefill rows {len(pre_rows)}, decode rows {len(dec_rows)}")
    if args.plot:
        plot(pre_rows, dec_rows, ttl_rows, cap_rows, default)


def plot(pre_rows, dec_rows, ttl_rows, cap_rows, default) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    pols = ["round_robin", "least_work", "tiers"]
    labels = [f"{s}\n{int(r * 100)}%" for s, r in dict.fromkeys((s, r) for s, r, *_ in pre_rows)]
    x = np.arange(len(labels))
    for i, pol in enumerate(pols):
        eff = [e for s, r, p, e, _ in pre_rows if p == pol]
        axes[0].bar(x + (i - 1) * 0.27, eff, 0.27, label=pol)
        p99 = [tt[0] for s, r, p, e, tt in pre_rows if p == pol]
        axes[1].bar(x + (i - 1) * 0.27, p99, 0.27, label=pol)
    axes[0].axhline(0.85, color="k", ls="--", lw=1)
    axes[0].set_ylim(0.5, 1.01)
    axes[0].set_title("prefill: bound / makespan")
    axes[1].set_yscale("log")
    axes[1].set_title("prefill: TTFT p99 of <16K requests (s)")
    for a in axes[:2]:
        a.set_xticks(x, labels, fontsize=8)
        a.legend(fontsize=8)
    names = [p for p, *_ in dec_rows]
    axes[2].bar(np.arange(len(names)) - 0.2, [e for _, e, _ in dec_rows], 0.4, label="step time")
    axes[2].bar(np.arange(len(names)) + 0.2, [v for *_, v in dec_rows], 0.4, label="variable part")
    axes[2].axhline(0.85, color="k", ls="--", lw=1)
    axes[2].set_xticks(np.arange(len(names)), names, fontsize=7, rotation=15)
    axes[2].set_ylim(0.5, 1.01)
    axes[2].set_title("decode (lockstep): mean / max")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMG / "balancers_efficiency.png", dpi=80)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    d = [r[0] for r in ttl_rows]
    for cls in ("agent", "chatbot", "overall"):
        axes[0].plot(d, [getattr(h, cls) for _, h in ttl_rows], marker="o", label=cls)
    for v in (3, 7):
        axes[0].axvline(v, color="gray", ls=":", lw=1)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("TTL (days)")
    axes[0].set_ylabel("token hit rate")
    axes[0].set_title(f"hit rate vs TTL (default 3 d / 7 d: {default.overall:.3f} overall)")
    axes[0].legend()
    axes[1].plot([f for f, _ in cap_rows], [h.overall for _, h in cap_rows], marker="o")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("store capacity / distinct KV blocks written")
    axes[1].set_title("hit rate vs capacity (TTL 3 d / 7 d, LRU)")
    fig.tight_layout()
    fig.savefig(IMG / "kvstore_hit_rate.png", dpi=80)
    log(f"wrote {IMG / 'balancers_efficiency.png'} and {IMG / 'kvstore_hit_rate.png'}")


if __name__ == "__main__":
    main()
