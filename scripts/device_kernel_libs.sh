#!/usr/bin/env bash
# One device call of issue #36 (FlashMLA / DeepGEMM / DeepSelect on the H200): set up, then the steps
# named, each cut at its share of KLIBS_BUDGET_S (default 570 s; a call has 600).
#
#   bash scripts/device_kernel_libs.sh build [LIB ...]   # build (default flash_mla deep_gemm; deep_select if packed)
#   bash scripts/device_kernel_libs.sh test               # the libraries' GPU tests + CPU byte checks
#   bash scripts/device_kernel_libs.sh bench [ARGS ...]   # benchmarks/kernel_libs.py ARGS
#   bash scripts/device_kernel_libs.sh check              # versions and imports only
#
# Carry ".gpu" (site.tar.xz with tilelang etc. as for scripts/gpu_check.sh, kernel_src.tar.xz from
# `scripts/build_kernel_libs.sh pack`, and any klib_<lib>.tar.xz kept from an earlier build). A warm
# machine keeps build/kernel_libs (sources, builds, installed libraries, DeepGEMM's JIT cache) and the
# editable install between calls. Writes at most 8 flat files to $OUT (summary.txt + each step's own).
set +e
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-$ROOT/build/kernel_libs/out}
mkdir -p "$OUT"
BUDGET=${KLIBS_BUDGET_S:-570}
T0=$SECONDS
SUM="$OUT/summary.txt"
say() { echo "$*" | tee -a "$SUM"; }
left() { echo $((BUDGET - (SECONDS - T0))); }

say "== device_kernel_libs $* $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
if [ ! -f /tmp/site/.ok ]; then  # the project's own site packages and editable install, once a machine
  mkdir -p /tmp/site && tar xJf .gpu/site.tar.xz -C /tmp/site && touch /tmp/site/.ok
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c 'import deepinfer_core._C' 2>/dev/null; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/pip.log" 2>&1
  say "pip install -e .: rc=$? ($((SECONDS - T0)) s)"
fi
bash scripts/build_kernel_libs.sh install >/dev/null 2>>"$SUM"  # kept klib archives, if any
eval "$(bash scripts/build_kernel_libs.sh env)"
export PYTHONUNBUFFERED=1

sub=${1:-check}
[ $# -gt 0 ] && shift
case $sub in
  build)
    libs=("$@")
    if [ ${#libs[@]} -eq 0 ]; then
      libs=(flash_mla deep_gemm)
      tar -tJf .gpu/kernel_src.tar.xz kernel_src/DeepSelect/setup.py >/dev/null 2>&1 && libs+=(deep_select)
    fi
    todo=()
    for lib in "${libs[@]}"; do  # a library installed from a kept archive or built earlier is skipped
      [ -d "build/kernel_libs/site_$lib" ] && say "$lib: already installed" || todo+=("$lib")
    done
    for lib in "${todo[@]}"; do  # one library at a time, each cut at what is left of the call
      [ "$(left)" -gt 60 ] || { say "$lib: no time left in this call (call build again)"; continue; }
      KLIBS_BUILD_TIMEOUT_S=$(($(left) - 30)) OUT=$OUT bash scripts/build_kernel_libs.sh build "$lib" 2>&1 | tee -a "$SUM"
    done
    bash scripts/build_kernel_libs.sh check 2>&1 | tee -a "$SUM"
    ;;
  test)
    bash scripts/build_kernel_libs.sh unpack >/dev/null 2>&1  # the CPU byte checks read the sources
    bash scripts/build_kernel_libs.sh check 2>&1 | tee -a "$SUM"
    timeout -s INT -k 10 $(($(left) - 10)) python3 -m pytest -q -p no:cacheprovider -rfEs --durations=15 \
      tests/deepinfer_kernels/test_kernel_libs_gpu.py tests/deepinfer_kernels/test_lib_reference_bytes.py \
      tests/deepinfer_kernels/test_lib_layouts.py tests/deepinfer_kernels/test_lib_switch.py \
      tests/deepinfer_kernels/test_kernel_libs_engine_gpu.py tests/deepinfer_kernels/test_cuda_adapters.py \
      --junitxml="$OUT/junit.xml" >"$OUT/pytest.log" 2>&1
    say "pytest: rc=$? ($((SECONDS - T0)) s); $(tail -1 "$OUT/pytest.log")"
    grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest.log" | head -40 | tee -a "$SUM"
    ;;
  bench)
    timeout -s INT -k 10 $(($(left) - 10)) python3 -u benchmarks/kernel_libs.py "$@" >"$OUT/bench.jsonl" 2>"$OUT/bench.err"
    say "bench: rc=$? ($((SECONDS - T0)) s), $(wc -l <"$OUT/bench.jsonl") lines"
    python3 - "$OUT/bench.jsonl" <<'PY' | tee -a "$SUM"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    if r["metric"] in ("time_us", "copy_bandwidth_pct", "ms_per_step", "skipped", "failed", "vs_tilelang_argmax_agree"):
        p = {k: v for k, v in r["params"].items() if k not in ("device",)}
        print(f'{r["metric"]:>24} {r["value"]:>12.4g} {r["unit"]:<8} {json.dumps(p)}')
PY
    ;;
  check)
    bash scripts/build_kernel_libs.sh check 2>&1 | tee -a "$SUM"
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tee -a "$SUM"
    ;;
  *) sed -n '2,8p' "$0"; exit 2 ;;
esac
say "== done in $((SECONDS - T0)) s"
