"""DeepSeek's kernel libraries beside the cuda backend's own kernels, on the same shapes, against the
copy-bandwidth and matmul-rate ceilings measured in the same run (H200).

Sections (``--sections``, default all):

- ``attn``: FlashMLA sparse FP8 decode (V3.2 cache, 656 B a key, h 64, top-k 512 + window 128 = 640 keys)
  vs our TileLang ``sink_attention_rows`` (V4.1 decode attention: bf16 gathered keys, D 512, the same 640
  keys a row; the gather that feeds it is not timed). Bytes = keys read + q + out; GB/s and % of copy.
- ``gemm``: the wide config's expert products (8 experts, gate+up N 4608 x K 5120, down N 5120 x K 2304;
  B rows x top-6 routed at random): our TileLang ``moe_grouped_gemm`` on bf16 weights vs DeepGEMM's
  masked / contiguous FP8 grouped GEMM on 128 x 128 block FP8 weights. Bytes = weights of the experts hit
  (+ scales) + activations; time, GB/s and % of copy, TFLOP/s and % of the bf16 matmul rate.
- ``logits``: the indexer's logits (32 heads x 128, S keys): our TileLang ``indexer_scores`` (bf16 keys)
  vs DeepGEMM ``fp8_mqa_logits`` (FP8 keys, converted once, conversion timed apart) and
  ``fp8_paged_mqa_logits`` (B sequences of S keys in 64-key blocks).
- ``topk``: ``torch.topk`` vs DeepSelect on the indexer's [rows, S] bf16 / fp32 scores and the sampler's
  [B, 129280] fp32 logits.
- ``decode``: the wide-config decode step (benchmarks/model_cuda.py's Decoder, CUDA graphs, the fused
  MoE path) with ``DEEPINFER_KERNEL_LIBS=none`` vs ``deep_gemm`` (the switch the model's path reaches).

    python benchmarks/kernel_libs.py [--sections attn,gemm,logits,topk,decode] [--batches 1,64]
                                     [--context 8192] [--quick] [--dry-run]

A library that is not importable is reported (``"metric": "skipped"``) and its rows left out. ``--dry-run``
(any machine) prints the cases and their byte counts only. One JSON line per measurement.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

import _common
from _common import emit, log, parser

BENCH = "kernel_libs"
SECTIONS = ("attn", "gemm", "logits", "topk", "decode")
WIDE_MOE = {"experts": 8, "topk": 6, "hidden": 5120, "inter": 2304}
INDEX = {"heads": 32, "dim": 128}
ATTN = {"heads": 64, "topk": 512, "window": 128}


# --- shapes and bytes (host only: --dry-run runs these anywhere) --------------------------------------


def attn_bytes(b: int) -> dict[str, int]:
    keys = ATTN["topk"] + ATTN["window"]
    h = ATTN["heads"]
    return {
        "flash_mla": b * keys * 656 + b * h * 576 * 2 + b * h * 512 * 2 + b * keys * 4,
        "tilelang": b * keys * 512 * 2 + 2 * b * h * 512 * 2 + b * keys,
    }


def gemm_cases(batches: list[int]) -> list[dict[str, int]]:
    m = WIDE_MOE
    return [
        {"batch": b, "rows": b * m["topk"], "n": n, "k": k, "experts": m["experts"], "part": part}
        for b in batches
        for part, n, k in (("gate_up", 2 * m["inter"], m["hidden"]), ("down", m["hidden"], m["inter"]))
    ]


def gemm_bytes(c: dict[str, int], experts_hit: int) -> dict[str, int]:
    n, k, r = c["n"], c["k"], c["rows"]
    scales = experts_hit * (-(-n // 128)) * (-(-k // 128)) * 4
    return {
        "bf16": experts_hit * n * k * 2 + r * k * 2 + r * n * 2,
        "fp8": experts_hit * n * k + scales + r * k + r * (-(-k // 128)) * 4 + r * n * 2,
    }


def logits_bytes(rows: int, keys: int) -> dict[str, int]:
    h, d = INDEX["heads"], INDEX["dim"]
    return {
        "bf16": keys * d * 2 + rows * h * d * 2 + rows * keys * 4,
        "fp8": keys * (d + 4) + rows * h * d + rows * keys * 4,
    }


def topk_cases(batches: list[int], context: int) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for b in batches:
        for dt in ("bfloat16", "float32"):
            for k in (512, 2048):
                cases.append({"use": "indexer", "rows": b, "n": context, "k": k, "dtype": dt})
        cases.append({"use": "sampling", "rows": b, "n": 129280, "k": 50, "dtype": "float32"})
    cases.append({"use": "indexer_prefill", "rows": 2048, "n": context, "k": 2048, "dtype": "bfloat16"})
    return cases


def dry_run(args: Any) -> None:
    batches = [int(x) for x in args.batches.split(",")]
    for b in batches:
        for impl, nb in attn_bytes(b).items():
            emit(BENCH, {"section": "attn", "impl": impl, "batch": b}, "bytes", nb, "B")
    for c in gemm_cases(batches):
        hit = min(c["experts"], c["rows"])
        for impl, nb in gemm_bytes(c, hit).items():
            emit(BENCH, {"section": "gemm", "impl": impl, **c}, "bytes_max", nb, "B")
    for b in batches:
        for impl, nb in logits_bytes(b, args.context).items():
            emit(
                BENCH, {"section": "logits", "impl": impl, "rows": b, "keys": args.context}, "bytes", nb, "B"
            )
    for c in topk_cases(batches, args.context):
        item = 2 if c["dtype"] == "bfloat16" else 4
        emit(BENCH, {"section": "topk", **c}, "bytes_read", c["rows"] * c["n"] * item, "B")


# --- device timing ------------------------------------------------------------------------------------


def cuda_time(reps: int, fn: Callable[..., Any], *args: Any, warmup: int = 3, **kw: Any) -> float:
    """Median seconds of ``fn(*args, **kw)`` by CUDA events, each call timed alone."""
    return _common.cuda_time(lambda: fn(*args, **kw), reps=reps, warmup=warmup)


def have(lib: str, section: str) -> bool:
    ok = importlib.util.find_spec(lib) is not None
    if not ok:
        emit(BENCH, {"section": section, "impl": lib}, "skipped", 1, f"{lib} not importable")
    return ok


def report(
    p: dict[str, Any], t: float, nbytes: int, bw: float, flops: float = 0.0, rate: float = 0.0
) -> None:
    emit(BENCH, p, "time_us", t * 1e6, "us")
    emit(BENCH, p, "bytes", nbytes, "B")
    emit(BENCH, p, "bandwidth", nbytes / t / 1e9, "GB/s")
    emit(BENCH, p, "copy_bandwidth_pct", 100 * nbytes / t / bw, "%")
    if flops:
        emit(BENCH, p, "tflops", flops / t / 1e12, "TFLOP/s")
        emit(BENCH, p, "matmul_rate_pct", 100 * flops / t / rate, "%")


def bench_attn(batches: list[int], bw: float, reps: int) -> None:
    from deepinfer_core.kv.formats import V32Format
    from deepinfer_kernels import get_op
    from deepinfer_kernels.libs import layouts as L

    keys, h, page = ATTN["topk"] + ATTN["window"], ATTN["heads"], 64
    for b in batches:
        nbytes = attn_bytes(b)
        p = {"section": "attn", "batch": b, "heads": h, "keys": keys}
        q = torch.randn(b, h, 512, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(b, keys, 512, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(b, keys, dtype=torch.bool, device="cuda")
        sink = torch.zeros(h, device="cuda")
        op = get_op("sink_attention_rows", "cuda")
        t = cuda_time(reps, op, q, kv, mask, None, None, sink, 512**-0.5)
        report({**p, "impl": "tilelang_sink_attention"}, t, nbytes["tilelang"], bw)
        if not have("flash_mla", "attn"):
            continue
        from deepinfer_kernels.cuda import flash_mla_adapter as fma

        ctx = 8192
        blocks = b * ctx // page
        pool = (
            V32Format().quantize(torch.randn(blocks * page, 576, device="cuda") / 4).view(blocks, page, 656)
        )
        table = torch.randperm(blocks, device="cuda").view(b, -1).to(torch.int32)
        pos = torch.stack([torch.randperm(ctx, device="cuda")[:keys] for _ in range(b)]).view(b, 1, keys)
        idx = L.flash_mla_indices(pos, table, page)
        kc = L.flash_mla_kv_cache(pool, page)
        q5 = torch.randn(b, 1, h, 576, device="cuda", dtype=torch.bfloat16)
        meta = fma.new_sched_meta()
        t = cuda_time(reps, fma.sparse_decode_raw, q5, kc, idx, sched_meta=meta)
        report({**p, "impl": "flash_mla_sparse_fp8"}, t, nbytes["flash_mla"], bw)
        tc = cuda_time(reps, L.flash_mla_indices, pos, table, page)
        emit(BENCH, {**p, "impl": "flash_mla_index_conversion"}, "time_us", tc * 1e6, "us")


def _routed_offs(rows: int, experts: int, g: torch.Generator) -> torch.Tensor:
    counts = torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts)
    return torch.cumsum(counts, 0).to(torch.int32).cuda()


def _masked_conversion(x: torch.Tensor, offs: torch.Tensor) -> Any:
    from deepinfer_kernels.libs import layouts as L

    return L.quantize_fp8_tokens(L.masked_layout(x, offs).x.view(-1, x.shape[1]))


def bench_gemm(batches: list[int], bw: float, rate: float, reps: int) -> None:
    from deepinfer_kernels import get_op
    from deepinfer_kernels.libs import layouts as L

    op = get_op("moe_grouped_gemm", "cuda")
    dg_ok = have("deep_gemm", "gemm")
    g = torch.Generator().manual_seed(0)
    weights: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    for c in gemm_cases(batches):
        e, n, k, r = c["experts"], c["n"], c["k"], c["rows"]
        if (n, k) not in weights:
            w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / 64
            weights[(n, k)] = (w, *L.quantize_fp8_blocks(w))
        w, w8, ws = weights[(n, k)]
        offs = _routed_offs(r, e, g)
        hit = int((torch.diff(offs, prepend=offs.new_zeros(1)) > 0).sum())
        x = torch.randn(r, k, device="cuda", dtype=torch.bfloat16)
        nb = gemm_bytes(c, hit)
        flops = 2 * r * n * k
        p = {"section": "gemm", **c, "experts_hit": hit}
        with _libs("none"):
            t = cuda_time(reps, op, x, w, offs)
        report({**p, "impl": "tilelang_bf16"}, t, nb["bf16"], bw, flops, rate)
        if not dg_ok:
            continue
        from deepinfer_kernels.cuda import deep_gemm_adapter as dga

        t = cuda_time(reps, dga.grouped_fp8_masked, x, w8, ws, offs)
        report({**p, "impl": "deep_gemm_fp8_masked"}, t, nb["fp8"], bw, flops, rate)
        t = cuda_time(reps, dga.grouped_fp8_contiguous, x, w8, ws, offs)
        report({**p, "impl": "deep_gemm_fp8_contiguous"}, t, nb["fp8"], bw, flops, rate)
        ta = cuda_time(reps, _masked_conversion, x, offs)
        emit(BENCH, {**p, "impl": "deep_gemm_masked_conversion"}, "time_us", ta * 1e6, "us")


def bench_logits(batches: list[int], context: int, bw: float, reps: int) -> None:
    from deepinfer_kernels import get_op
    from deepinfer_kernels.libs import layouts as L

    h, d = INDEX["heads"], INDEX["dim"]
    op = get_op("indexer_scores", "cuda")
    dg_ok = have("deep_gemm", "logits")
    for b in batches:
        p = {"section": "logits", "rows": b, "keys": context, "heads": h}
        q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(b, h, device="cuda")
        keys = torch.randn(context, d, device="cuda", dtype=torch.bfloat16)
        ks = torch.zeros(b, dtype=torch.int32, device="cuda")
        ke = torch.full((b,), context, dtype=torch.int32, device="cuda")
        nb = logits_bytes(b, context)
        with _libs("none"):
            t = cuda_time(reps, op, q, w, keys, ks, ke)
        report({**p, "impl": "tilelang_bf16"}, t, nb["bf16"], bw)
        if not dg_ok:
            continue
        from deepinfer_kernels.cuda import deep_gemm_adapter as dga

        kv = L.fp8_index_keys(keys)
        t = cuda_time(reps, dga.mqa_logits, q, w, kv, ks, ke)
        report({**p, "impl": "deep_gemm_fp8_mqa_logits"}, t, nb["fp8"], bw)
        tc = cuda_time(reps, L.fp8_index_keys, keys)
        emit(BENCH, {**p, "impl": "deep_gemm_key_conversion"}, "time_us", tc * 1e6, "us")
        blocks = b * context // L.DG_PAGED_BLOCK
        k8 = torch.randn(blocks, 64, d, device="cuda").clamp(-400, 400).to(torch.float8_e4m3fn)
        cache = L.deep_gemm_paged_cache(k8, torch.rand(blocks, 64, device="cuda"))
        table = torch.randperm(blocks, device="cuda").view(b, -1).to(torch.int32)
        ctx = torch.full((b,), context, dtype=torch.int32, device="cuda")
        qp = q.view(b, 1, h, d)
        t = cuda_time(reps, dga.paged_mqa_logits, qp, w, cache, table, ctx, context)
        report(
            {**p, "impl": "deep_gemm_fp8_paged_mqa_logits"}, t, b * context * (d + 4) + b * context * 4, bw
        )


def bench_topk(batches: list[int], context: int, bw: float, reps: int) -> None:
    ds_ok = have("deep_select", "topk")
    for c in topk_cases(batches, context):
        dt = getattr(torch, c["dtype"])
        x = torch.randn(c["rows"], c["n"], device="cuda").to(dt)
        nb = x.numel() * x.element_size()
        p = {"section": "topk", **c}
        t = cuda_time(reps, torch.topk, x, c["k"], dim=1, sorted=False)
        report({**p, "impl": "torch_topk"}, t, nb, bw)
        if ds_ok:
            from deepinfer_kernels.cuda import deep_select_adapter as dsa

            t = cuda_time(reps, dsa.topk, x, c["k"])
            report({**p, "impl": "deep_select"}, t, nb, bw)


class _libs:
    """``DEEPINFER_KERNEL_LIBS`` set for a block (the ops read it at each call)."""

    def __init__(self, value: str) -> None:
        self.value, self.prev = value, None

    def __enter__(self) -> None:
        self.prev = os.environ.get("DEEPINFER_KERNEL_LIBS")
        os.environ["DEEPINFER_KERNEL_LIBS"] = self.value

    def __exit__(self, *exc: object) -> None:
        if self.prev is None:
            os.environ.pop("DEEPINFER_KERNEL_LIBS", None)
        else:
            os.environ["DEEPINFER_KERNEL_LIBS"] = self.prev


def bench_decode(batches: list[int], context: int, steps: int) -> None:
    """The wide decode step with the libraries on vs the TileLang path: one Decoder per setting (its CUDA
    graphs are captured under that setting), mode ``glue-moe`` (graphs + the fused MoE op)."""
    from deepinfer_core.model import DeepSeekV41
    from model import wide_config
    from model_cuda import Decoder, set_mode

    if not have("deep_gemm", "decode"):
        return
    model = DeepSeekV41.from_config(
        wide_config(), seed=0, dtype=torch.bfloat16, device="cuda", init_on_device=True
    )
    first: dict[int, torch.Tensor] = {}
    for libs in ("none", "deep_gemm"):
        with _libs(libs):
            for b in batches:
                dec = Decoder(model, b, context, room=steps + 24)
                set_mode(dec.ex, "glue-moe")
                for _ in range(3):
                    dec.step()
                torch.cuda.synchronize()
                t = cuda_time(steps, dec.step, warmup=0)
                p = {"section": "decode", "libs": libs, "batch": b, "context": context, "mode": "glue-moe"}
                emit(BENCH, p, "ms_per_step", t * 1e3, "ms")
                logits = dec.step().float()  # both settings after the same steps: same position
                if libs == "none":
                    first[b] = logits
                else:
                    ref = first[b]
                    emit(
                        BENCH,
                        p,
                        "vs_tilelang_logits_rel_err",
                        float((logits - ref).norm() / ref.norm()),
                        "ratio",
                    )
                    emit(
                        BENCH,
                        p,
                        "vs_tilelang_argmax_agree",
                        float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
                        "ratio",
                    )
                del dec
                torch.cuda.empty_cache()


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=8192, help="keys a row (indexer, top-k) / decode context")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--dry-run", action="store_true", help="print the cases and their bytes only (any machine)"
    )
    args = ap.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise SystemExit(f"--sections: unknown {bad} (allowed: {', '.join(SECTIONS)})")
    if args.quick:
        args.batches, args.context, args.steps = "1,8", 2048, 4
    if args.dry_run:
        dry_run(args)
        return
    if not torch.cuda.is_available():
        emit(BENCH, {"sections": sections}, "skipped", 1, "needs a CUDA device")
        return
    from model_cuda import copy_bandwidth, matmul_rate

    batches = [int(x) for x in args.batches.split(",")]
    reps = 5 if args.quick else 20
    bw, rate = copy_bandwidth(), matmul_rate()
    base = {"device": torch.cuda.get_device_name()}
    emit(BENCH, base, "copy_bandwidth_read_plus_write", bw / 1e9, "GB/s")
    emit(BENCH, base, "bf16_matmul_rate", rate / 1e12, "TFLOP/s")
    for name, fn in (
        ("attn", lambda: bench_attn(batches, bw, reps)),
        ("gemm", lambda: bench_gemm(batches, bw, rate, reps)),
        ("logits", lambda: bench_logits(batches, args.context, bw, reps)),
        ("topk", lambda: bench_topk(batches, args.context, bw, reps)),
        ("decode", lambda: bench_decode(batches, min(args.context, 4096), args.steps)),
    ):
        if name in sections:
            log(f"kernel_libs: {name}")
            try:
                fn()
            except Exception as e:  # one section's failure (a library's assert) must not lose the others
                emit(BENCH, {"section": name}, "failed", 1, f"{type(e).__name__}: {e}"[:300])


if __name__ == "__main__":
    main()
