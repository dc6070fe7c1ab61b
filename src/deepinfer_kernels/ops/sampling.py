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

from deepinfer_kernels.ops.sampling_filter import default_graph_safe, survivor_threshold, survivors_sorted
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
    key = row_keys(seeds, positions)
    j = torch.arange(num, device=seeds.device, dtype=torch.int64)
    return _uniform(key[:, None], j[None, :])


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The RNG key of each (request seed, position): int64, one per row (the CUDA kernel takes these)."""
    return mix64(seeds.to(torch.int64)) ^ (positions.to(torch.int64) * _POS_MUL)


def _uniform(key: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The uniform of token ``j`` under a (request, position) key, elementwise (broadcast)."""
    h = mix64(key ^ mix64(j))
    # Top 24 bits -> a float32 exactly representable; +0.5 keeps it strictly inside (0, 1).
    return (_lsr(h, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _check(logits: torch.Tensor, **rows: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [batch, vocab], got shape {tuple(logits.shape)}")
    for name, t in rows.items():
        if t.shape != (logits.shape[0],):
            raise ValueError(f"{name}: expected shape ({logits.shape[0]},), got {tuple(t.shape)}")


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``sample`` of rows that are all greedy, without its sort and random numbers: the argmax (lowest id
    on ties), -1 where the row's largest value is not finite (no finite logit, or a NaN / +inf, which the
    sort puts first). The caller decides that every row is greedy (host-side temperatures)."""
    mx, am = logits.float().max(dim=-1)  # NaN propagates to mx (and its index), as in the sort
    return torch.where(torch.isfinite(mx), am, torch.full_like(am, -1))


def draw(
    x: torch.Tensor,
    keep: torch.Tensor,
    mode: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """The token of each row given its scaled logits ``x`` and survivor mask ``keep`` (token order): the
    Gumbel-max over the survivors, the argmax for greedy rows (``mode`` 0), -1 for dead rows (``mode`` 2).
    Ties go to the lowest id (``argmax`` returns the first maximum), as in the CUDA kernel."""
    u = counter_uniform(seeds, positions, x.shape[1])
    gumbel = -torch.log(-torch.log(u))
    score = torch.where(keep, x + gumbel, torch.full_like(x, float("-inf")))
    out = torch.where(mode == 0, x.argmax(dim=-1), score.argmax(dim=-1))
    return torch.where(mode == 2, torch.full_like(out, -1), out)


def draw_sparse(
    x: torch.Tensor,
    keep: torch.Tensor,
    mode: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """``draw`` with random numbers for the survivors only (the same token: the same float operations per
    token, the maximum score's lowest id). Its (row, token) pairs are a data-dependent shape: eager only,
    where top-k / top-p leave a few tokens of a large vocabulary and the full-row RNG would dominate."""
    b, v = x.shape
    rows, ids = torch.nonzero(keep & (mode == 1)[:, None], as_tuple=True)
    key = row_keys(seeds, positions)
    score = x[rows, ids] + -torch.log(-torch.log(_uniform(key[rows], ids)))
    best = torch.full((b,), float("-inf"), device=x.device).scatter_reduce(0, rows, score, "amax")
    first = torch.where(score == best[rows], ids, v)
    pick = torch.full((b,), v, dtype=torch.int64, device=x.device).scatter_reduce(0, rows, first, "amin")
    out = torch.where(mode == 0, x.argmax(dim=-1), pick)
    return torch.where(mode == 2, torch.full_like(out, -1), out)


def keep_mask(x: torch.Tensor, tv: torch.Tensor, ti: torch.Tensor) -> torch.Tensor:
    """The survivors described by the last one: ``x > tv`` or (``x == tv`` and id ``<= ti``)."""
    ids = torch.arange(x.shape[1], device=x.device)[None, :]
    return (x > tv[:, None]) | ((x == tv[:, None]) & (ids <= ti[:, None]))


@register("sample")
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    graph_safe: bool | None = None,
) -> torch.Tensor:
    """Draw one token per row. Rows with ``temperature == 0`` are greedy (argmax, lowest id on ties).

    ``top_k`` < 1 disables top-k; ``top_p`` >= 1 disables top-p (the rule: ``ops/sampling_filter.py``).
    Masked logits (-inf, e.g. from a grammar bitmask) are never drawn while any finite logit remains; a row
    with no finite logit (or a NaN / +inf) returns -1. No sort; ``graph_safe`` (default on for CUDA and
    under ``torch.compile``): no host synchronisation or data-dependent shape either. Off (the CPU
    default), the survivors are searched from ``topk`` candidates and only they get random numbers.
    """
    _check(logits, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, positions=positions)
    if logits.shape[1] == 0:
        return torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
    if graph_safe is None:
        graph_safe = default_graph_safe(logits)
    t, tv, ti, mode = survivor_threshold(logits, temperature, top_k, top_p, graph_safe)
    x = logits.float() / t[:, None]
    return (draw if graph_safe else draw_sparse)(x, keep_mask(x, tv, ti), mode, seeds, positions)


def sample_sorted(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """``sample`` with the survivors found by the full stable sort (``survivors_sorted``): the oracle the
    tests and benchmarks compare ``sample`` against."""
    _check(logits, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, positions=positions)
    if logits.shape[1] == 0:
        return torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
    greedy, t, vals, idx, keep_sorted = survivors_sorted(logits, temperature, top_k, top_p)
    keep = torch.zeros_like(keep_sorted).scatter_(1, idx, keep_sorted)
    ok = torch.isfinite(vals[:, 0])
    mode = torch.where(ok, torch.where(greedy, 0, 1), 2)
    return draw(logits.float() / t[:, None], keep, mode, seeds, positions)
