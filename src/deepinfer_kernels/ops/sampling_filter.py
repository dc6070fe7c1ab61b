"""The top-k / top-p survivor set of a sampling row, found without sorting the vocabulary.

The survivors of a row are a prefix of its stable descending order (value descending, token id ascending on
ties), so they are described by their last member: a threshold value ``tv`` and id ``ti``; token ``i``
survives iff ``x_i > tv`` or (``x_i == tv`` and ``i <= ti``). The rule (shared by both implementations here):

- ``x = logits / T`` in float32 (``T = 1`` for greedy rows); ``-inf`` logits never survive; a row whose
  largest value is NaN or ``+inf``, or that has no finite value, has no survivor (``mode`` 2: token -1).
- top-k keeps the first ``k`` of the order (``k < 1``: all).
- top-p: the mass of a token is ``q_i = floor(exp(x_i - max) * 2**MASS_BITS)``, an integer, so every sum
  of masses is exact and independent of the order it is added in (a float softmax + cumsum is not: its
  result depends on the summation order, which a sort-free search cannot reproduce). ``Z`` is the mass of
  the top-k survivors; a token survives iff the mass before it in the order is ``< ceil(top_p * Z)``
  (``top_p * Z`` in float64) or it is the first token; ``top_p >= 1`` disables top-p.

``survivors_sorted`` applies the rule over a full stable sort: the oracle. ``survivor_threshold`` finds the
same boundary with a fixed number of passes over the unsorted row and no data-dependent shape or host
synchronisation (so it can be captured in a CUDA graph): a radix select (16 bits a digit) over the
order-preserving integer bits of ``x``, by count for top-k and by mass for top-p, and the tie among equal
values resolved by token id with a cumsum. Every decision is integer arithmetic, so the two agree bit for
bit; ``exp`` is evaluated once, on the unsorted row, by both. On the CPU (eager, where a host decision is
free) a ``topk`` of the first ``CANDIDATES`` tokens settles most rows first (small top-k, a peaked top-p
nucleus); the rest take the radix select.
"""

from __future__ import annotations

import torch

CANDIDATES = 256  # the eager path's topk: rows whose survivors end within them skip the radix select
MASS_BITS = 36  # q <= 2**36 and Z <= vocab * 2**36 < 2**53: exact in int64 and in float64
_EMPTY = -(2**31)  # the key of a non-finite logit: below every finite value's key


def scale(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(greedy, t, x)``: greedy rows (temperature <= 0), the temperature used (1 for greedy rows) and the
    float32 scaled logits ``logits / t``."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    return greedy, t, logits.float() / t[:, None]


def masses(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ok, fin, q)``: rows with a finite maximum, the finite entries of those rows and their integer
    masses (0 elsewhere). Computed over the row in token order, whatever searches it afterwards."""
    mx = x.amax(dim=1)  # NaN propagates: a NaN anywhere makes the row dead, as in the sort (NaN first)
    ok = torch.isfinite(mx)
    fin = (x > float("-inf")) & ok[:, None]  # in a live row the only non-finite value is -inf
    e = torch.exp(x - torch.where(ok, mx, 0.0)[:, None])
    q = torch.where(fin, e * float(2**MASS_BITS), 0.0).to(torch.int64)
    return ok, fin, q


def effective_k(top_k: torch.Tensor, n_fin: torch.Tensor, vocab: int) -> torch.Tensor:
    """How many tokens top-k keeps, at least 1 and at most the row's finite count (``k < 1``: all)."""
    k = torch.where(top_k >= 1, top_k.to(torch.int64), torch.full_like(top_k, vocab, dtype=torch.int64))
    return torch.minimum(k.clamp(max=vocab), n_fin).clamp(min=1)


def p_target(top_p: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p_on, T)``: rows where top-p cuts (``top_p < 1``, NaN included: it keeps one token) and the
    integer mass bound: a token survives iff the mass before it is ``< T`` (``T >= 1``: the first always)."""
    p_on = ~(top_p >= 1)
    thr = torch.ceil(top_p.double() * z.double())
    thr = torch.where(torch.isnan(thr) | ~p_on, torch.ones_like(thr), thr).clamp(min=1.0)
    return p_on, thr.to(torch.int64)


def order_keys(x: torch.Tensor, fin: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered like the float values (``-0.0`` as ``+0.0``); non-finite entries get ``_EMPTY``."""
    b = (x + 0.0).view(torch.int32)  # -0.0 + 0.0 is +0.0
    o = b ^ ((b >> 31) & 0x7FFFFFFF)
    return torch.where(fin, o, _EMPTY)


def default_graph_safe(logits: torch.Tensor) -> bool:
    """Fixed shapes and no host decision unless on the CPU, eager: there a host decision is free (no
    device to wait for), unless the code is being traced (``torch.compile``)."""
    return logits.device.type != "cpu" or torch.compiler.is_compiling()


def survivors_sorted(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The oracle: the rule over a full stable descending sort. Returns ``(greedy, t, vals, idx, keep)``:
    greedy rows, the temperature used, the sorted scaled logits, their token ids and the survivor mask over
    sorted positions (a prefix)."""
    greedy, t, x = scale(logits, temperature)
    _, fin, q = masses(x)
    v = x.shape[1]
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=x.device)[None, :]
    k = effective_k(top_k, fin.sum(dim=1), v)
    qs = torch.where(rank < k[:, None], q.gather(1, idx), 0)
    before = torch.cumsum(qs, dim=1) - qs  # exact: integers
    p_on, thr = p_target(top_p, qs.sum(dim=1))
    keep = (rank < k[:, None]) & (~p_on[:, None] | (before < thr[:, None]))
    keep[:, 0] = True
    keep &= torch.isfinite(vals)
    return greedy, t, vals, idx, keep


def _pick(
    h: torch.Tensor, above: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over bins ``h`` [B, D] (weights >= 0), the largest bin ``d`` with ``above + h[d:].sum() >= target``,
    and the weights ``>= d`` and ``> d`` (``above`` included). A binary search over the prefix sums."""
    c = h.cumsum(dim=1)
    total = above + c[:, -1]
    room = (total - target)[:, None]  # how much weight may lie below d
    d = torch.searchsorted(c, room, right=True).clamp(max=h.shape[1] - 1)
    hd = h.gather(1, d).squeeze(1)
    ge = total - c.gather(1, d).squeeze(1) + hd
    return d.squeeze(1), ge, ge - hd


def _digits(key: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """The keys' radix digits, most significant first, and the bits per digit: 16 for a large vocabulary (2
    levels of 65,536 bins), 8 below 2**16 entries a row (4 levels of 256: the bins stay smaller than the
    row). int64: ``scatter_add_`` indexes with int64."""
    bits = 16 if key.shape[1] >= 1 << 16 else 8
    # the digits of key - _EMPTY (0 .. 2**32 - 1, ordered as the keys), shifted in int32 (cheaper): the
    # top one is the arithmetic shift offset by half its range, the others the plain bit fields
    top = (key >> (32 - bits)) + (1 << (bits - 1))
    rest = [(key >> s) & ((1 << bits) - 1) for s in range(32 - 2 * bits, -1, -bits)]
    return [d.to(torch.int64) for d in [top, *rest]], bits


def _level(
    digits: list[torch.Tensor], bits: int, w: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(v, ge, gt)``: the largest key ``v`` with ``W(key >= v) >= target`` (a present key when the target
    is reachable), ``W(key >= v)`` and ``W(key > v)``, where ``W`` sums ``w``. A radix select: per digit one
    scatter-add of the weights whose higher digits match the prefix chosen so far into ``2**bits`` bins
    (the others add 0 to their own digit's bin: no single hot bin for the GPU's atomics), then a binary
    search over the bins' prefix sums."""
    b, nb = w.shape[0], 1 << bits
    above = torch.zeros(b, dtype=torch.int64, device=w.device)
    prefix = torch.zeros_like(above)
    ge = above
    match: torch.Tensor | None = None
    for i, dig in enumerate(digits):
        wi = w if match is None else torch.where(match, w, 0)
        h = torch.zeros(b, nb, dtype=torch.int64, device=w.device).scatter_add_(1, dig, wi)
        d, ge, above = _pick(h, above, target)
        prefix = prefix * nb + d
        if i + 1 < len(digits):
            m = dig == d[:, None]
            match = m if match is None else match & m
    return prefix + _EMPTY, ge, above


def _ties(key: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Running count of the tokens whose key is ``v``, in token order (int32, [B, V])."""
    return (key == v[:, None]).cumsum(dim=1, dtype=torch.int32)


def _nth(ties: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The id of the ``j``-th (1-based) tied token: the first position where the running count reaches j."""
    i = torch.searchsorted(ties, j.to(torch.int32)[:, None]).squeeze(1)
    return i.clamp(max=ties.shape[1] - 1)


def _radix_boundary(
    key: torch.Tensor, fin: torch.Tensor, q: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The last survivor's id per row by the radix select: fixed shapes, no host synchronisation."""
    digits, bits = _digits(key)
    # top-k: the k-th token of the order (its value by count, then the right one among equal values)
    vk, _, gtk = _level(digits, bits, fin.to(torch.int64), k)
    ik = _nth(_ties(key, vk), k - gtk)
    z = torch.where(key > vk[:, None], q, 0).sum(dim=1)
    z = z + (k - gtk) * q.gather(1, ik[:, None]).squeeze(1)
    # top-p: the last token whose mass before it is < thr (its value by mass, then the ties that fit)
    p_on, thr = p_target(top_p, z)
    vp, gep, gtp = _level(digits, bits, q, thr)
    tp = _ties(key, vp)
    n = tp[:, -1].to(torch.int64).clamp(min=1)
    qv = torch.div(gep - gtp, n, rounding_mode="floor").clamp(min=1)  # the mass of each tied token
    fit = torch.div(thr - gtp + qv - 1, qv, rounding_mode="floor").clamp(min=1)  # ties before the bound
    ip = _nth(tp, fit)
    p_first = p_on & ((vp > vk) | ((vp == vk) & (ip < ik)))
    return torch.where(p_first, ip, ik)


def _candidate_boundary(
    key: torch.Tensor, fin: torch.Tensor, q: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ti, resolved)``: the last survivor's id from the first ``CANDIDATES`` tokens of the order (one
    ``topk`` over keys that pack the value above the inverted id, so they are exactly the stable sort's
    prefix), and whether that settles the row: top-k at most the candidates, or off, and the survivors end
    inside them. Fixed shapes too, but the rows it does not settle need ``_radix_boundary``."""
    v = key.shape[1]
    c = min(v, CANDIDATES)
    ids = torch.arange(v, device=key.device)
    packed = key.to(torch.int64) * (1 << 32) + ((1 << 32) - 1 - ids)
    pos = torch.topk(packed, c, dim=1).indices
    n_fin = fin.sum(dim=1)
    inside = torch.arange(c, device=key.device)[None, :] < k[:, None]
    qk = torch.where(inside, q.gather(1, pos), 0)
    z = torch.where(k >= n_fin, q.sum(dim=1), qk.sum(dim=1))  # exact where the row is settled
    p_on, thr = p_target(top_p, z)
    keep = inside & (~p_on[:, None] | ((qk.cumsum(dim=1) - qk) < thr[:, None]))
    keep[:, 0] = True
    n = keep.sum(dim=1)
    beyond = (n == c) & (k > c) & (~p_on | (qk.sum(dim=1) < thr))  # the next token would survive too
    resolved = ((k <= c) | (k >= n_fin)) & ~beyond
    return pos.gather(1, (n - 1)[:, None]).squeeze(1), resolved


def survivor_threshold(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    graph_safe: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(t, tv, ti, mode)`` per row: the temperature used, the last survivor's scaled value and id (int32),
    and the mode (0 greedy, 1 sample, 2 no finite logit: token -1). Same boundary as ``survivors_sorted``.

    ``graph_safe`` (default: on for a CUDA / non-CPU device and under ``torch.compile``): the radix select
    alone, fixed-shape passes with no host synchronisation (capturable in a CUDA graph). Off (the CPU
    default): the first ``CANDIDATES`` tokens by ``topk`` settle most rows (top-k <= CANDIDATES, or a
    top-p nucleus inside them); only the other rows, picked on the host, take the radix select. Both give
    the same boundary."""
    if graph_safe is None:
        graph_safe = default_graph_safe(logits)
    greedy, t, x = scale(logits, temperature)
    ok, fin, q = masses(x)
    key = order_keys(x, fin)
    k = effective_k(top_k.to(x.device), fin.sum(dim=1), x.shape[1])
    top_p = top_p.to(x.device)
    if graph_safe:
        ti = _radix_boundary(key, fin, q, k, top_p)
    else:
        ti, resolved = _candidate_boundary(key, fin, q, k, top_p)
        rest = torch.nonzero(~resolved).squeeze(1)  # a host decision: eager only
        if rest.numel():
            ti[rest] = _radix_boundary(key[rest], fin[rest], q[rest], k[rest], top_p[rest])
    tv = x.gather(1, ti[:, None]).squeeze(1)
    mode = torch.where(ok, torch.where(greedy, 0, 1), 2).to(torch.int32)
    return t, tv, ti.to(torch.int32), mode
