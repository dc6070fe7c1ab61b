"""A step-level simulator of verify policies under a documented acceptance model.

Acceptance model (``AcceptanceModel``):

- Each step, the drafter reports a confidence a_ik for each of request i's drafts, drawn from
  Beta(kappa * mu, kappa * (1 - mu)) with mean ``mu`` (0.75 by default). ``per_request=False``: drawn
  independently per draft, so confidence varies across requests and positions; ``per_request=True``:
  one draw per request, shared by its drafts (a request is easy or hard throughout).
- Confidences are calibrated: given drafts 1..k-1 accepted, draft k is accepted with probability a_ik
  (``logit_noise`` > 0 makes the reported confidence a noisy copy, in logit space, of the true one).
- With independent draws, E[a_i1 * ... * a_ik] = mu^k, so verifying all five drafts emits on average
  1 + 0.75 + ... + 0.75^5 = 3.29 tokens per request and step: the Q&A's fixed-five accepted length.

Accounting: a request emits its accepted drafts (the leading run of accepted ones among those
verified) plus one bonus/correction token. Never 1 + drafts ("full-acceptance accounting").
"""

from __future__ import annotations

import attrs
import numpy as np

from deepinfer_core.spec.policies import FixedLength, MTPVarlen, NoSpec
from deepinfer_core.spec.profile import StepTimeProfile

__all__ = ["AcceptanceModel", "PolicyStats", "simulate"]


@attrs.frozen
class AcceptanceModel:
    """Distribution of per-draft acceptance probabilities (see the module docstring)."""

    mean: float = 0.75
    concentration: float = 4.0
    num_drafts: int = 5
    per_request: bool = False
    logit_noise: float = 0.0

    def __attrs_post_init__(self) -> None:
        if not 0.0 < self.mean < 1.0:
            raise ValueError(f"mean={self.mean}: must be in (0, 1)")
        if not self.concentration > 0:
            raise ValueError(f"concentration={self.concentration}: must be > 0")
        if self.num_drafts < 1:
            raise ValueError(f"num_drafts={self.num_drafts}: must be >= 1")
        if self.logit_noise < 0:
            raise ValueError(f"logit_noise={self.logit_noise}: must be >= 0")

    def draw(self, rng: np.random.Generator, requests: int) -> tuple[np.ndarray, np.ndarray]:
        """(true acceptance probabilities, reported confidences), both float64 [requests, num_drafts]."""
        a, b = self.concentration * self.mean, self.concentration * (1.0 - self.mean)
        if self.per_request:
            true = np.repeat(rng.beta(a, b, size=(requests, 1)), self.num_drafts, axis=1)
        else:
            true = rng.beta(a, b, size=(requests, self.num_drafts))
        if self.logit_noise == 0.0:
            return true, true
        eps = 1e-9
        t = np.clip(true, eps, 1 - eps)
        z = np.log(t / (1 - t)) + rng.normal(0.0, self.logit_noise, size=t.shape)
        return true, 1.0 / (1.0 + np.exp(-z))


@attrs.frozen
class PolicyStats:
    """Totals of one policy over the simulated steps at one load."""

    requests: int
    steps: int
    drafts_verified: int
    tokens_emitted: int
    time_ms: float
    full_acceptance_tokens: int  # what 1 + verified drafts per request would have claimed

    @property
    def drafts_per_request(self) -> float:
        return self.drafts_verified / (self.requests * self.steps)

    @property
    def accepted_length(self) -> float:
        """Tokens emitted per request per step (accepted drafts + 1)."""
        return self.tokens_emitted / (self.requests * self.steps)

    @property
    def tokens_per_s(self) -> float:
        """Emitted tokens per second per rank."""
        return 1000.0 * self.tokens_emitted / self.time_ms


Policy = MTPVarlen | FixedLength | NoSpec


def simulate(
    policies: dict[str, Policy],
    requests: int,
    steps: int,
    model: AcceptanceModel | None = None,
    profile: StepTimeProfile | None = None,
    rng: np.random.Generator | None = None,
) -> dict[str, PolicyStats]:
    """Run ``steps`` decode steps of ``requests`` requests per rank under every policy.

    All policies see the same confidences and the same acceptance outcomes each step (common random
    numbers), so their differences are not sampling noise. Step time comes from ``profile`` (default:
    the published curve) at the step's query tokens.
    """
    if requests < 1 or steps < 1:
        raise ValueError(f"requests={requests}, steps={steps}: both must be >= 1")
    model = model or AcceptanceModel()
    prof = profile or StepTimeProfile.published()
    rng = rng or np.random.default_rng()
    acc = {k: [0, 0, 0.0, 0] for k in policies}
    for _ in range(steps):
        true, reported = model.draw(rng, requests)
        # ok[i, k]: drafts 1..k+1 of request i would all be accepted if verified.
        ok = np.cumprod(rng.random(true.shape) < true, axis=1).astype(bool)
        for name, pol in policies.items():
            lengths = pol.plan(reported).lengths
            verified = np.arange(model.num_drafts)[None, :] < lengths[:, None]
            accepted = int((ok & verified).sum())
            t = acc[name]
            t[0] += int(lengths.sum())
            t[1] += accepted + requests
            t[2] += prof.step_ms(requests + int(lengths.sum()))
            t[3] += requests + int(lengths.sum())
    return {
        k: PolicyStats(requests, steps, int(v[0]), int(v[1]), float(v[2]), int(v[3])) for k, v in acc.items()
    }
