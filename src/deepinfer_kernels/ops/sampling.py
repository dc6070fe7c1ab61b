"""Sampling with a counter-based per-request RNG: temperature, top-k, top-p; batch-invariant by construction.

Every random number is a pure function of (request seed, position, token id): a splitmix64-style hash,
turned into a uniform in (0, 1) and then a Gumbel variate. A token is drawn as the argmax of
``logits / T + gumbel`` over the tokens that survive top-k and top-p (the Gumbel-max trick samples exactly
from the softmax of the surviving logits). Nothing depends on the other rows of the batch, on launch
order or on a shared generator state, so a request gets the same token whatever batch it is in, and the
CUDA kernel can reproduce it bit for bit with 64-bit integer arithmetic.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register

# splitmix64 constants, written as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_POS_MUL = -3335678366873096957  # 0xD1B54A32D192ED03, an odd constant decorrelating position from token id


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors, wrapping arithmetic."""
    x = x + _GOLDEN
    x = (x ^ _lsr(x, 30)) * _M1
    x = (x ^ _lsr(x, 27)) * _M2
    return x ^ _lsr(x, 31)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, num: int) -> torch.Tensor:
    """float32 uniforms in (0, 1), shape [B, num]: element (b, j) depends only on (seeds[b], positions[b], j)."""
    seeds = seeds.to(torch.int64)
    positions = positions.to(torch.int64)
    key = mix64(seeds) ^ (positions * _POS_MUL)  # one key per (request, position)
    j = torch.arange(num, device=seeds.device, dtype=torch.int64)
    h = mix64(key[:, None] ^ mix64(j)[None, :])
    # Top 24 bits -> a float32 exactly representable; +0.5 keeps it strictly inside (0, 1).
    return (_lsr(h, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _check(logits: torch.Tensor, **rows: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [batch, vocab], got shape {tuple(logits.shape)}")
    for name, t in rows.items():
        if t.shape != (logits.shape[0],):
            raise ValueError(f"{name}: expected shape ({logits.shape[0]},), got {tuple(t.shape)}")


def survivors(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens that top-k and top-p leave, as a prefix of each row's stable descending sort.

    Returns ``(greedy, t, vals, idx, keep)``: greedy rows, the temperature used per row (1 for greedy rows),
    the sorted scaled logits and their token ids, and the survivor mask over sorted positions. Shared by
    the reference sampler and the CUDA kernel's threshold, so both filter by the same float operations.
    """
    v = logits.shape[1]
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    x = logits.float() / t[:, None]
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=x.device)[None, :]
    k = torch.where(top_k >= 1, top_k, torch.full_like(top_k, v)).clamp(max=v)
    keep = rank < k[:, None]
    probs = torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    before = torch.cumsum(probs, dim=-1) - probs
    keep &= before < top_p.float()[:, None]
    keep[:, 0] = True
    keep &= torch.isfinite(vals)
    return greedy, t, vals, idx, keep


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``sample`` of rows that are all greedy, without its sort and random numbers: the argmax (lowest id
    on ties), -1 where the row's largest value is not finite (no finite logit, or a NaN / +inf, which the
    sort puts first). The caller decides that every row is greedy (host-side temperatures)."""
    mx, am = logits.float().max(dim=-1)  # NaN propagates to mx (and its index), as in the sort
    return torch.where(torch.isfinite(mx), am, torch.full_like(am, -1))


@register("sample")
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Draw one token per row. Rows with ``temperature == 0`` are greedy (argmax, lowest id on ties).

    ``top_k`` < 1 disables top-k; ``top_p`` = 1 disables top-p. Masked logits (-inf, e.g. from a grammar
    bitmask) are never drawn while any finite logit remains; a row with no finite logit returns -1.
    """
    _check(logits, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, positions=positions)
    greedy, _, vals, idx, keep = survivors(logits, temperature, top_k, top_p)
    u = counter_uniform(seeds, positions, logits.shape[1])
    gumbel = -torch.log(-torch.log(u))
    score = torch.where(keep, vals + gumbel.gather(1, idx), torch.full_like(vals, float("-inf")))
    pick = idx.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)
    # Greedy rows: the first position of the stable descending sort is the lowest id among the maxima.
    out = torch.where(greedy, idx[:, 0], pick)
    return torch.where(torch.isfinite(vals[:, 0]), out, torch.full_like(out, -1))
