"""The sync-free decode step's shared work (issue #24): one cos / sin per rope frequency set, the index
arithmetic built once per step.

Oracles: ``rope_inv_freq`` (the buffers' values), the same steps with every layer's inv_freq unshared
(the per-layer path: bitwise equal outputs), and the plain row path for steps fed graph-shaped inputs
(padded rows, padded entry counts: the entry-table gathers must never read past a row's entries) and
the executor's own sync-free step for the cache rows written.
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_core.model import cuda_graphs as cg
from deepinfer_core.model import decode_step, engram_context
from deepinfer_core.model.config import tiny_config
from deepinfer_core.model.layers.attention import Attention
from deepinfer_core.model.layers.rope import rope_inv_freq
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_kernels import get_backend

from .session import Session


def _attns(m: DeepSeekV41) -> list[Attention]:
    return [a for a in m.modules() if isinstance(a, Attention)]


def test_equal_rope_params_share_one_inv_freq_through_to() -> None:
    m = DeepSeekV41.from_config(tiny_config(), seed=1, dtype=torch.float32)
    for model in (m, m.to(torch.float64), m.to(torch.bfloat16)):
        by_params: dict[Any, set[int]] = collections.defaultdict(set)
        for a in _attns(model):
            by_params[a.rope_params].add(id(a.inv_freq))
            r, base, scaling = a.rope_params
            want = rope_inv_freq(r, base, None if scaling is None else model.cfg.rope_scaling)
            assert torch.equal(a.inv_freq, want.to(a.inv_freq.dtype))
        assert len(by_params) == 2  # SWA layers: rope_theta; compressed layers: compress_rope_theta
        assert all(len(ids) == 1 for ids in by_params.values())


class _Cos(TorchDispatchMode):
    """Counts aten.cos the step body (decode_body) dispatches for the attention / indexer RoPE (not for the
    compressor's pooled entries, nor for the drafter's context after the body)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ == "cos":
            st = traceback.extract_stack()
            files = {f.filename.rsplit("/", 1)[-1] for f in st}
            if "compressor.py" not in files and any(f.name == "decode_body" for f in st):
                self.n += 1
        return func(*args, **(kwargs or {}))


def _sync_free(model: DeepSeekV41) -> Session:
    s = Session(model)
    ex = s.ex
    s.ex = type(ex)(
        model,
        ex.num_blocks,
        ex.block_size,
        ex.num_slots,
        backtrack_tokens=ex.backtrack,
        quantize=ex.fmt.quantized,
        backend=get_backend("reference"),
    )
    s.ex.sync_free = True
    return s


def _decode(
    s: Session, seqs: dict[int, torch.Tensor], steps: range, counter: _Cos | None = None
) -> torch.Tensor:
    out = []
    for p in steps:
        items = [(i, seqs[i][p : p + 1], p, 1) for i in seqs]
        if counter is None:
            _, per = s.step(items)
        else:
            with counter:
                _, per = s.step(items)
        out += per
    return torch.cat(out)


def test_decode_step_computes_angles_once_per_frequency(model64: DeepSeekV41) -> None:
    g = torch.Generator().manual_seed(5)
    seqs = {i: torch.randint(0, 512, (40,), generator=g) for i in range(3)}
    s = _sync_free(model64)
    for i in seqs:
        s.step([(i, seqs[i][:30], 0, 1)])
    c = _Cos()
    shared = _decode(s, seqs, range(30, 33), c)
    freqs = {a.rope_params for a in _attns(model64)}
    assert c.n == 3 * len(freqs)  # three steps, one cos per distinct frequency set each
    # the per-layer path: every layer's own inv_freq tensor (a copy), one cos / sin per layer
    clones = {}
    for a in _attns(model64):
        clones[a] = a.inv_freq
        a.inv_freq = a.inv_freq.clone()
    try:
        s2 = _sync_free(model64)
        for i in seqs:
            s2.step([(i, seqs[i][:30], 0, 1)])
        c2 = _Cos()
        own = _decode(s2, seqs, range(30, 33), c2)
    finally:
        for a, t in clones.items():
            a.inv_freq = t
    assert c2.n > c.n
    assert torch.equal(shared, own)


def test_graph_shaped_inputs_match_the_row_paths(model64: DeepSeekV41) -> None:
    """decode_body on a CUDA graph's inputs (rows padded with row 0, valid 0; entry counts padded past the
    quantum; a wider table) gives the plain row path's logits on the real rows, and writes the same cache
    bytes as the executor's own sync-free step (unpadded inputs, valid None)."""
    g = torch.Generator().manual_seed(6)
    seqs = {i: torch.randint(0, 512, (int(n),), generator=g) for i, n in enumerate((41, 23, 35))}
    plain, step, fast = Session(model64), _sync_free(model64), _sync_free(model64)
    for s in (plain, step, fast):
        for i, t in seqs.items():
            s.step([(i, t[:-1], 0, 1)])
    items = [(i, t[-1:], len(t) - 1, 1) for i, t in seqs.items()]
    _, want = plain.step(items)
    step.step(items)
    ex = fast.ex
    for sid, toks, start, _ in items:
        fast._ensure(sid, start + len(toks))
    ids = list(seqs)
    b = decode_step.ForwardBatch(
        token_ids=np.concatenate([t.numpy() for _, t, _, _ in items]),
        query_lens=[1] * 3,
        start_pos=[s for _, _, s, _ in items],
        block_tables=fast.pool.block_tables(ids),
        state_slots=[fast.slot[i] for i in ids],
        num_logits=[1] * 3,
    )
    slots = np.asarray(b.state_slots, np.int64)
    n, w = 5, cg.width_bucket(b.block_tables.shape[1] + 1)
    entries = {r: cg.round_up(e, 8) + 8 for r, e in decode_step.entries_needed(ex.state, b.positions).items()}
    tok_ring = ex.state.tokens.copy()
    engram = engram_context.engram_rows(ex.state, b, None, None, pos=b.positions, row_slots=slots)
    engram = {lid: torch.cat((t, t[:1].expand(n - 3, -1))) for lid, t in engram.items()}
    d = torch.from_numpy(cg.host_inputs(b, ex.state.floor[slots], n, w))
    inp = cg.static_inputs(d, n, w, entries, engram)
    logits, _, _ = decode_step.decode_body(ex.state, inp)
    assert (logits[:3] - torch.cat([p[-1:] for p in want])).abs().max().item() < 1e-10
    # the graph's other Engram form: hashed row ids at the end of the image, the rows fetched in the body
    # (the ring rolled back: hashing records the step's tokens)
    assert model64.cfg.engram_layer_ids and cg.fetch_in_graph(ex.state)
    ex.state.tokens[:] = tok_ring
    ids = engram_context.engram_ids(ex.state, b, None, None, pos=b.positions, row_slots=slots)
    assert ids is not None and ids.shape[:2] == (len(model64.cfg.engram_layer_ids), 3)
    d2 = torch.from_numpy(cg.host_inputs(b, ex.state.floor[slots], n, w, ids.numpy()))
    assert d2.shape[0] == d.shape[0] + ids[:, :1].numel() * n and torch.equal(d2[: d.shape[0]], d)
    inp2 = cg.static_inputs(d2, n, w, entries, {}, (ids.shape[0], n, ids.shape[2]))
    assert torch.equal(inp2.engram_ids[:, :3], ids.long()) and torch.equal(
        inp2.engram_ids[:, 3:], ids[:, :1].long().expand(-1, n - 3, -1)
    )
    logits2, _, _ = decode_step.decode_body(ex.state, inp2)
    assert torch.equal(logits2, logits)
    # padded shapes change the float64 summation order (logits agree to 1e-10), so the caches are compared
    # as values, and the rows written (the slots: nonzero rows) exactly
    other = step.ex
    pools = [(other.kv[lid], ex.kv[lid]) for lid in model64.cfg.kv_source_layer_ids]
    pools += [(other.index_keys[lid], ex.index_keys[lid]) for lid in model64.cfg.kv_source_layer_ids]
    pools += list(zip(other.swa, ex.swa)) + [(c, ex.comp_state[lid]) for lid, c in other.comp_state.items()]
    for a, b in pools:
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        assert torch.equal(a.ne(0).any(-1), b.ne(0).any(-1))
        if a.dtype == torch.uint8:
            a, b = a.view(torch.float64), b.view(torch.float64)
        assert (a - b).abs().max().item() < 1e-10


@pytest.mark.parametrize("padded", [False, True])
def test_step_index_functions_compiled_equal_eager(padded: bool) -> None:
    """window_index / entry_index / ring_index compiled by Inductor (the glue) give the eager values
    (integer maths: bitwise), with and without padded rows, and for a ratio that scores no entry."""
    from deepinfer_core.model import fusion

    g = torch.Generator().manual_seed(7)
    n, bs, w = 9, 16, 12
    positions = torch.randint(0, 300, (n,), generator=g)
    slots = torch.randperm(20, generator=g)[:n]
    floors = torch.randint(0, 200, (n, 2), generator=g)
    tables = torch.randint(1, 90, (n, 8), generator=g)
    valid = (torch.arange(n) < 6) if padded else None
    calls = [lambda: decode_step.window_index(positions, slots, floors, valid, w, w + 6)]
    top = int(positions.max()) + 1  # e >= max((p + 1) // r), as entries_needed gives (padded: more)
    for e, r in ((top // 2, 2), (top // 2 + 7, 2), (0, 1), (top + 3, 1)):
        calls.append(lambda e=e, r=r: decode_step.entry_index(positions, tables, valid, e, r, 1, bs))
    rows = None if valid is None else torch.where(valid, torch.arange(n), 0)
    calls.append(lambda: decode_step.ring_index(positions, slots, rows, 5, 2))
    fusion.set_backend("inductor")
    try:
        for call in calls:
            want = call()
            with fusion.fused_glue():
                got = call()
            assert len(got) == len(want)
            for a, b in zip(got, want):
                assert (a is None and b is None) or torch.equal(a, b)
    finally:
        fusion.set_backend(None)
