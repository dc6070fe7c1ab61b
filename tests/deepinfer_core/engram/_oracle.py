"""Independent straightforward Engram hash: one token, one layer, one head at a time, in Python ints.

Semantics written out from the public description: the n-gram of order n ending at token t is
tokens[t], tokens[t-1], ..., tokens[t-n+1] (the pad id before the sequence start, or the given context);
hash = XOR over k of token[t-k] * m_k in wrapping signed 64-bit arithmetic; row = hash mod prime
(floor mod) + offset.
"""

from __future__ import annotations

MASK = (1 << 64) - 1


def wrap_signed(x: int) -> int:
    x &= MASK
    return x - (1 << 64) if x >= (1 << 63) else x


def oracle_hash(tokens, seqs, mult, primes, offsets, pad, token_map=None, context=None):
    """tokens: list of raw ids; seqs: list of (start, stop); mult[L][N]; primes[L][N-1][H];
    offsets[L][(N-1)*H]; context[s][j] raw id j+1 back before seq s (or -1). Returns [L][T][cols]."""
    tm = (lambda x: x) if token_map is None else (lambda x: int(token_map[x]))
    n_layers, n = len(mult), len(mult[0])
    heads = len(primes[0][0])
    out = [[None] * len(tokens) for _ in range(n_layers)]
    for s, (start, stop) in enumerate(seqs):
        for t in range(start, stop):
            grams = []
            for k in range(n):
                j = t - k
                if j >= start:
                    grams.append(tm(tokens[j]))
                elif context is not None:
                    c = context[s][k - (t - start) - 1]
                    grams.append(pad if c < 0 else tm(c))
                else:
                    grams.append(pad)
            for li in range(n_layers):
                row = []
                h = 0
                for k in range(n):
                    h ^= (grams[k] * mult[li][k]) & MASK
                    if k == 0:
                        continue
                    for hd in range(heads):
                        col = (k - 1) * heads + hd
                        row.append(wrap_signed(h) % primes[li][k - 1][hd] + offsets[li][col])
                out[li][t] = row
    return out
