"""Seams of speculative verification (``deepinfer_core.spec``)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class VerifyScheduler(Protocol):
    """Chooses how many drafts of each request to verify this step (MTPVarlen, fixed-length, off)."""

    def plan(self, acceptance: np.ndarray, num_drafts: np.ndarray | None = None) -> Any:
        """Plan one verify step.

        ``acceptance`` is float [requests, max_drafts]: the drafter's per-draft acceptance probabilities;
        ``num_drafts`` (int, optional) how many of each row are real drafts. Returns a plan with
        per-request verify lengths (a prefix of each request's drafts), total query tokens, expected
        accepted tokens and expected tokens per ms.
        """
        ...
