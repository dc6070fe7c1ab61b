"""Count the torch ops one sync-free decode step dispatches (issue #24: fewer, larger kernels).

A B-request decode step (default 64) of a narrow model with the wide config's layer structure
(benchmarks/model.py ``wide_config``: SWA, 2 x ratio 2, 3 x ratio 1 with a Reindex layer, candidates,
Engram) runs on the CPU through the executor's sync-free row path on the reference backend, with the
fused-glue switches of ``model_cuda.py --graphs glue-all``. A dispatch mode counts the aten ops the step
body issues, leaving out views (no kernel on CUDA); each backend op (one kernel on the cuda backend) and
each outermost :func:`~deepinfer_core.model.fusion.fusable` call (one compiled graph, one or a few Triton
kernels) counts once, its inside not at all. What remains is roughly the step's "small torch kernels".

    .venv/bin/python scripts/decode_op_count.py [--batch 64] [--by-site] [--eager] [--dtype float32]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import traceback
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_core.kv import PagedKVPool
from deepinfer_core.model import cuda_graphs as cg
from deepinfer_core.model import decode_step, engram_context, fusion
from deepinfer_core.model.batch import ForwardBatch
from deepinfer_core.model.config import flash_config
from deepinfer_core.model.executor import ModelExecutor
from deepinfer_core.model.model import DeepSeekV41
from deepinfer_kernels import get_backend

# ops that only make a view (or an uninitialised buffer): no kernel
FREE = {
    "view",
    "_unsafe_view",
    "as_strided",
    "expand",
    "t",
    "transpose",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "alias",
    "detach",
    "permute",
    "split",
    "unbind",
    "split_with_sizes",
    "_reshape_alias",
    "lift_fresh",
    "empty",
    "empty_like",
    "empty_strided",
    "unfold",
    "diagonal",
    "view_as_real",
    "unflatten",
    "flatten",
    "reshape",
}


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.ops: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()

    def tick(self, kind: str, site: str) -> None:
        self.ops[kind] += 1
        self.sites[site] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if self.on and name not in FREE:
            fr = [f for f in traceback.extract_stack() if "deepinfer_core" in f.filename]
            self.tick(
                "aten." + name,
                f"{fr[-1].filename.rsplit('/', 1)[-1]}:{fr[-1].name}:{fr[-1].lineno}" if fr else "?",
            )
        return func(*args, **(kwargs or {}))


def _quiet(cnt: Count, kind: str, f: Any) -> Any:
    def run(*a: Any, **k: Any) -> Any:
        if cnt.on:
            cnt.tick(kind, kind)
        was, cnt.on = cnt.on, False
        try:
            return f(*a, **k)
        finally:
            cnt.on = was

    return run


class _Fused(dict):
    """Stands in for fusion's compiled-function table: each outermost fusable call runs eagerly, counted once."""

    def __init__(self, cnt: Count) -> None:
        super().__init__()
        self.cnt = cnt

    def get(self, name: str, default: Any = None) -> Any:
        mod, _, qual = name.rpartition(".")
        fn = importlib.import_module(mod)
        for part in qual.split("."):
            fn = getattr(fn, part)
        return _quiet(self.cnt, "fused:" + qual, getattr(fn, "eager", fn))


class _Backend:
    def __init__(self, cnt: Count) -> None:
        self.ref, self.cnt, self.name = get_backend("reference"), cnt, "reference"

    def op(self, name: str) -> Any:
        return _quiet(self.cnt, "op:" + name, self.ref.op(name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ref, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--by-site", action="store_true", help="also list counts by calling function")
    ap.add_argument(
        "--eager", action="store_true", help="glue off: count every op of the fusable functions too"
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="model dtype (the H200 runs bf16)",
    )
    args = ap.parse_args()
    cfg = flash_config(
        vocab_size=2048,
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        q_lora_rank=256,
        o_lora_rank=256,
        o_groups=2,
        compress_ratios=[0, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 3, 5],
        num_encoder_layers=3,
        index_n_heads=4,
        candidate_source_layer_id=3,
        candidate_topk_blocks=8,
        index_topk=32,
        n_routed_experts=8,
        moe_intermediate_size=256,
        engram_layer_ids=[1],
        engram_table_sizes=[1009],
        num_nextn_predict_layers=0,
        dspark_target_layer_ids=[],
        dspark_noise_token_id=2047,
    )
    model = DeepSeekV41.from_config(cfg, seed=4, dtype=getattr(torch, args.dtype))
    n, bs, p = args.batch, 64, args.prompt
    blocks = n * (-(-(p + 2) // bs)) + 1
    cnt = Count()
    ex = ModelExecutor(model, blocks, bs, n, quantize=True, backend=_Backend(cnt))
    ex.sync_free = True
    glue = not args.eager
    ex.fuse_glue = ex.fused_attention = ex.fused_moe = ex.fused_head = glue
    kv = PagedKVPool(blocks, bs)
    rng = np.random.default_rng(1)
    for i in range(n):
        kv.allocate(i, p + 1)
    ids = list(range(n))
    tab = kv.block_tables(ids)
    pre = ForwardBatch(
        token_ids=rng.integers(0, 2048, n * p),
        query_lens=[p] * n,
        start_pos=[0] * n,
        block_tables=tab,
        state_slots=ids,
        num_logits=[1] * n,
    )
    ex.execute(pre)
    dec = ForwardBatch(
        token_ids=rng.integers(0, 2048, n),
        query_lens=[1] * n,
        start_pos=[p] * n,
        block_tables=tab,
        state_slots=ids,
        num_logits=[1] * n,
    )
    # the inputs a CUDA graph's step body reads (cuda_graphs._Graph: one int64 image, valid rows marked,
    # entry counts padded to the graph's quantum), so the count is that of a replayed step
    slots_np = np.asarray(ids, np.int64)
    floors = ex.state.floor[slots_np]
    entries = {
        r: cg.round_up(e, cg.ENTRY_QUANTUM)
        for r, e in decode_step.entries_needed(ex.state, dec.positions).items()
    }
    engram = engram_context.engram_rows(ex.state, dec, None, None, pos=dec.positions, row_slots=slots_np)
    w = cg.width_bucket(tab.shape[1])
    d = torch.from_numpy(cg.host_inputs(dec, floors, n, w))
    inp = decode_step.DecodeInputs(
        tokens=d[:n],
        positions=d[n : 2 * n],
        slots=d[2 * n : 3 * n],
        floors=d[3 * n : 5 * n].view(n, 2),
        valid=d[5 * n : 6 * n],
        tables=d[6 * n :].view(n, w),
        engram=engram,
        entries=entries,
    )
    with torch.no_grad():  # one step first: one-time work (the weight packs) is not a step's ops
        decode_step.decode_body(ex.state, inp)
    saved = dict(fusion._COMPILED)
    fusion._COMPILED = _Fused(cnt)  # type: ignore[assignment]
    cnt.on = True
    try:
        with cnt, torch.no_grad():  # as the executor runs it (the input projections pack without autograd)
            decode_step.decode_body(ex.state, inp)
    finally:
        cnt.on = False
        fusion._COMPILED = saved  # type: ignore[assignment]
    aten = sum(v for k, v in cnt.ops.items() if k.startswith("aten."))
    fused = sum(v for k, v in cnt.ops.items() if k.startswith("fused:"))
    ops = sum(v for k, v in cnt.ops.items() if k.startswith("op:"))
    print(
        f"decode step B={n} ({'glue-all' if glue else 'eager'}): {aten} aten ops outside fused functions, "
        f"{fused} fused-function calls, {ops} backend ops"
    )
    for k, v in cnt.ops.most_common():
        print(f"{v:6d} {k}")
    if args.by_site:
        print("-- by calling function")
        for k, v in cnt.sites.most_common():
            print(f"{v:6d} {k}")


if __name__ == "__main__":
    main()
