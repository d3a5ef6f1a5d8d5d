#!/usr/bin/env bash
# The GPU check, in one run, on a machine with one NVIDIA GPU (an H200), no internet and only
# this checkout (fastcl need not be installed; torch, triton, numpy, matplotlib must be):
#
#   1. tests     python -m pytest tests/test_triton.py -q -rs   (the GPU-only tests included)
#   2. targets   python bench/run.py --targets   (the Triton kernels' acceptance targets)
#   3. bench     python bench/run.py --full --time-budget ...   (the sweep, cut from its end
#                                                               when the budget is spent)
#
# Usage:
#   bash bench/gpu_check.sh              # on the GPU machine, from anywhere
#   bash bench/gpu_check.sh --dry-run    # CPU: the same stages at tiny sizes, results in
#                                        # $RESULTS_DIR (default /tmp/fastcl-gpu-check-dry)
#
# Results: bench/results/<gpu>-<date>.{json,csv}, <gpu>-<date>-{time,memory,pct}.png,
# <gpu>-<date>-targets.{json,csv}, <gpu>-<date>-gpu-check.json (what each stage did, the
# pytest summary and log tail, the targets, the headline) and one .log per stage. When $OUT
# is set, the JSON, CSV and PNG files (8 at most, all small, no folders) are copied into it.
#
# Time: the whole script stays under $DEADLINE seconds (default 400, i.e. under 7 minutes).
# Each stage runs under `timeout` with the smaller of its own limit and the time left, so a
# hang cannot eat the budget; the benchmark also stops starting new cases at its own
# --time-budget and still writes its table and plots.
#
# Exit status: 0 unless a stage failed to run — a test failure, a crash, a stage killed by
# its timeout. A missed target is reported (FAIL in the output and the JSON), not an error.

set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
DEADLINE=${DEADLINE:-400}

# A python that has torch (on the GPU image a plain python3 is the one).
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for c in python3 python; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then PY=$c; break; fi
    done
fi
if [ -z "$PY" ]; then echo "no python with torch found" >&2; exit 2; fi

# fastcl from this checkout: bench/_checkout.py maps kernels/ to fastcl.kernels when fastcl is
# not installed (run.py imports it; pytest loads it as a plugin with -p _checkout).
export PYTHONPATH="$ROOT/bench:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export MPLBACKEND=Agg
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ $DRY -eq 0 ]; then unset TRITON_INTERPRET; fi

DATE=$(date +%F)
if [ $DRY -eq 1 ]; then
    RES=${RESULTS_DIR:-/tmp/fastcl-gpu-check-dry}
    DEV=cpu-dry-run
else
    RES=${RESULTS_DIR:-$ROOT/bench/results}
    DEV=$("$PY" - <<'EOF'
import re, torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no-cuda"
print(re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"))
EOF
)
fi
mkdir -p "$RES"
STEM="$RES/$DEV-$DATE"
SUMMARY_TSV=$(mktemp)
ERRORS=0

echo "== fastcl GPU check: $DEV, $PY, deadline ${DEADLINE}s, results in $RES"
if [ $DRY -eq 0 ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
    if [ "$DEV" = "no-cuda" ]; then
        echo "no CUDA device visible to $PY (use --dry-run on a CPU machine)" >&2
        exit 2
    fi
fi

# stage NAME LIMIT_S TAIL COMMAND...: run under timeout (the smaller of LIMIT_S and the time
# left) with its output in $STEM-NAME.log (a file, not a pipe: a stray child process cannot
# hold the script up), print the log's last TAIL lines, record rc and seconds.
stage() {
    local name=$1 limit=$2 tail_lines=$3
    shift 3
    local left=$((DEADLINE - SECONDS - 15))
    local t=$((limit < left ? limit : left))
    if [ "$t" -lt 30 ]; then
        echo "== $name: skipped (only ${left}s left of the ${DEADLINE}s deadline)"
        printf '%s\tskipped\t0\t%s\n' "$name" "$t" >>"$SUMMARY_TSV"
        return 0
    fi
    echo "== $name (timeout ${t}s): $*"
    local start=$SECONDS
    timeout -k 20 "$t" "$@" >"$STEM-$name.log" 2>&1 </dev/null
    local rc=$?
    local took=$((SECONDS - start))
    tail -n "$tail_lines" "$STEM-$name.log" | cut -c1-220
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$t" >>"$SUMMARY_TSV"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "== $name: TIMED OUT after ${took}s (limit ${t}s)"
    else
        echo "== $name: exit $rc after ${took}s"
    fi
    if [ "$rc" -ne 0 ]; then ERRORS=1; fi
    return 0
}

# 1. tests. Parallel workers (pytest-xdist, when installed) compile the Triton variants on
# several cores; the compiled kernels land in Triton's cache for the two stages after.
XDIST=()
if [ $DRY -eq 0 ] && "$PY" -c "import xdist" >/dev/null 2>&1; then XDIST=(-n 6); fi
TESTS=(tests/test_triton.py -q -rs -p _checkout -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"})
if [ $DRY -eq 1 ]; then TESTS+=(-k "gpu"); fi         # CPU: only the (skipped) GPU tests
stage pytest 150 25 "$PY" -m pytest "${TESTS[@]}"

# 2. targets
if [ $DRY -eq 1 ]; then
    TARGET_ARGS=(--device cpu --target-n 512 --target-big-n 1024 --threads 1)
else
    TARGET_ARGS=()
fi
stage targets 100 20 "$PY" bench/run.py --targets --out-stem "$STEM-targets" \
    ${TARGET_ARGS[@]+"${TARGET_ARGS[@]}"}

# 3. the benchmark: it stops starting cases 60 s before its stage limit, then writes outputs
LEFT=$((DEADLINE - SECONDS - 25))
BENCH_LIMIT=$((LEFT < 240 ? LEFT : 240))
BUDGET=$((BENCH_LIMIT - 60 > 20 ? BENCH_LIMIT - 60 : 20))
if [ $DRY -eq 1 ]; then
    BENCH_ARGS=(--device cpu --objective infonce,noise --impl fastcl,reference,mnrl --n 256,512
                --d 64 --e2e-n 8 --e2e-encoder tiny --threads 1)
else
    BENCH_ARGS=(--full)
fi
stage bench "$BENCH_LIMIT" 22 "$PY" bench/run.py "${BENCH_ARGS[@]}" --time-budget "$BUDGET" \
    --out-stem "$STEM"

# Summary JSON: stages, pytest's summary and tail, the targets; then copy the results to $OUT.
"$PY" - "$SUMMARY_TSV" "$STEM" "$DEADLINE" "$SECONDS" "$DRY" <<'EOF'
import json, re, sys
from pathlib import Path

tsv, stem, deadline, elapsed, dry = sys.argv[1:6]
stages = []
for line in Path(tsv).read_text().splitlines():
    name, rc, took, limit = line.split("\t")
    status = ("skipped" if rc == "skipped" else "ok" if rc == "0" else
              "timed out" if rc in ("124", "137") else f"exit {rc}")
    stages.append({"stage": name, "status": status, "exit_code": None if rc == "skipped" else int(rc),
                   "seconds": int(took), "limit_s": int(limit)})
out = {"stem": stem, "dry_run": dry == "1", "deadline_s": int(deadline), "elapsed_s": int(elapsed),
       "stages": stages}
log = Path(f"{stem}-pytest.log")
if log.exists():
    lines = log.read_text(errors="replace").splitlines()
    summary = [l for l in lines if re.search(r"\d+ (passed|failed|skipped|error)", l)]
    out["pytest_summary"] = summary[-1].strip("= ") if summary else None
    out["pytest_tail"] = lines[-150:]
targets = Path(f"{stem}-targets.json")
if targets.exists():
    t = json.loads(targets.read_text())
    out["targets"] = t.get("targets")
    out["environment"] = t.get("environment")
bench = Path(f"{stem}.json")
if bench.exists():
    b = json.loads(bench.read_text())
    out["bench_interrupted"] = b.get("interrupted")
    out["bench_headline"] = b.get("headline")
    out["bench_rows"] = len(b.get("results", []))
    out["bench_skipped_by_budget"] = sum("time budget" in str(r.get("error", ""))
                                         for r in b.get("results", []))
Path(f"{stem}-gpu-check.json").write_text(json.dumps(out, indent=1) + "\n")
print("== stages: " + "; ".join(f"{s['stage']} {s['status']} ({s['seconds']}s)" for s in stages))
if out.get("pytest_summary"):
    print("== pytest: " + out["pytest_summary"])
for t in out.get("targets") or []:
    v = t["value"]
    shown = "-" if v is None else (f"{100 * v:.1f}%" if "fraction" in t["target"] else f"{v:.2f}x")
    print(f"== target [{t['result']}] {t['target']}: {shown} (goal {t['goal']})")
EOF

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    n=0
    for f in "$STEM-gpu-check.json" "$STEM-targets.json" "$STEM.json" "$STEM-time.png" \
             "$STEM-memory.png" "$STEM-pct.png" "$STEM.csv" "$STEM-targets.csv"; do
        if [ -f "$f" ] && [ "$n" -lt 8 ] && [ "$(stat -c %s "$f")" -le 16777216 ]; then
            cp "$f" "$OUT/" && n=$((n + 1))
        fi
    done
    echo "== copied $n files to \$OUT"
fi
rm -f "$SUMMARY_TSV"
echo "== done in ${SECONDS}s (deadline ${DEADLINE}s); exit $ERRORS"
exit $ERRORS
