"""Device side of DSpark verification: lossless acceptance and the asynchronous-mode redistribution.

Both dispatch through ``deepinfer_kernels.get_op`` (torch reference everywhere; a cuda kernel where one is
registered). torch is imported on first call, so the CPU planners in this package never pull it in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch

__all__ = ["VerifyResult", "redistribute", "verify"]


@attrs.frozen(eq=False)
class VerifyResult:
    """Outcome of one verify step, per request.

    ``num_accepted[i]`` drafts were accepted, then ``next_token[i]`` (correction or bonus) was emitted,
    so request i emits ``num_accepted[i] + 1`` tokens: ``output_tokens[i, :num_emitted[i]]`` (-1 after).
    """

    num_accepted: torch.Tensor
    next_token: torch.Tensor
    output_tokens: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    verify_lengths: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    greedy: bool | torch.Tensor = False,
    backend: str = "reference",
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> VerifyResult:
    """Standard speculative sampling over a batch (see ``deepinfer_kernels.ops.spec_verify``).

    Lossless: emitted tokens follow ``target_probs`` exactly. ``greedy`` marks temperature-0 rows
    (exact match against the target's argmax). Returns accepted counts, the bonus/correction token and
    the emitted tokens laid out as [R, D + 1] padded with -1.

    Counter mode: ``seeds`` / ``positions`` (int [R]: request seed, sequence position of the first draft)
    instead of ``generator`` make every random number a function of (seed, position): batch-invariant and
    reproducible by the cuda kernel (``backend="cuda"``).
    """
    import torch

    from deepinfer_kernels import get_op

    num_accepted, next_token = get_op("spec_verify", backend)(
        draft_tokens,
        draft_probs,
        target_probs,
        verify_lengths,
        generator,
        greedy,
        seeds=seeds,
        positions=positions,
    )
    R, D = draft_tokens.shape
    dev = num_accepted.device
    out = torch.full((R, D + 1), -1, dtype=torch.int64, device=dev)
    keep = torch.arange(D, device=dev)[None, :] < num_accepted[:, None]
    out[:, :D] = torch.where(keep, draft_tokens.to(dev, torch.int64), out[:, :D])
    out[torch.arange(R, device=dev), num_accepted] = next_token
    return VerifyResult(num_accepted, next_token, out)


def redistribute(
    total: int | torch.Tensor,
    confidences: torch.Tensor,
    num_drafts: torch.Tensor | None = None,
    *,
    backend: str = "reference",
) -> torch.Tensor:
    """Asynchronous MTPVarlen: reassign a CPU-fixed ``total`` of drafts from the freshest confidences.

    Equal to ``MTPVarlen.plan_total(confidences, total).lengths`` on the same inputs (int32 [R]).
    """
    from deepinfer_kernels import get_op

    return get_op("mtp_redistribute", backend)(total, confidences, num_drafts)
