"""Reference of ``spec_verify``: lossless speculative verification, batched over requests and positions.

Standard speculative sampling: draft k (sampled from the drafter's q_k) is accepted with probability
min(1, p_k(x) / q_k(x)) under the target's p_k; at the first rejection the emitted token is drawn from
the normalised residual max(0, p_k - q_k); when every verified draft is accepted, a bonus token is drawn
from the target at the next position. The emitted tokens are then distributed exactly as the target's
(the tests check this with a chi-square test). Rows marked greedy (temperature 0) accept a draft iff it
equals the target's argmax and emit the argmax at the first mismatch (or as the bonus).
"""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register


def _check(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    verify_lengths: torch.Tensor,
) -> tuple[int, int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens: must be [requests, drafts], got shape {tuple(draft_tokens.shape)}")
    R, D = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (R, D + 1):
        raise ValueError(
            f"target_probs: must be [requests, drafts + 1, vocab] = [{R}, {D + 1}, V], got {tuple(target_probs.shape)}"
        )
    V = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (R, D, V):
        raise ValueError(
            f"draft_probs: must be [requests, drafts, vocab] = [{R}, {D}, {V}], got {tuple(draft_probs.shape)}"
        )
    if verify_lengths.shape != (R,):
        raise ValueError(f"verify_lengths: must have shape ({R},), got {tuple(verify_lengths.shape)}")
    # Value checks synchronise with the device; acceptable in the reference, which is the ground truth.
    if R and ((verify_lengths < 0) | (verify_lengths > D)).any():
        i = int(((verify_lengths < 0) | (verify_lengths > D)).nonzero()[0, 0])
        raise ValueError(f"verify_lengths[{i}]={int(verify_lengths[i])}: must be in [0, {D}]")
    pos = torch.arange(D, device=draft_tokens.device)
    used = pos[None, :] < verify_lengths[:, None].to(draft_tokens.device)
    bad = used & ((draft_tokens < 0) | (draft_tokens >= V))
    if bad.any():
        i, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"draft_tokens[{i}, {k}]={int(draft_tokens[i, k])}: must be a token id in [0, {V})")
    return R, D, V


@register("spec_verify")
def spec_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    verify_lengths: torch.Tensor,
    generator: torch.Generator | None = None,
    greedy: bool | torch.Tensor = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts; returns ``(num_accepted int64 [R], next_token int64 [R])``.

    ``draft_tokens`` int [R, D]; ``draft_probs`` float [R, D, V], the drafter's distribution each draft
    was sampled from (may be None when every row is greedy); ``target_probs`` float [R, D + 1, V], the
    target's distribution after each draft prefix (row D is the bonus position); ``verify_lengths`` int
    [R] in [0, D]; ``greedy`` bool or bool [R]: rows verified by exact match (temperature 0).
    ``next_token`` is the correction token after a rejection, else the bonus token; so a request emits
    its first ``num_accepted`` drafts followed by ``next_token``.
    """
    R, D, V = _check(draft_tokens, draft_probs, target_probs, verify_lengths)
    dev = target_probs.device
    g = torch.as_tensor(greedy, dtype=torch.bool, device=dev).expand(R)
    all_greedy = bool(g.all()) if R else True
    if draft_probs is None and not all_greedy:
        raise ValueError("draft_probs: required unless every row is greedy (temperature 0)")
    lengths = verify_lengths.to(device=dev, dtype=torch.int64)
    rows = torch.arange(R, device=dev)
    tok = draft_tokens.to(dev, torch.int64).clamp(0, V - 1)  # padding beyond a row's length is never used
    valid = torch.arange(D, device=dev)[None, :] < lengths[:, None]

    p_pos = target_probs[:, :D]
    accept = tok == p_pos.argmax(dim=-1)
    if not all_greedy:
        assert draft_probs is not None
        p_tok = p_pos.gather(2, tok[..., None]).squeeze(-1).to(torch.float64)
        q_tok = draft_probs.gather(2, tok[..., None]).squeeze(-1).to(torch.float64)
        u = torch.rand(R, D, generator=generator, device=dev, dtype=torch.float64)
        # u < p/q written without the division; strict, so a token the target gives 0 is never accepted.
        accept = torch.where(g[:, None], accept, u * q_tok < p_tok)
    accept = accept & valid
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)

    p_next = target_probs[rows, num_accepted].to(torch.float64)  # [R, V]
    next_token = p_next.argmax(dim=-1)
    if not all_greedy:
        assert draft_probs is not None
        rejected = num_accepted < lengths
        q_next = draft_probs[rows, num_accepted.clamp(max=max(D - 1, 0))].to(torch.float64) if D else p_next
        residual = (p_next - q_next).clamp_min(0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # p == q (to rounding) leaves no residual; a rejection then has probability ~0, fall back to p.
        use_res = rejected[:, None] & (mass > 0)
        dist = torch.where(use_res, residual / mass.clamp_min(torch.finfo(torch.float64).tiny), p_next)
        sampled = torch.multinomial(dist, 1, generator=generator).squeeze(1)
        next_token = torch.where(g, next_token, sampled)
    return num_accepted, next_token
