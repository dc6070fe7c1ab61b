"""Which ops of the executor's batched step give a row results that depend on the other rows?

One request (the target) is prefilled alone, then decodes one step alone and inside batch mixes of other
decoding requests (different sizes, the target at different positions). Every torch call of the step is
recorded (outside the MoE's internals, whose per-expert calls differ in number with the batch: the MoE's
output is recorded through a module hook instead) and the target's rows are compared bitwise with the
alone run, call by call: the first call whose target rows differ is the op that is not batch-invariant
(its inputs' rows were still equal). Run with the executor's batch-invariant mode off and on::

    .venv/bin/python scripts/probe_batch_invariance.py --model tiny-random --dtype float32
    .venv/bin/python scripts/probe_batch_invariance.py --model tiny --dtype bfloat16 --rows 32

Prints one JSON line per (mode, mix): the first differing op (or null) and whether the logits differ.
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from deepinfer_core.kv import PagedKVPool, StatePool
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.checkpoint import load_model
from deepinfer_core.model.executor import ModelExecutor
from deepinfer_core.model.invariant import RowChunkedProducts
from deepinfer_core.model.layers.moe import MoE

# calls that move or convert values without computing (exact whatever the batch): not recorded, so that
# the two runs' call lists stay aligned where the batch size changes how a tensor is indexed or padded
_MOVES = {
    "__getitem__",
    "__setitem__",
    "reshape",
    "view",
    "contiguous",
    "clone",
    "split",
    "transpose",
    "t",
    "expand",
    "new_zeros",
    "new_empty",
    "zeros_like",
    "empty",
    "detach",
    "to",
    "float",
    "cat",
    "stack",
    "index_select",
    "gather",
    "masked_fill",
    "where",
    "repeat_interleave",
    "flatten",
    "unflatten",
    "permute",
    "squeeze",
    "unsqueeze",
    "narrow",
    "select",
    "__get__",
    "chunk",
    "unbind",
}


class Recorder(TorchFunctionMode):
    """Records (op name, the target's rows of the output) for calls whose output has ``n`` rows (the
    batch-invariant mode's chunked products are recorded as the one call they replace)."""

    inside = 0  # > 0 while RowChunkedProducts computes a product in chunks

    def __init__(self, n: int, rows: slice) -> None:
        super().__init__()
        self.n, self.rows, self.log, self.moe_depth = n, rows, [], 0

    def note(self, func: Any, out: Any) -> None:
        name = getattr(func, "__name__", str(func))
        if (
            self.moe_depth == 0
            and Recorder.inside == 0
            and name not in _MOVES
            and isinstance(out, torch.Tensor)
            and out.dim() >= 1
            and out.shape[0] == self.n
            and out.dtype.is_floating_point
        ):
            self.log.append((name, out[self.rows].detach().clone()))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.note(func, out)
        return out


_chunked_fn = RowChunkedProducts.__torch_function__
CURRENT: dict = {}


def _observed(self: Any, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    Recorder.inside += 1
    try:
        out = _chunked_fn(self, func, types, args, kwargs)
    finally:
        Recorder.inside -= 1
    r = CURRENT.get("r")
    if r is not None:
        r.note(func, out)
    return out


RowChunkedProducts.__torch_function__ = _observed  # type: ignore[method-assign]


def _hook_moe(model: torch.nn.Module, rec_of: dict) -> None:
    def pre(mod: Any, inp: Any) -> None:
        r = rec_of.get("r")
        if r is not None:
            r.moe_depth += 1

    def post(mod: Any, inp: Any, out: Any) -> None:
        r = rec_of.get("r")
        if r is not None:
            r.moe_depth -= 1
            if r.moe_depth == 0 and out[0].shape[0] == r.n:
                r.log.append(("MoE.forward", out[0][r.rows].detach().clone()))

    for m in model.modules():
        if isinstance(m, MoE):
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)


class Driver:
    """Sequences through one executor with blocks and slots from the kv pools (as the engine does)."""

    def __init__(self, model: Any, rows: int, slots: int = 80) -> None:
        self.pool = PagedKVPool(1024, 16)
        self.ex = ModelExecutor(model, 1024, 16, slots, quantize=True)
        self.ex.invariant_rows = rows
        self.states = StatePool(slots)
        self.slot: dict[int, int] = {}

    def batch(self, items: list[tuple[int, np.ndarray, int]]) -> ForwardBatch:
        for sid, toks, start in items:
            if sid not in self.slot:
                self.slot[sid] = self.states.acquire(sid)
                assert self.pool.allocate(sid, start + len(toks))
            have = self.pool.num_tokens(sid)
            if start + len(toks) > have:
                assert self.pool.append_slots(sid, start + len(toks) - have)
        ids = [s for s, *_ in items]
        return ForwardBatch(
            token_ids=np.concatenate([t for _, t, _ in items]),
            query_lens=[len(t) for _, t, _ in items],
            start_pos=[s for *_, s in items],
            block_tables=self.pool.block_tables(ids),
            state_slots=[self.slot[s] for s in ids],
            num_logits=[1] * len(items),
        )


def run_mix(model: Any, rows: int, prompts: dict, nexts: dict, order: list[int], target: int, rec: dict):
    """Prefill every request of ``order`` alone, then one decode step of them all; returns (recorded
    calls, the target's logits row)."""
    d = Driver(model, rows)
    for sid in order:
        d.ex.execute(d.batch([(sid, prompts[sid], 0)]))
    b = d.batch([(sid, nexts[sid], len(prompts[sid])) for sid in order])
    off = b.offsets
    p = order.index(target)
    r = Recorder(b.num_tokens, slice(int(off[p]), int(off[p + 1])))
    rec["r"] = CURRENT["r"] = r
    with r:
        out = d.ex.execute(b)
    rec["r"] = CURRENT["r"] = None
    return r.log, out.logits[p].clone()


def first_difference(alone: list, log: list) -> dict | None:
    """The first call, in the alone run's order, whose target rows differ between the two runs; the call
    lists are aligned on their op names (a batch can add or drop a call: a store of fewer rows, padding)."""
    sm = difflib.SequenceMatcher(None, [n for n, _ in alone], [n for n, _ in log], autojunk=False)
    for blk in sm.get_matching_blocks():
        for k in range(blk.size):
            (na, va), (_, vb) = alone[blk.a + k], log[blk.b + k]
            if va.shape == vb.shape and not torch.equal(va, vb):  # (other shapes: aligned by name only)
                return {"call": blk.a + k, "op": na, "max_abs": float((va.float() - vb.float()).abs().max())}
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=32, help="the invariant mode's chunk rows")
    ap.add_argument("--mixes", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model(a.model, seed=7, dtype=getattr(torch, a.dtype), device="cpu")
    rec: dict = {}
    _hook_moe(model, rec)
    rng = random.Random(a.seed)
    vocab = model.cfg.vocab_size
    nreq = 70
    prompts = {i: np.array([rng.randrange(vocab) for _ in range(rng.randint(3, 40))]) for i in range(nreq)}
    nexts = {i: np.array([rng.randrange(vocab)]) for i in range(nreq)}
    target = 0
    for rows in (0, a.rows):
        alone, logit0 = run_mix(model, rows, prompts, nexts, [target], target, rec)
        for _m in range(a.mixes):
            size = rng.choice([2, 3, 7, 16, 33, 64])
            others = rng.sample(range(1, nreq), size - 1)
            order = others[:]
            order.insert(rng.randrange(size), target)
            log, logit = run_mix(model, rows, prompts, nexts, order, target, rec)
            first = first_difference(alone, log)
            print(
                json.dumps(
                    {
                        "model": a.model,
                        "dtype": a.dtype,
                        "invariant_rows": rows,
                        "batch": size,
                        "position": order.index(target),
                        "calls": [len(alone), len(log)],
                        "first_diff": first,
                        "logits_equal": bool(torch.equal(logit0, logit)),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
