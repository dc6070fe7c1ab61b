#!/usr/bin/env bash
# The device calls of issue #32 (the engine on the H200 at its executor's speed), one section a call:
#   bash scripts/device_32.sh SECTION [SECTION ...]
# from the repository root on the GPU machine, with ".gpu" carried (the site archive of
# ../shared/tools/gpu-site.sh). Every section is time-boxed (SECTION_S, default 540 s for the whole call)
# and writes flat files into $OUT (at most 8 come back). Issue the calls back to back: a warm machine keeps
# the editable install and TileLang's compile cache (~/.tilelang), so only the first call compiles.
#
# Sections, in the order a session should run them (numbers first, so a cut call still returns them):
#   engine     benchmarks/engine_cuda.py: engine efficiency (decode tokens/s over B / graph-replay ms) of the
#              tiny model at B = 1, 16, 64, 256, async, greedy and seeded-sampled; GPU starved time; plot
#   wide       the same for the wide config (B = 1, 16, 64, 256; async; greedy and sampled)
#   e2e        the wide model end to end at B = 64, 1,024-token prompts, 256 output tokens: e2e_fraction_of_bound
#              (the executor-only bound: its prefill chunks alone + 255 decode steps at the replay rate)
#   spec       speculation on the trained tiny model at B = 1, 4, 16, 64, 256 (compare with the engine
#              section's async rows: >= 1.5x plain at B = 1, >= 1.0x at B = 64; tokens as returned)
#   plot       the throughput-vs-interactivity plot of engine.jsonl so far (plain and speculative)
#   invariant  batch-invariant mode at batch speed: tokens/s default / invariant / per-request at B = 16, 64,
#              20 mixes x 2 runs bit-identical (tiny), cost only (wide)
#   prefill    prefill paths (tiled vs varlen, benchmarks/prefill_batching.py): kernel launches, TTFT vs
#              prompt length (plot), 1 x 8192 and 16 x 512 on the wide config, GEMM share of the matmul rate
#   sampling   the sort-free top-k / top-p threshold vs the sort, B = 1..256 x 129,280 (CUDA events)
#   tests-a    pytest -m gpu, tests/deepinfer_kernels (TileLang kernels)
#   tests-b    pytest -m gpu, tests/deepinfer_core and the rest
# Files: engine.jsonl engine.err engine_cuda.png (engine, wide, spec, invariant), bench.jsonl bench.err
# (prefill, sampling), pytest.log, summary.txt.
set +e
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT" /tmp/site
T0=$SECONDS
BUDGET=${SECTION_S:-540}
SUM="$OUT/summary.txt"
say() { echo "$*" | tee -a "$SUM"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
boxed() {  # boxed NAME CMD...: CMD with what is left of the call's budget, then SIGINT, then KILL
  local name=$1 l
  shift
  l=$(left)
  if [ "$l" -le 10 ]; then
    say "$name: skipped (no time left)"
    return 0
  fi
  timeout -s INT -k 10 "$l" "$@"
  say "$name: rc=$? at $((SECONDS - T0)) s"
}
if ! python3 -c "import deepinfer_core._C" 2>/dev/null; then
  tar xJf .gpu/site.tar.xz -C /tmp/site
  export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  python3 -m pip install -q --no-build-isolation --no-deps -e . >/tmp/pip.log 2>&1 || tail -20 /tmp/pip.log
else
  export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
say "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader) | setup at $((SECONDS - T0)) s"
EC="python3 -u benchmarks/engine_cuda.py --plot --out $OUT"
for section in "$@"; do
  case "$section" in
    engine)
      boxed engine $EC --model tiny --batches 1,16,64,256 --modes async --sampling greedy,sampled --gen 128 \
        --prompt 64 >>"$OUT/engine.jsonl" 2>>"$OUT/engine.err"
      grep -E '"engine_efficiency"|"gpu_idle_starved_pct"' "$OUT/engine.jsonl" | cut -c1-300 | tee -a "$SUM"
      ;;
    wide)
      boxed wide $EC --model wide --batches 1,16,64,256 --modes async --sampling greedy,sampled --gen 64 \
        --prompt 1024 >>"$OUT/engine.jsonl" 2>>"$OUT/engine.err"
      grep -E '"model": "wide".*"(engine_efficiency|gpu_idle_starved_pct)"' "$OUT/engine.jsonl" | cut -c1-300 | tee -a "$SUM"
      ;;
    e2e)
      boxed e2e $EC --model wide --batches 64 --modes async --gen 256 --prompt 1024 \
        >>"$OUT/engine.jsonl" 2>>"$OUT/engine.err"
      grep -E '"(e2e_fraction_of_bound|executor_prefill_s)"' "$OUT/engine.jsonl" | cut -c1-300 | tee -a "$SUM"
      ;;
    spec)
      boxed spec $EC --model tiny --batches 1,4,16,64,256 --modes spec --gen 128 --prompt 64 \
        >>"$OUT/engine.jsonl" 2>>"$OUT/engine.err"
      grep -E '"mode": "(sync|spec)".*"tokens_per_s_per_gpu"' "$OUT/engine.jsonl" | cut -c1-300 | tee -a "$SUM"
      ;;
    invariant)
      boxed invariant python3 -u benchmarks/engine_cuda.py --model tiny --batches "" --invariance \
        --invariance-batches 16,64 --gen 32 --prompt 64 >>"$OUT/engine.jsonl" 2>>"$OUT/engine.err"
      boxed invariant-wide python3 -u benchmarks/engine_cuda.py --model wide --batches "" --invariance \
        --invariance-batches 64 --gen 32 --prompt 64 --invariance-only-cost >>"$OUT/engine.jsonl" 2>>"$OUT/engine.err"
      grep -E 'ratio_to_default|batch_invariant_identical' "$OUT/engine.jsonl" | cut -c1-300 | tee -a "$SUM"
      ;;
    prefill)
      boxed prefill python3 -u benchmarks/prefill_batching.py --device cuda --configs wide,tiny \
        --shapes 1x8192,16x512 --ttft 512,1024,2048,4096,8192,16384 --plot >>"$OUT/bench.jsonl" 2>>"$OUT/bench.err"
      cp benchmarks/out/prefill_ttft_*.png "$OUT/" 2>/dev/null
      grep -E 'ttft_ms|pct_of_matmul_rate|kernel_launches' "$OUT/bench.jsonl" | cut -c1-300 | tee -a "$SUM"
      ;;
    sampling)
      boxed sampling python3 -u benchmarks/sampling.py --device cuda --batches 1,16,64,256 --logits gauss,peaked \
        >>"$OUT/bench.jsonl" 2>>"$OUT/bench.err"
      grep -E '"sampling"' "$OUT/bench.jsonl" | grep -E '"batch": 256' | cut -c1-300 | tee -a "$SUM"
      ;;
    plot)  # the throughput-vs-interactivity plot of everything recorded so far (engine + spec sections)
      python3 benchmarks/engine_cuda.py --replot "$OUT/engine.jsonl" --out "$OUT" 2>&1 | tail -2 | tee -a "$SUM"
      ;;
    tests-a | tests-b)
      paths="tests/deepinfer_kernels"
      [ "$section" = tests-b ] && paths="tests/deepinfer_core tests/test_*.py"
      boxed "$section" python3 -m pytest -m gpu $paths -v -p no:randomly -p no:cacheprovider -n 8 -rfE \
        --durations=15 >>"$OUT/pytest.log" 2>&1
      grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest.log" | tail -15 | tee -a "$SUM"
      ;;
    *)
      say "unknown section $section (engine wide e2e spec plot invariant prefill sampling tests-a tests-b)"
      ;;
  esac
done
say "done at $((SECONDS - T0)) s"
