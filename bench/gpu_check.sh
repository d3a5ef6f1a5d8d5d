#!/usr/bin/env bash
# The GPU check: everything a GPU machine must tell about fastcl's kernels, in one run of at
# most $DEADLINE seconds (default 300), on a machine with one NVIDIA GPU (an H200), no
# internet and only this checkout (fastcl need not be installed; torch, triton, numpy and
# matplotlib must be; pytest-xdist is used when present). Stages, most decisive first:
#
#   env          bench/run.py --env         versions, GPU, whether 16-bit GEMMs write fp32
#   targets      bench/run.py --targets     the acceptance targets, PASS/FAIL with numbers
#   ab           bench/ab.py                the current design vs FASTCL_SIM=descriptor (the
#                                           candidate similarity kernel) and each FASTCL_LEGACY switch;
#                                           the time of every config autotuning tried
#   profile      bench/profile_step.py      kernel families and launches, current vs legacy
#   tests-gpu    pytest tests/test_triton.py -k gpu        (the GPU-only tests, the
#                                                           descriptor design's among them)
#   tests-small  pytest tests/test_triton.py -k "not gpu"  (both with FASTCL_AUTOTUNE=0:
#                                                           bounded compile time)
#   sweep        bench/run.py --quick       with whatever time is left (none under 30 s)
#
# Usage:
#   bash bench/gpu_check.sh              # on the GPU machine, from anywhere
#   bash bench/gpu_check.sh --dry-run    # a CPU-only machine: the same stages at tiny sizes,
#                                        # one thread, a few small tests in Triton's interpreter
#                                        # (about 80 s); results in $RESULTS_DIR (default
#                                        # /tmp/fastcl-gpu-check-dry, not bench/results)
#
# Results: every file of the run is $STEM-<what>, STEM = bench/results/<gpu>-<date>: -env.json,
# -targets.{json,csv}, -ab.{json,csv}, -profile.json, -sweep.{json,csv}, -sweep-*.png, one
# .log per stage, and -gpu-check.json, the summary: each stage's status and seconds, the
# environment, the targets, the A/B table, the profile breakdown, the pytest counts, failing
# tests and log tails, the sweep's headline. Each stage writes its files as it goes, so a stage
# cut short by its timeout keeps what it measured.
# With $OUT set (a dry run defaults it to $RESULTS_DIR/out): $OUT/gpu-check.json,
# $OUT/results.tgz (every file this run wrote, logs included) and the sweep's PNGs; 8 files
# at most, no folders.
#
# Time: each stage runs under `timeout` with the smaller of its own limit and the time left
# (20 s are kept for the summary); the Python stages also stop starting work at their own
# --time-budget and write what they have.
#
# Exit status: 0 unless a stage failed to run — a test failure, a crash, a measurement error,
# a stage killed by its timeout. A missed target is reported (FAIL), not an error.

set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
DEADLINE=${DEADLINE:-300}
MARK=$(mktemp)                 # files newer than this one are this run's
SUMMARY_TSV=$(mktemp)
trap 'rm -f "$MARK" "$SUMMARY_TSV"' EXIT

# A python that has torch (on the GPU image a plain python3 is the one).
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for c in python3 python; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then PY=$c; break; fi
    done
fi
if [ -z "$PY" ]; then echo "no python with torch found" >&2; exit 2; fi

# fastcl from this checkout: bench/_checkout.py maps kernels/ to fastcl.kernels when fastcl is
# not installed (the bench scripts import it; pytest loads it as a plugin with -p _checkout).
export PYTHONPATH="$ROOT/bench:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset FASTCL_LEGACY FASTCL_AUTOTUNE FASTCL_SIM   # ab.py and profile_step.py set the switches

DATE=$(date +%F)
if [ $DRY -eq 1 ]; then
    export TRITON_INTERPRET=1
    RES=${RESULTS_DIR:-/tmp/fastcl-gpu-check-dry}
    OUT=${OUT:-$RES/out}
    DEV=cpu-dry-run
else
    unset TRITON_INTERPRET
    RES=${RESULTS_DIR:-$ROOT/bench/results}
    GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    if [ -z "$GPU" ]; then
        GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')")
    fi
    if [ -z "$GPU" ]; then
        echo "no CUDA device visible (use --dry-run on a CPU-only machine)" >&2
        exit 2
    fi
    DEV=$(echo "$GPU" | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
fi
mkdir -p "$RES"
STEM="$RES/$DEV-$DATE"
ERRORS=0

echo "== fastcl GPU check: $DEV, $PY, deadline ${DEADLINE}s, results in $RES"
if [ $DRY -eq 0 ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader 2>/dev/null || true
fi

# limit L: the seconds a stage of limit L gets now (the time left, less 20 s for the summary)
limit() {
    local left=$((DEADLINE - SECONDS - 20))
    echo $(($1 < left ? $1 : left))
}

# stage NAME SECONDS TAIL COMMAND...: run under timeout with its output in $STEM-NAME.log (a
# file, not a pipe: a stray child process cannot hold the script up), print the log's last
# TAIL lines, record status and seconds. Skipped when SECONDS is under 30.
stage() {
    local name=$1 t=$2 tail_lines=$3
    shift 3
    if [ "$t" -lt 30 ]; then
        echo "== $name: skipped (${t}s left of the ${DEADLINE}s deadline)"
        printf '%s\tskipped\t0\t%s\n' "$name" "$t" >>"$SUMMARY_TSV"
        return 0
    fi
    echo "== $name (timeout ${t}s): $*"
    local start=$SECONDS
    timeout -k 10 "$t" "$@" >"$STEM-$name.log" 2>&1 </dev/null
    local rc=$?
    local took=$((SECONDS - start))
    # (without the profiler's USDT lines, and only the last state of a progress bar)
    grep -v '^USDT:' "$STEM-$name.log" | sed 's/.*\r//' | tail -n "$tail_lines" | cut -c1-220
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$t" >>"$SUMMARY_TSV"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "== $name: TIMED OUT after ${took}s (limit ${t}s)"
    else
        echo "== $name: exit $rc after ${took}s"
    fi
    if [ "$rc" -ne 0 ]; then ERRORS=1; fi
    return 0
}

if [ $DRY -eq 1 ]; then         # tiny sizes, one thread
    CPU=(--device cpu --threads 1)
    ENV_ARGS=("${CPU[@]}")
    TARGET_ARGS=("${CPU[@]}" --target-n 256 --target-big-n 512 --target-d 64 --target-chunks 128
                 --compile-reserve 0)
    AB_ARGS=("${CPU[@]}" --n 256 --noise-n 128 --d 64)
    PROFILE_ARGS=("${CPU[@]}" --n 256 --d 64)
    SWEEP_ARGS=("${CPU[@]}" --objective infonce,noise --impl fastcl,reference --n 256,512 --d 64)
    SMALL_TESTS="not gpu and not matches_reference and not descriptor"   # the interpreter
                                                      # is slow: a few tests
    XDIST=()
else
    ENV_ARGS=()
    TARGET_ARGS=(--compile-reserve 30 --target-chunks 1024,4096)
    AB_ARGS=()
    PROFILE_ARGS=()
    SWEEP_ARGS=(--quick --compile-reserve 60)
    SMALL_TESTS="not gpu and not descriptor"   # the descriptor design: in tests-gpu
    XDIST=()
    if "$PY" -c "import xdist" >/dev/null 2>&1; then XDIST=(-n 6); fi
fi
FAST=(--warmup-ms 10 --rep-ms 50)

T=$(limit 30)
stage env "$T" 40 "$PY" bench/run.py --env --out-stem "$STEM-env" ${ENV_ARGS[@]+"${ENV_ARGS[@]}"}

T=$(limit 125)
stage targets "$T" 30 "$PY" bench/run.py --targets "${FAST[@]}" --time-budget $((T - 15)) \
    --out-stem "$STEM-targets" ${TARGET_ARGS[@]+"${TARGET_ARGS[@]}"}

T=$(limit 90)   # 11 variants × 3 cases, the candidate designs autotuning 3 tiles each
stage ab "$T" 24 "$PY" bench/ab.py --time-budget $((T - 15)) --out-stem "$STEM-ab" \
    ${AB_ARGS[@]+"${AB_ARGS[@]}"}

T=$(limit 30)
stage profile "$T" 30 "$PY" bench/profile_step.py --out-stem "$STEM-profile" \
    ${PROFILE_ARGS[@]+"${PROFILE_ARGS[@]}"}

# GPU-only tests first: they are what a CPU-only machine cannot run (it runs the rest in
# Triton's interpreter). Workers compile into Triton's cache, shared by the next stage.
PYTEST=(env FASTCL_AUTOTUNE=0 "$PY" -m pytest tests/test_triton.py -v --tb=short -rfEs
        -p _checkout -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"})
T=$(limit 55)
stage tests-gpu "$T" 15 "${PYTEST[@]}" -k "gpu"
T=$(limit 40)
stage tests-small "$T" 15 "${PYTEST[@]}" -k "$SMALL_TESTS"

T=$(limit 240)
stage sweep "$T" 30 "$PY" bench/run.py "${FAST[@]}" --time-budget $((T - 25)) --no-e2e \
    --out-stem "$STEM-sweep" ${SWEEP_ARGS[@]+"${SWEEP_ARGS[@]}"}

# The summary: $STEM-gpu-check.json, and a few lines to read first.
"$PY" - "$SUMMARY_TSV" "$STEM" "$DEADLINE" "$SECONDS" "$DRY" <<'EOF'
import json, re, sys
from pathlib import Path

tsv, stem, deadline, elapsed, dry = sys.argv[1:6]


def load(suffix):
    path = Path(f"{stem}-{suffix}.json")
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except ValueError as exc:
        return {"unreadable": str(exc)}


def pytest_summary(name):
    log = Path(f"{stem}-{name}.log")
    if not log.exists():
        return None
    lines = log.read_text(errors="replace").splitlines()
    final = [l for l in lines if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", l)]
    outcomes = {}
    for l in lines:   # one line per test with -v, so a run cut short still counts
        m = re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED)\b.*?(tests/\S+::\S+)|(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)\b", l)
        if m:
            outcomes.setdefault(m.group(2) or m.group(3), m.group(1) or m.group(4))
    failing = sorted({m.group(2) for l in lines for m in [re.search(r"\b(FAILED|ERROR) (tests/\S+)", l)] if m})
    counts = {}
    for o in outcomes.values():
        counts[o.lower()] = counts.get(o.lower(), 0) + 1
    return {"summary": final[-1].strip("= ") if final else None, "counts": counts,
            "failing": failing, "tail": lines[-80:]}


stages = []
for line in Path(tsv).read_text().splitlines():
    name, rc, took, limit = line.split("\t")
    status = ("skipped" if rc == "skipped" else "ok" if rc == "0" else
              "timed out" if rc in ("124", "137") else f"exit {rc}")
    stages.append({"stage": name, "status": status, "exit_code": None if rc == "skipped" else int(rc),
                   "seconds": int(took), "limit_s": int(limit)})
out = {"stem": stem, "dry_run": dry == "1", "deadline_s": int(deadline), "elapsed_s": int(elapsed),
       "stages": stages}
out["environment"] = load("env")
targets = load("targets") or {}
out["targets"] = targets.get("targets")
out["target_rows"] = [{k: r.get(k) for k in ("objective", "impl", "backend", "n", "chunk_size", "ok",
                                             "median_s", "first_call_s", "peak_beyond_inputs_mib",
                                             "pct_of_matmul", "loss", "error")}
                      for r in targets.get("results", [])]
ab = load("ab") or {}
out["ab"] = {"switches": ab.get("switches"), "matmul": ab.get("matmul"),
             "rows": [{k: r.get(k) for k in ("case", "variant", "backend", "ok", "median_s",
                                              "first_call_s", "peak_beyond_inputs_mib", "pct_of_matmul",
                                              "loss", "rel_diff", "same", "error", "chosen_configs")}
                      for r in ab.get("rows", [])]}
out["ab"]["autotune_ms"] = ab.get("autotune_ms")     # every config autotuning timed
profile = load("profile") or {}
out["profile"] = {k: profile.get(k) for k in ("n", "d", "dtype", "designs")}
out["pytest"] = {name: pytest_summary(name) for name in ("tests-gpu", "tests-small")}
sweep = load("sweep")
if sweep:
    results = sweep.get("results", [])
    out["sweep"] = {"interrupted": sweep.get("interrupted"), "headline": sweep.get("headline"),
                    "rows": len(results),
                    "skipped_by_budget": sum("time budget" in str(r.get("error", "")) for r in results)}
Path(f"{stem}-gpu-check.json").write_text(json.dumps(out, indent=1, default=str) + "\n")

print("== stages: " + "; ".join(f"{s['stage']} {s['status']} ({s['seconds']}s)" for s in stages))
for t in out["targets"] or []:
    v = t["value"]
    shown = "-" if v is None else (f"{100 * v:.1f}%" if "fraction" in t["target"] else f"{v:.2f}x")
    print(f"== target [{t['result']}] {t['target']}: {shown} (goal {t['goal']})")
new = {r["case"]: r for r in out["ab"]["rows"] if r["variant"] == "new" and r.get("ok")}
for r in out["ab"]["rows"]:
    base = new.get(r["case"])
    print(f"== ab {r['case']:<14} {r['variant']:<16} " + (
        f"{r['median_s'] * 1e3:8.2f} ms" + (f"  {r['median_s'] / base['median_s']:.3f}x new" if base else "")
        + (f"  {r['pct_of_matmul']:.1f}% mm" if r.get("pct_of_matmul") is not None else "")
        + ("" if r.get("same") is not False else "  RESULT DIFFERS")
        if r.get("ok") else f"{'skipped' if 'time budget' in str(r.get('error')) else 'ERROR'}: {r.get('error')}"))
from ab import autotune_lines
for line in autotune_lines(out["ab"]["autotune_ms"]):
    print("== autotune " + line)
for name, p in (out["profile"].get("designs") or {}).items():
    if "error" in p:
        print(f"== profile {name}: ERROR {p['error']}")
        continue
    fams = ", ".join(f"{k} {v['ms']:.2f}" for k, v in p["families"].items() if v["launches"])
    print(f"== profile {name}: wall {p['wall_ms']:.2f} ms, busy {p['busy_ms']:.2f} ms, {p['launches']} "
          f"launches, {p['chunks']} chunks ({fams} ms)")
for name, p in out["pytest"].items():
    if p:
        print(f"== {name}: {p['summary'] or p['counts']}" + (f"; failing: {', '.join(p['failing'][:10])}"
                                                             if p["failing"] else ""))
EOF

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$STEM-gpu-check.json" "$OUT/gpu-check.json"
    base=$(basename "$STEM")
    (cd "$RES" && find . -maxdepth 1 -type f -name "$base*" -newer "$MARK" -printf '%P\n' | sort \
        | tar czf "$OUT/results.tgz" -T -)
    n=2
    for f in "$STEM"-*.png; do
        if [ -f "$f" ] && [ "$f" -nt "$MARK" ] && [ "$n" -lt 8 ]; then cp "$f" "$OUT/" && n=$((n + 1)); fi
    done
    echo "== \$OUT: $n files ($(ls "$OUT" | tr '\n' ' '))"
fi
echo "== done in ${SECONDS}s (deadline ${DEADLINE}s); exit $ERRORS"
exit $ERRORS
