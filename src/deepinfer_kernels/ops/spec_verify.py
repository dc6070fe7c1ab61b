"""Reference of ``spec_verify``: lossless speculative verification, batched over requests and positions.

Standard speculative sampling: draft k (sampled from the drafter's q_k) is accepted with probability
min(1, p_k(x) / q_k(x)) under the target's p_k; at the first rejection the emitted token is drawn from
the normalised residual max(0, p_k - q_k); when every verified draft is accepted, a bonus token is drawn
from the target at the next position. The emitted tokens are then distributed exactly as the target's
(the tests check this with a chi-square test). Rows marked greedy (temperature 0) accept a draft iff it
equals the target's argmax and emit the argmax at the first mismatch (or as the bonus).

Two sources of randomness. By default a ``torch.Generator`` (uniforms by ``torch.rand``, the residual by
``torch.multinomial``): fine for a reference, but no kernel can reproduce its stream. Given ``seeds`` and
``positions`` (counter mode) every random number is a pure function of (request seed, sequence position,
index), from ``ops.sampling.counter_uniform`` on two salted streams:

- the acceptance uniform of the draft at sequence position ``positions[i] + k`` is element 0 of the stream
  (seed ^ ACCEPT_SALT, positions[i] + k): the same token position always sees the same uniform, whatever
  the batch, the draft layout or the number of verified drafts;
- the correction / bonus token at position ``P = positions[i] + num_accepted[i]`` is a Gumbel race over the
  vocabulary: ``argmax_v log(w_v) + g_v`` with ``g_v = -log(-log(u_v))`` and ``u_v`` element v of the stream
  (seed ^ RESAMPLE_SALT, P); ``w`` is the residual ``max(0, p - q)`` after a rejection (unnormalised: the
  race is scale-invariant) and ``p`` for the bonus. Ties go to the lowest id (``argmax``), float32 scores
  as in the ``sample`` op. A batch-invariant kernel can match this bit for bit (``cuda/spec_verify.py``).
"""

from __future__ import annotations

import torch

from deepinfer_kernels.ops.sampling import counter_uniform
from deepinfer_kernels.registry import register

# Stream salts (XORed into the request seed) so acceptance, resampling and the ``sample`` op's own
# per-position stream never share uniforms.
ACCEPT_SALT = 0x5EC_ACC3
RESAMPLE_SALT = 0x5EC_5A3E


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
    *,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts; returns ``(num_accepted int64 [R], next_token int64 [R])``.

    ``draft_tokens`` int [R, D]; ``draft_probs`` float [R, D, V], the drafter's distribution each draft
    was sampled from (may be None when every row is greedy); ``target_probs`` float [R, D + 1, V], the
    target's distribution after each draft prefix (row D is the bonus position); ``verify_lengths`` int
    [R] in [0, D]; ``greedy`` bool or bool [R]: rows verified by exact match (temperature 0).
    ``next_token`` is the correction token after a rejection, else the bonus token; so a request emits
    its first ``num_accepted`` drafts followed by ``next_token``.

    Counter mode: ``seeds`` int [R] (the request's seed) and ``positions`` int [R] (sequence position of
    the first draft) replace ``generator`` (see the module docstring); both or neither.
    """
    R, D, V = _check(draft_tokens, draft_probs, target_probs, verify_lengths)
    counter = _check_counter(seeds, positions, R, generator)
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
        if counter:
            assert seeds is not None and positions is not None
            u = accept_uniforms(seeds.to(dev), positions.to(dev), D).to(torch.float64)
        else:
            u = torch.rand(R, D, generator=generator, device=dev, dtype=torch.float64)
        # u < p/q written without the division; strict, so a token the target gives 0 is never accepted.
        accept = torch.where(g[:, None], accept, u * q_tok < p_tok)
    accept = accept & valid
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)

    p_next = target_probs[rows, num_accepted].to(torch.float64)  # [R, V]
    next_token = p_next.argmax(dim=-1)
    if not all_greedy and counter:
        assert draft_probs is not None and seeds is not None and positions is not None
        sampled = _counter_resample(
            draft_probs, target_probs, rows, num_accepted, lengths, seeds.to(dev), positions.to(dev)
        )
        next_token = torch.where(g, next_token, sampled)
    elif not all_greedy:
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


def _check_counter(
    seeds: torch.Tensor | None, positions: torch.Tensor | None, R: int, generator: torch.Generator | None
) -> bool:
    if seeds is None and positions is None:
        return False
    if seeds is None or positions is None:
        raise ValueError("seeds / positions: counter mode needs both (int [requests]), or neither")
    if generator is not None:
        raise ValueError(
            "generator: not used in counter mode (seeds / positions given); pass one or the other"
        )
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.shape != (R,) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(
                f"{name}: must be an integer tensor of shape ({R},), got {t.dtype} {tuple(t.shape)}"
            )
    return True


def accept_uniforms(seeds: torch.Tensor, positions: torch.Tensor, D: int) -> torch.Tensor:
    """float32 [R, D]: the acceptance uniform of draft k is element 0 of stream (seed ^ ACCEPT_SALT, position + k)."""
    R = seeds.shape[0]
    s = (seeds.to(torch.int64) ^ ACCEPT_SALT)[:, None].expand(R, D).reshape(-1)
    pos = (positions.to(torch.int64)[:, None] + torch.arange(D, device=seeds.device)).reshape(-1)
    return counter_uniform(s, pos, 1).view(R, D)


def race_scores(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel-race scores ``log(w) + (-log(-log(u)))`` (w = 0 gives -inf: never drawn while any w > 0)."""
    return torch.log(weights.float()) + (-torch.log(-torch.log(u)))


def _counter_resample(
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    rows: torch.Tensor,
    num_accepted: torch.Tensor,
    lengths: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Correction (residual) or bonus (target) token per row by the counter-keyed Gumbel race."""
    D, V = draft_probs.shape[1], target_probs.shape[2]
    p = target_probs[rows, num_accepted].float()  # [R, V]
    rejected = num_accepted < lengths
    u = counter_uniform(seeds.to(torch.int64) ^ RESAMPLE_SALT, positions.to(torch.int64) + num_accepted, V)
    from_p = race_scores(p, u).argmax(dim=-1)
    if D == 0:
        return from_p
    q = draft_probs[rows, num_accepted.clamp(max=D - 1)].float()
    residual = (p - q).clamp_min(0.0)  # float32, exact subtraction order shared with the kernel
    from_res = race_scores(residual, u).argmax(dim=-1)
    # p == q (to rounding) leaves no residual; a rejection then has probability ~0: draw from p.
    use_res = rejected & (residual > 0).any(dim=-1)
    return torch.where(use_res, from_res, from_p)
