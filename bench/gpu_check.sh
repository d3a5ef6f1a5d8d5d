#!/usr/bin/env bash
# The GPU check: everything a GPU machine must tell about fastcl's kernels, in one run of at
# most $DEADLINE seconds (default 300), on a machine with one NVIDIA GPU (an H200), no
# internet and only this checkout (fastcl need not be installed; torch, triton, numpy and
# matplotlib must be; sentence-transformers for the end-to-end comparison; pytest-xdist is
# used when present). Stages, correctness first:
#
#   env        bench/run.py --env        versions, GPU, whether 16-bit GEMMs write fp32
#   tests-gpu  pytest (FASTCL_AUTOTUNE=0) every Triton test on the GPU: tests/test_triton.py
#                                        (bf16, fp16, fp32, every objective, each kept autotune
#                                        config alone, the loss and gradients at 16384 against
#                                        the reference) and the Triton
#                                        cases of tests/test_matches_reference.py (every
#                                        objective, composed flag set and layout rule)
#   targets    bench/run.py --targets    the acceptance targets, PASS/FAIL with numbers
#   alternatives bench/run.py --impl ...  what a user would pick instead (torch-lce, cce,
#                                        memeff, inf-cl) beside fastcl, torch.compile of the
#                                        reference and the eager reference: infonce (and
#                                        memeff's symmetric and Matryoshka losses against
#                                        fastcl's) at N = 16384 and 32768, bf16, d = 768, each
#                                        checked against the float64 reference first
#   ab         bench/ab.py               the default against chunks of 4096 and 6144 rows
#                                        and no input checks; the time of every config
#                                        autotuned
#   profile    bench/profile_step.py     kernel families, launches, GPU busy share of the
#                                        call's span, at N = 16384 and 32768
#   e2e        bench/e2e_cached.py       a training step of a BERT-base-sized encoder (random
#                                        weights, seq 32), batch 4096 in mini-batches of 512:
#                                        fastcl's cached loss vs sentence-transformers'
#                                        CachedMultipleNegativesRankingLoss
#   largest    bench/largest.py          the largest loss one GPU holds: infonce at N = M =
#                                        262,144 and 1,048,576 (bf16, d = 768), checked
#                                        against float64 on a block of rows
#   alt-largest bench/run.py --impl ...  the largest N each alternative holds: infonce at
#                                        65536, 131072, 262144 until it fails or the time
#                                        budget is spent
#
# Before the stages: the alternatives' wheels, carried in bench/wheels/ (bash
# bench/fetch_wheels.sh where there is an index; the GPU machine has none), are installed with
# pip --no-deps --no-index into a folder of this run put first on PYTHONPATH; without them the
# alternatives' rows say the package is missing.
#
# Usage:
#   bash bench/gpu_check.sh              # on the GPU machine, from anywhere
#   STAGES="tests-gpu e2e" NAME=rerun bash bench/gpu_check.sh
#                                        # only those stages (a rerun after a fix), its files
#                                        # named $STEM-rerun-<what>; ALT_LIMIT=S gives the
#                                        # alternatives stage S seconds (default 60)
#   bash bench/gpu_check.sh --dry-run    # a CPU-only machine: the same stages at tiny sizes,
#                                        # one thread, a few small tests in Triton's interpreter;
#                                        # results in $RESULTS_DIR (default
#                                        # /tmp/fastcl-gpu-check-dry, not bench/results)
#
# Results: every file of the run is $STEM-<what>, STEM = bench/results/<gpu>-<date>: -env.json,
# -targets.{json,csv}, -ab.{json,csv}, -profile.json, -e2e.json, -largest.json, one .log per
# stage, and -gpu-check.json, the summary: each stage's status and seconds, the pytest counts
# and failing tests, the environment, the targets, the A/B table, the profile, the end-to-end
# step and the largest loss. Each stage writes its files as it goes, so a stage cut short by
# its timeout keeps what it measured.
# With $OUT set (a dry run defaults it to $RESULTS_DIR/out): $OUT/gpu-check.json and
# $OUT/results.tgz (every file this run wrote, logs included).
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
# (a dry run: the interpreter and a CPU's encoder are slow, the same stages get more time)
DEADLINE=${DEADLINE:-$([ $DRY -eq 1 ] && echo 480 || echo 300)}
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
unset FASTCL_AUTOTUNE

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
STEM="$RES/$DEV-$DATE${NAME:+-$NAME}"
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
    if [ -n "${STAGES:-}" ] && [[ " $STAGES " != *" $name "* ]]; then
        return 0
    fi
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
    AB_ARGS=("${CPU[@]}" --n 256 --noise-n 128 --d 64 --variants new,chunk=64,no-input-checks)
    PROFILE_ARGS=("${CPU[@]}" --n 128,256 --d 64)
    E2E_ARGS=(--dry-run)
    LARGEST_ARGS=(--dry-run)
    # the GPU's flow (one process, dynamic compiles) at tiny sizes
    ALT_ARGS=("${CPU[@]}" --in-process --n 256 --d 64 --dtype float32 --repeats 2)
    ALT_BIG_ARGS=("${CPU[@]}" --in-process --n 512,1024 --d 64 --dtype float32 --repeats 1)
    ALT_LIMIT=150     # on a CPU, Cut Cross-Entropy's torch_compile path compiles (tens of seconds)
    # the interpreter is slow: a few tests
    TESTS=(tests/test_triton.py -k "not matches_reference and not bf16 and not 16bit and not gpu_tiles")
    XDIST=()
else
    ENV_ARGS=()
    TARGET_ARGS=(--compile-reserve 30 --target-chunks 4096)
    AB_ARGS=()
    PROFILE_ARGS=()
    E2E_ARGS=()
    LARGEST_ARGS=()
    ALT_ARGS=(--n 16384,32768 --d 768 --dtype bfloat16)
    ALT_BIG_ARGS=(--n 65536,131072,262144 --d 768 --dtype bfloat16)
    ALT_LIMIT=${ALT_LIMIT:-60}
    TESTS=(tests/test_triton.py tests/test_matches_reference.py -k "(triton or gpu) and not options")
    XDIST=()
    if "$PY" -c "import xdist" >/dev/null 2>&1; then XDIST=(-n 8); fi
fi
FAST=(--warmup-ms 10 --rep-ms 50)

# The alternatives' wheels (no index, no dependencies): into this run's own folder.
WHEEL_SITE="$RES/.alternatives-site"
rm -rf "$WHEEL_SITE"
if ls "$ROOT"/bench/wheels/*.whl >/dev/null 2>&1; then
    if "$PY" -m pip install --quiet --no-deps --no-index --target "$WHEEL_SITE" \
            "$ROOT"/bench/wheels/*.whl >"$STEM-wheels.log" 2>&1; then
        export PYTHONPATH="$WHEEL_SITE:$PYTHONPATH"
        echo "== wheels: installed offline: $(cd "$ROOT/bench/wheels" && ls *.whl | tr '\n' ' ')"
    else
        echo "== wheels: pip install --no-index failed (see $STEM-wheels.log)"; tail -n 5 "$STEM-wheels.log"
        ERRORS=1
    fi
else
    echo "== wheels: none in bench/wheels (bash bench/fetch_wheels.sh): the alternatives report missing packages"
fi

T=$(limit 30)
stage env "$T" 40 "$PY" bench/run.py --env --out-stem "$STEM-env" ${ENV_ARGS[@]+"${ENV_ARGS[@]}"}

# Correctness first: what a CPU-only machine cannot run (it runs the kernels in Triton's
# interpreter). FASTCL_AUTOTUNE=0: one config a list (bounded compile time); the test of each
# kept config launches every config itself. Up to 120 s (~415 tests, most of the time
# compiling; 96 took 28 s on 2026-11-30): a slow run takes its time from the last stages
# (e2e, largest), never the other way round.
T=$(limit 120)
stage tests-gpu "$T" 15 env FASTCL_AUTOTUNE=0 "$PY" -m pytest "${TESTS[@]}" -v --tb=short -rfEs \
    -p _checkout -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"}

T=$(limit 60)
stage targets "$T" 30 "$PY" bench/run.py --targets "${FAST[@]}" --time-budget $((T - 15)) \
    --out-stem "$STEM-targets" ${TARGET_ARGS[@]+"${TARGET_ARGS[@]}"}

# Every alternative beside fastcl (torch.compile last: its compile must not starve the rest;
# correctness first: each row is checked against the float64 reference before it is timed,
# a wrong one is reported, not timed).
T=$(limit $ALT_LIMIT)
stage alternatives "$T" 40 "$PY" bench/run.py "${FAST[@]}" --time-budget $((T - 10)) \
    --compile-reserve 20 --objective infonce,infonce-symmetric,matryoshka \
    --impl fastcl,torch-lce,cce,memeff,inf-cl,reference,compiled --no-plots \
    --out-stem "$STEM-alternatives" "${ALT_ARGS[@]}"

T=$(limit 45)   # 4 variants × 3 cases
stage ab "$T" 20 "$PY" bench/ab.py --time-budget $((T - 10)) --out-stem "$STEM-ab" \
    ${AB_ARGS[@]+"${AB_ARGS[@]}"}

T=$(limit 30)
stage profile "$T" 30 "$PY" bench/profile_step.py --out-stem "$STEM-profile" \
    ${PROFILE_ARGS[@]+"${PROFILE_ARGS[@]}"}

T=$(limit 45)
stage e2e "$T" 15 "$PY" bench/e2e_cached.py --time-budget $((T - 5)) --out "$STEM-e2e.json" \
    ${E2E_ARGS[@]+"${E2E_ARGS[@]}"}

T=$(limit 45)
stage largest "$T" 15 "$PY" bench/largest.py --time-budget $((T - 5)) --out "$STEM-largest.json" \
    ${LARGEST_ARGS[@]+"${LARGEST_ARGS[@]}"}

T=$(limit 40)
stage alt-largest "$T" 25 "$PY" bench/run.py "${FAST[@]}" --time-budget $((T - 10)) \
    --compile-reserve 20 --objective infonce --impl torch-lce,cce,memeff,inf-cl,reference,compiled \
    --no-plots --out-stem "$STEM-alt-largest" "${ALT_BIG_ARGS[@]}"

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
out["ab"] = {"matmul": ab.get("matmul"),
             "rows": [{k: r.get(k) for k in ("case", "variant", "backend", "ok", "median_s",
                                              "first_call_s", "peak_beyond_inputs_mib", "pct_of_matmul",
                                              "loss", "rel_diff", "same", "error", "chosen_configs")}
                      for r in ab.get("rows", [])]}
out["ab"]["autotune_ms"] = ab.get("autotune_ms")     # every config autotuning timed
profile = load("profile") or {}
out["profile"] = {k: profile.get(k) for k in ("n", "d", "dtype", "sizes")}
out["pytest"] = {"tests-gpu": pytest_summary("tests-gpu")}
def alternative_rows(name):
    report = load(name) or {}
    return {"versions": (report.get("environment") or {}).get("alternatives"),
            "rows": [{k: r.get(k) for k in ("objective", "impl", "backend", "n", "dtype", "ok",
                                             "skipped", "median_s", "peak_beyond_inputs_mib",
                                             "pct_of_matmul", "loss", "check_loss_rel",
                                             "check_grad_rel", "package_version", "error")}
                     for r in report.get("results", [])]}


out["alternatives"] = alternative_rows("alternatives")
out["alt_largest"] = alternative_rows("alt-largest")
out["e2e"] = load("e2e")
out["largest"] = load("largest")
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
for name, p in (out["profile"].get("sizes") or {}).items():
    if "error" in p:
        print(f"== profile {name}: ERROR {p['error']}")
        continue
    fams = ", ".join(f"{k} {v['ms']:.2f}" for k, v in p["families"].items() if v["launches"])
    print(f"== profile {name}: wall {p['wall_ms']:.2f} ms, busy {p['busy_ms']:.2f} ms "
          f"({p['busy_pct_of_wall']:.1f}% of the call's span), {p['launches']} "
          f"launches, {p['chunks']} chunks ({fams} ms)")
busy = ((out["profile"].get("sizes") or {}).get("N=16384") or {}).get("busy_pct_of_wall")
if busy is not None:      # the GPU busy for at least 95 % of a call's span at 16384
    print(f"== target [{'PASS' if busy >= 95 else 'FAIL'}] GPU busy share of the call's span, "
          f"infonce N=M=16384: {busy:.1f}% (goal >= 95%)")
for name in ("alternatives", "alt_largest"):
    for r in out[name]["rows"]:
        print(f"== {name} {r['objective']} {r['impl']:<9} N={r['n']}: " + (
            f"{r['median_s'] * 1e3:.2f} ms" + (f", {r['peak_beyond_inputs_mib']:.0f} MiB"
                                               if r.get("peak_beyond_inputs_mib") is not None else "")
            + (f", checked (loss {r['check_loss_rel']:.0e}, grads {r['check_grad_rel']:.0e})"
               if r.get("check_loss_rel") is not None else "")
            if r.get("ok") else f"{'skipped' if r.get('skipped') else 'ERROR'}: {r.get('error')}"))
for name in ("e2e", "largest"):
    for r in (out.get(name) or {}).get("rows", []):
        print(f"== {name} " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in r.items() if not isinstance(v, (dict, list))))
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
    echo "== \$OUT: $(ls "$OUT" | tr '\n' ' ')"
fi
echo "== done in ${SECONDS}s (deadline ${DEADLINE}s); exit $ERRORS"
exit $ERRORS
