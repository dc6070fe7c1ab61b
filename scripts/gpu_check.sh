#!/usr/bin/env bash
# One-shot GPU check for the lead's device call (H200): install, GPU tests, kernel benchmarks, summary.
#
# Run from the repository root on the device, with ".gpu" in the run's carry (the site archive is
# gitignored):   bash scripts/gpu_check.sh
# Writes at most 8 files, flat, into $OUT (or ./gpu_out without $OUT):
#   summary.txt  device, versions, step times, test counts + failures, variant comparison (also printed)
#   pip.log  pytest.log  junit.xml  bench.jsonl (one JSON line per measurement)  bench.err (table, logs)
#   bench.json (rows, written when the benchmark finishes)  others.log (fast parts of other benchmarks)
# Budget: about 6 minutes wall (GPU_CHECK_BUDGET_S); each step gets what is left of it and is cut (SIGINT,
# then KILL) at the deadline; every step runs whatever the previous ones did (no set -e).
# GPU_CHECK_TESTS (default: tests/) and GPU_CHECK_BENCH (default: kv,small,spec) narrow a run to the
# tests and benchmark sections a change touched; GPU_CHECK_REST=0 skips the remaining benchmarks.
set +e
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-355}
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
SUM="$OUT/summary.txt"
: >"$SUM"
say() { echo "$*" | tee -a "$SUM"; }
step() {  # step NAME MAX_S CMD...: run CMD with min(MAX_S, budget left) seconds, log the time and exit code
  local name=$1 max=$2
  shift 2
  local l
  l=$(left)
  [ "$max" -lt "$l" ] || max=$l
  if [ "$max" -le 5 ]; then
    say "step $name: skipped (budget spent)"
    return 0
  fi
  local s=$SECONDS
  timeout -s INT -k 10 "$max" "$@"
  local rc=$?
  say "step $name: rc=$rc in $((SECONDS - s)) s (limit $max s)"
}

say "== gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "$(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader 2>&1 | head -2)"

# 1. site packages (tilelang, tile-kernels, xgrammar, ...): carried as .gpu/site.tar.xz
mkdir -p /tmp/site && tar xJf .gpu/site.tar.xz -C /tmp/site
say "step site: rc=$? ($(ls /tmp/site | wc -l) entries)"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

# 2. the package (C++ extension built here)
step pip 150 python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/pip.log" 2>&1
say "$(python3 -c 'import torch, tilelang; print("torch", torch.__version__, "cuda", torch.version.cuda, "tilelang", tilelang.__version__)' 2>&1 | tail -1)"

# 3. every GPU test (kernels vs references, both variants of each new kernel)
step pytest ${GPU_CHECK_PYTEST_S:-200} python3 -m pytest -m gpu ${GPU_CHECK_TESTS:-tests/} -q -n 8 -p no:cacheprovider -rfE --durations=10 \
  --junitxml="$OUT/junit.xml" >"$OUT/pytest.log" 2>&1

# 4. kernel benchmarks: the variant comparisons first (kv, engram gather, spec), then the rest if time is left
step bench 200 python3 -u benchmarks/kernels.py --only "${GPU_CHECK_BENCH:-kv,small,spec}" --no-reference --json-out "$OUT/bench.json" \
  >"$OUT/bench.jsonl" 2>"$OUT/bench.err"
[ "${GPU_CHECK_REST:-1}" = 0 ] || step bench_rest 60 python3 -u benchmarks/kernels.py --only bitmask,sampling --no-reference >>"$OUT/bench.jsonl" 2>>"$OUT/bench.err"
: >"$OUT/others.log"
for b in mtp_varlen engram; do  # fast parts of the other GPU benchmarks
  [ "${GPU_CHECK_REST:-1}" = 0 ] || step "$b --quick" 40 python3 -u "benchmarks/$b.py" --quick >>"$OUT/others.log" 2>&1
done

# 5. summary: test counts and failures, then each kernel variant's bandwidth side by side
python3 - "$OUT" 2>&1 <<'PY' | tee -a "$SUM"
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
try:
    root = ET.parse(out / "junit.xml").getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    print("tests:", tot)
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            msg = (bad.get("message") or "").splitlines()[0][:160] if bad.get("message") else ""
            print(f"  FAIL {case.get('classname')}::{case.get('name')}: {msg}")
except Exception as e:  # the run was cut before pytest wrote its report
    print("tests: no junit report:", e)
    log = out / "pytest.log"
    if log.exists():
        print("  pytest.log tail:", *log.read_text().splitlines()[-5:], sep="\n  ")
rows = {}
for line in (out / "bench.jsonl").read_text().splitlines() if (out / "bench.jsonl").exists() else []:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    key = r["bench"] + " " + ",".join(f"{k}={v}" for k, v in r.get("params", {}).items())
    rows.setdefault(key, {})[r["metric"]] = r["value"]
if rows:
    print("bench (us, GB/s, % of d2d copy):")
    for name, m in rows.items():
        if name.startswith(("kv_", "engram_gather", "spec_verify", "ceiling", "d2d_copy")):
            vals = ", ".join(f"{k}={v:.1f}" for k, v in m.items())
            print(f"  {name}: {vals}")
else:
    print("bench: no rows")
# verdict per kernel variant: its tests (pytest ids carry the variant) and its time against the default's
import re
try:
    cases = [(c.get("name", ""), bool(c.findall("failure") or c.findall("error")), bool(c.findall("skipped"))) for c in root.iter("testcase")]
except Exception:
    cases = []
times = {k: m.get("time_us") for k, m in rows.items()}
for var, default in (("group2", "group"), ("group4", "group"), ("division_codec", "group"), ("select_codec", "group"), ("lanes", "group"), ("bf16x2i4", "group"), ("vec", "rows")):
    mine = [c for c in cases if re.search(rf"[\[-]{var}[\]-]", c[0])]
    ok = sum(1 for c in mine if not c[1] and not c[2])
    bad = sum(1 for c in mine if c[1])
    line = f"variant {var}: tests {ok} passed, {bad} failed"
    for k, t in times.items():
        name, _, prm = k.partition(" ")
        base = None
        if name.endswith(f"_{var}") and default == "group":
            base = name[: -len(var) - 1] + " " + prm
        elif name.endswith(f"_{var}"):
            base = name[: -len(var)] + default + " " + prm
        if base in times and t and times[base]:
            line += f"; {name}: {t:.1f} vs {times[base]:.1f} us ({times[base] / t:.2f}x)"
    print(line)
PY
say "== total $((SECONDS - T0)) s"
