"""A drifting synthetic routing trace and an online EPLB simulator (window, periodic re-plan, moe_lb).

The trace generator (documented in docs/eplb.md) is a topic mixture, because what makes expert load
move in a serving system is *what* is being asked, not token-level noise alone:

- Static skew: per layer, a global expert popularity with logits ``-skew * log(rank)`` over a random
  permutation of the experts (Zipf).
- Topics: ``num_topics`` request kinds (code, chat, maths, languages, ...). Topic ``t`` routes with logits
  ``rho * global + sqrt(1 - rho^2) * own`` where ``own`` is another Zipf permutation, so topics agree on part
  of the popularity and differ on the rest.
- Drift: topic shares are ``softmax(z)`` with ``z`` an Ornstein-Uhlenbeck process (stationary sd
  ``drift_sd``, correlation time ``drift_steps``): the traffic mix wanders over ~30 minutes of wall clock,
  which is ~2,500 prefill steps but ~140,000 decode steps.
- A step: ``requests_per_step`` requests draw topics from the current shares (few long prompts per prefill
  step, thousands of short decode requests), each routes ``tokens_per_request * top_k`` assignments;
  per-expert counts are Poisson around that expectation (routing noise).
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import numpy as np

from deepinfer_core.eplb.migration import replan_with_migration
from deepinfer_core.eplb.stats import EPLBConfig, ExpertLoadWindow, ExpertPlacement, moe_lb_steps


@attrs.frozen(slots=True)
class TraceConfig:
    """Parameters of :class:`DriftingTrace` (see the module docstring for the model)."""

    num_layers: int = 8
    num_experts: int = 384
    top_k: int = 6
    requests_per_step: int = 3840
    tokens_per_request: int = 4
    skew: float = 0.8
    num_topics: int = 16
    rho: float = 0.7
    drift_sd: float = 1.0
    drift_steps: float = 5_000.0


# The traffic mix drifts in wall-clock time, so drift_steps = DRIFT_SECONDS / step time. Step times from the
# seeds' charts: decode at ~60 requests x 4 query tokens per rank ~13 ms; prefill at 65,536 tokens 731.7 ms.
DRIFT_SECONDS = 1_800.0
DECODE_STEP_SECONDS = 0.013
PREFILL_STEP_SECONDS = 0.7317
# Decode at EP64: 64 ranks x 60 requests, each verifying 1 + 3 tokens a step.
DECODE_TRACE = TraceConfig(
    requests_per_step=64 * 60, tokens_per_request=4, drift_steps=DRIFT_SECONDS / DECODE_STEP_SECONDS
)
# Prefill at EP4/DP4: 4 ranks x 2 prompts of 8,192 tokens a step (65,536 tokens).
PREFILL_TRACE = TraceConfig(
    requests_per_step=8, tokens_per_request=8_192, drift_steps=DRIFT_SECONDS / PREFILL_STEP_SECONDS
)


def _zipf_logits(rng: np.random.Generator, shape: tuple[int, ...], skew: float) -> np.ndarray:
    experts = shape[-1]
    base = -skew * np.log(np.arange(1, experts + 1))
    perm = np.argsort(rng.random(shape), axis=-1)
    return base[perm]


class DriftingTrace:
    """Per-step token counts [layers, experts] from the topic-mixture model; iterate or call :meth:`step`."""

    def __init__(self, config: TraceConfig, seed: int = 0) -> None:
        self.config = config
        self._rng = np.random.default_rng(seed)
        c = config
        glob = _zipf_logits(self._rng, (1, c.num_layers, c.num_experts), c.skew)
        own = _zipf_logits(self._rng, (c.num_topics, c.num_layers, c.num_experts), c.skew)
        logits = c.rho * glob + np.sqrt(1 - c.rho**2) * own
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        self._topic_p = (p / p.sum(axis=-1, keepdims=True)).reshape(c.num_topics, -1)  # [topics, L*E]
        self._z = self._rng.normal(0.0, c.drift_sd, c.num_topics)
        self._theta = 1.0 / c.drift_steps
        self._sigma = c.drift_sd * np.sqrt(2.0 * self._theta)

    def steps(self, n: int) -> np.ndarray:
        """Advance ``n`` steps and return their int64 token counts [n, layers, experts]."""
        c = self.config
        noise = self._rng.normal(size=(n, c.num_topics)) * self._sigma
        z = np.empty((n, c.num_topics))
        cur = self._z
        for i in range(n):  # the OU recursion is sequential, but only num_topics wide
            cur = cur - self._theta * cur + noise[i]
            z[i] = cur
        self._z = cur
        share = np.exp(z - z.max(axis=1, keepdims=True))
        share /= share.sum(axis=1, keepdims=True)
        per_topic = self._rng.multinomial(c.requests_per_step, share)  # [n, topics]
        expect = (per_topic * float(c.tokens_per_request * c.top_k)) @ self._topic_p
        return self._rng.poisson(expect).reshape(n, c.num_layers, c.num_experts)

    def step(self) -> np.ndarray:
        """Advance one step and return its token counts [layers, experts]."""
        return self.steps(1)[0]

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            yield self.step()


@attrs.frozen(slots=True, eq=False)
class SimulationResult:
    """Per-step moe_lb (from the first plan on) for three placements, and per-re-plan migration figures."""

    steps: np.ndarray  # step index of each measured step
    moe_lb_scratch: np.ndarray  # re-planned from scratch each interval
    moe_lb_migration: np.ndarray  # re-planned migration-aware each interval
    moe_lb_plain: np.ndarray  # no redundancy, experts in id order (E / G per GPU)
    replan_steps: list[int]
    moved_bytes_scratch: list[int]
    moved_bytes_migration: list[int]
    balance_scratch: list[float]  # in-sample mean over layers, on the window the plan was made from
    balance_migration: list[float]
    window_loads: list[np.ndarray]  # the window's load [layers, experts] at the first plan and each re-plan


def simulate(
    trace: DriftingTrace,
    config: EPLBConfig,
    num_gpus: int,
    num_steps: int,
    *,
    expert_bytes: int = 0,
    tolerance: float = 0.01,
    chunk: int = 500,
    progress: bool = False,
) -> SimulationResult:
    """Run ``num_steps`` steps: record each into the window, plan once it first fills, re-plan every
    ``config.replan_interval`` steps after that, and score every step with the placement then in force.

    Steps are generated and scored ``chunk`` at a time (never across a re-plan), vectorised over steps.
    """
    tc = trace.config
    reps = config.num_replicas(tc.num_experts, num_gpus)
    window = ExpertLoadWindow(tc.num_layers, tc.num_experts, config.window_steps)
    plain_tab = np.broadcast_to(np.arange(tc.num_experts), (tc.num_layers, tc.num_experts))
    plain = ExpertPlacement.from_phy2log(plain_tab, tc.num_experts, num_gpus)
    scratch: ExpertPlacement | None = None
    mig: ExpertPlacement | None = None
    steps, lb_s, lb_m, lb_p = [], [], [], []
    rs, mb_s, mb_m, bal_s, bal_m, loads = [], [], [], [], [], []
    first = config.window_steps
    events = list(range(first, num_steps + 1, config.replan_interval))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_steps, desc="eplb simulate", unit="step", mininterval=2.0)
    done = 0
    while done < num_steps:
        nxt = next((e for e in events if e > done), num_steps)
        n = min(chunk, nxt - done, num_steps - done)
        counts = trace.steps(n)
        if scratch is not None and mig is not None:
            steps.append(np.arange(done, done + n))
            lb_s.append(moe_lb_steps(counts, scratch))
            lb_m.append(moe_lb_steps(counts, mig))
            lb_p.append(moe_lb_steps(counts, plain))
        window.record_many(counts)
        done += n
        if bar is not None:
            bar.update(n)
        if done != nxt or done not in events:
            continue
        load = window.load()
        loads.append(load)
        if scratch is None or mig is None:
            scratch = mig = ExpertPlacement.plan(load, reps, 1, 1, num_gpus)
            continue
        plan = replan_with_migration(mig, load, tolerance=tolerance, expert_bytes=expert_bytes)
        # The from-scratch baseline re-plans its own previous placement.
        base = replan_with_migration(scratch, load, tolerance=tolerance, expert_bytes=expert_bytes)
        rs.append(done)
        mb_s.append(base.scratch_moves.moved_bytes)
        mb_m.append(plan.moves.moved_bytes)
        bal_s.append(float(base.scratch_balance.mean()))
        bal_m.append(float(plan.balance.mean()))
        scratch, mig = base.scratch, plan.placement
    if bar is not None:
        bar.close()
    return SimulationResult(
        _cat(steps), _cat(lb_s), _cat(lb_m), _cat(lb_p), rs, mb_s, mb_m, bal_s, bal_m, loads
    )


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0)
