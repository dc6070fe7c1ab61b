#!/usr/bin/env bash
# One device call for issue #24 (H200): build, GPU tests, the wide-config decode / prefill benchmark and
# the engine benchmark, each optional and time-boxed. Run from the repository root with ".gpu" carried
# (the site archive from ../shared/tools/gpu-site.sh):
#   PYTEST_S=200 BENCH_S=240 ENGINE_S=150 bash scripts/device_24.sh
# Knobs: BENCH_FIRST=1 (the decode benchmark before the GPU tests), GG_S (seconds for the grouped GEMM sweep, benchmarks/grouped_gemm.py; its tuned table is used by
# the later sections via DEEPINFER_GG_CONFIGS; its lines go to bench.jsonl), TESTS (pytest paths), MODES / BATCHES / STEPS / PROFILE / BENCH_ARGS (benchmarks/model_cuda.py),
# (STEPS default 48: the first step's host issue, before the GPU has work, is spread over the timed steps;
# over 8 it may be part of the 0.22 ms by which the 2026-12-03 loop exceeded back-to-back replays), ENGINE_ARGS (benchmarks/engine_cuda.py), INV_S (seconds for the tiny model's batch-invariance section, a
# second engine_cuda.py run appended to engine.jsonl). At most 8 files under $OUT (a call returns no more):
# pytest.log, bench.jsonl, bench.err, profiles.txt, host_profile.txt, engine.jsonl, engine.err, engine_cuda.png.
set +e
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT" /tmp/site
T0=$SECONDS
tar xJf .gpu/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-build-isolation --no-deps -e . >/tmp/pip.log 2>&1 || tail -20 /tmp/pip.log
echo "pip done at $((SECONDS - T0)) s"
if [ "${GG_S:-0}" -gt 0 ]; then
  # the grouped GEMM sweep first; its best configs (a tuned table) are used by every later section
  timeout -s INT -k 10 "$GG_S" python3 -u benchmarks/grouped_gemm.py --budget-s "$((GG_S - 30))" \
    --write /tmp/gg_configs.json >>"$OUT/bench.jsonl" 2>>"$OUT/bench.err"
  echo "gg rc=$? at $((SECONDS - T0)) s"
  [ -s /tmp/gg_configs.json ] && export DEEPINFER_GG_CONFIGS=/tmp/gg_configs.json && cat /tmp/gg_configs.json | tr -d ' \n'; echo
  grep -E '"bench": "grouped_gemm_(best|table)"' "$OUT/bench.jsonl" | cut -c1-420
fi
run_pytest() {
  [ "${PYTEST_S:-0}" -gt 0 ] || return 0
  timeout -s INT -k 10 "$PYTEST_S" python3 -m pytest -m gpu ${TESTS:-tests/} -q -n 8 -p no:cacheprovider -rfE \
    --durations=15 >"$OUT/pytest.log" 2>&1
  echo "pytest rc=$? at $((SECONDS - T0)) s"
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest.log" | tail -12
}
# BENCH_FIRST=1: the decode benchmark before the GPU tests (a short call keeps the number if cut)
[ "${BENCH_FIRST:-0}" = 1 ] || run_pytest
if [ "${BENCH_S:-0}" -gt 0 ]; then
  timeout -s INT -k 10 "$BENCH_S" python3 -u benchmarks/model_cuda.py --batches "${BATCHES:-1,8,64}" --steps "${STEPS:-48}" \
    --graphs "${MODES:-off,on,glue}" --profile-batches "${PROFILE:-1,64}" --out "$OUT" ${BENCH_ARGS:-} \
    >>"$OUT/bench.jsonl" 2>>"$OUT/bench.err"
  echo "bench rc=$? at $((SECONDS - T0)) s"
fi
[ "${BENCH_FIRST:-0}" = 1 ] && run_pytest
if [ "${ENGINE_S:-0}" -gt 0 ]; then
  timeout -s INT -k 10 "$ENGINE_S" python3 -u benchmarks/engine_cuda.py --plot --out "$OUT" ${ENGINE_ARGS:-} \
    >"$OUT/engine.jsonl" 2>"$OUT/engine.err"
  echo "engine rc=$? at $((SECONDS - T0)) s"
  grep -v TileLang "$OUT/engine.err" | grep -E "tok/s|Error|error" | tail -20
fi
if [ "${INV_S:-0}" -gt 0 ]; then
  timeout -s INT -k 10 "$INV_S" python3 -u benchmarks/engine_cuda.py --model tiny --batches "" --invariance --gen 12 \
    >>"$OUT/engine.jsonl" 2>>"$OUT/engine.err"
  echo "invariance rc=$? at $((SECONDS - T0)) s"
  grep -E "batch_invariant" "$OUT/engine.jsonl" | tail -4
fi
python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
keep = ("ms_per_step", "replay_ms_per_step", "host_issue_ms_per_step", "roofline_pct", "gpu_ms_per_step", "gpu_kernels_per_step", "warmup_s", "vs_eager_logits_rel_err",
        "vs_eager_argmax_agree", "prefill_ms", "prefill_pct_of_matmul_rate", "prefill_gemm_part_pct_of_matmul_rate",
        "bf16_matmul_rate", "prefill_gemm_share_of_gpu_time")
try:
    for line in open(sys.argv[1]):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r["metric"] in keep:
            p = r["params"]
            print(f'B={p.get("batch", p.get("tokens"))} {p.get("mode", "-"):6s} {r["metric"]:26s} {r["value"]:.4g}')
except FileNotFoundError:
    pass
PY
grep -v TileLang "$OUT/bench.err" | grep -iE "error|Traceback" | tail -5
