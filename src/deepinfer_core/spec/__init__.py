"""DSpark verification: how many drafts to verify (MTPVarlen), and verifying them losslessly.

- :class:`StepTimeProfile`: step time over query tokens per rank (the published decode curve, or fitted).
- :class:`MTPVarlen`, :class:`FixedLength`, :class:`NoSpec`: ``VerifyScheduler`` policies returning a
  :class:`VerifyPlan`; the greedy runs in C++ (``deepinfer_core._C.spec``).
- :func:`redistribute`: the asynchronous-mode device op (same answer as ``MTPVarlen.plan_total``).
- :func:`verify`: batched, lossless speculative sampling; greedy exact match at temperature 0.

Usable on its own by any engine whose drafter reports a per-draft confidence.
"""

from deepinfer_core.spec.policies import FixedLength, MTPVarlen, NoSpec, VerifyPlan, make_policy
from deepinfer_core.spec.profile import PUBLISHED_DECODE_CURVE, StepTimeProfile
from deepinfer_core.spec.verify import VerifyResult, redistribute, verify

__all__ = [
    "PUBLISHED_DECODE_CURVE",
    "FixedLength",
    "MTPVarlen",
    "NoSpec",
    "StepTimeProfile",
    "VerifyPlan",
    "VerifyResult",
    "make_policy",
    "redistribute",
    "verify",
]
