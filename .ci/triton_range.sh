#!/usr/bin/env bash
# The compile check on the Tritons users get besides the newest (issue 25, "Every Triton users
# have"): the floor of pyproject.toml's range (`triton>=X.Y`, torch 2.5 gives 3.1) and 3.6
# (torch 2.10/2.11, the H200 machine's). Run inside an activated venv with fastcl installed
# (.ci/run's): each Triton goes alone (`--no-deps`: the venv's CPU torch serves) into a
# temporary folder that shadows the venv's Triton on PYTHONPATH. On each:
#   - the full bf16 compile check (`--arch 80 90 --dtype bfloat16`): every kernel and flag
#     set on sm_80 and sm_90 in every mode, the first config of each similarity list and
#     each config at least once, through that Triton's code generator and ptxas, as a
#     large-batch launch specializes them (and, on a covering subset, an unaligned one); a
#     compile error or a register spill in a kept config fails. The lists are that Triton's
#     own (kernels/configs.py: an older Triton leaves out the configs it spills in). The
#     newest Triton runs the same check, and fp32's and fp16's, in tests/test_compile.py;
#   - the two tests of the compile check's adaptation to that Triton (the launch marks, and
#     that they reach the compiled kernel);
#   - on the floor only: the interpreter tests (TRITON_INTERPRET=1, FLOOR_INTERPRETER below)
#     with numpy 1.26 shadowing the venv's: Triton 3.1's interpreter gives wrong numbers
#     under numpy 2's type promotion, and those of 3.1 and 3.6 stop under numpy 2.4 (a size-1
#     array is no scalar there); the compiled kernels depend on neither. (The newest Triton
#     runs them in the suite.)
# `bash .ci/triton_range.sh [VERSION ...]`: those Tritons (`floor` and `mid` name the two above;
# both by default: CI runs each as a job of its own, .ci/tests). Fails on any failure.
# FASTCL_TRITON_FLOOR / FASTCL_TRITON_MID override the versions; FASTCL_CI_JOBS the compile
# check's processes (the machine's cores by default).
set -euo pipefail
cd "$(dirname "$0")/.."

declared=$(python - <<'EOF'
import re
print(re.search(r'"triton>=([0-9.]+)"', open("pyproject.toml").read()).group(1))
EOF
)
floor="${FASTCL_TRITON_FLOOR:-$declared}"
mid="${FASTCL_TRITON_MID:-3.6.0}"
jobs="${FASTCL_CI_JOBS:-$(nproc)}"
# the Triton cases (-k triton) of the suite's grid against the reference (tests/test_matches_reference.py:
# every objective, layout rule and edge shape), the kernels' own tests and the silent cases.
# Left to the newest Triton, for CI's time: the grid's tiled cases, its feature combinations,
# anchor slices and per-row option families (options: soft targets, a learnable τ, the margin),
# test_contrastive.py, test_properties.py, test_wrong_numbers.py, test_validation.py and
# test_dclr_released.py (more of the same comparisons), test_explain.py and
# test_host_syncs.py (the driver), and the files that need sentence-transformers (whose
# pandas and pyarrow do not load beside numpy 1.26); all but the last pass on the floor too
# (FLOOR_INTERPRETER="FILE ..." runs others, FLOOR_SELECT="" all of their cases). Also left
# to the newest Triton: the tests of the GPU's 16-bit buffers and tiles (16bit, gpu_tiles:
# the same kernels at other dtypes and sizes, the interpreter's semantics no more than the
# rest); they pass on the floor too
read -r -a FLOOR_INTERPRETER <<< "${FLOOR_INTERPRETER:-tests/test_matches_reference.py tests/test_triton.py tests/test_silent_cases.py}"
FLOOR_SELECT="${FLOOR_SELECT-triton and not 16bit and not gpu_tiles and not features and not slices and not options}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# `3.1` → the newest 3.1.x; a full version as it is
spec() { if [[ "$1" =~ ^[0-9]+\.[0-9]+$ ]]; then echo "triton==$1.*"; else echo "triton==$1"; fi; }

step() { echo "== $1 ($(( SECONDS - t0 )) s so far)"; }
t0=$SECONDS

(( $# )) || set -- floor mid
versions=()
for arg in "$@"; do
    case "$arg" in floor) versions+=("$floor") ;; mid) versions+=("$mid") ;; *) versions+=("$arg") ;; esac
done
for version in "${versions[@]}"; do
    dir="$tmp/triton-$version"
    step "Triton $(spec "$version"): install into $dir"
    python -m pip install --quiet --no-deps --target "$dir" "$(spec "$version")"
    path="$dir${PYTHONPATH:+:$PYTHONPATH}"
    PYTHONPATH="$path" python - "$dir" <<'EOF'
import os, sys
import triton
assert os.path.realpath(triton.__file__).startswith(os.path.realpath(sys.argv[1])), triton.__file__
print(f"Triton {triton.__version__} from {os.path.dirname(triton.__file__)}")
EOF
    step "Triton $version: the full bf16 compile check"
    log="$tmp/compile-$version.txt"
    if ! PYTHONPATH="$path" python -m fastcl.kernels.compile_check --arch 80 90 --dtype bfloat16 \
            --jobs "$jobs" > "$log" 2>&1; then
        grep -E -A6 "ERROR|SPILLS|Traceback" "$log" || tail -n 40 "$log"
        tail -n 1 "$log"
        exit 1
    fi
    tail -n 1 "$log"
    # (in .ci/tests, whose `ready` waits for the extras .ci/run installs while the check runs)
    if declare -F ready > /dev/null; then ready extras; fi
    step "Triton $version: the compile check's adaptation"
    PYTHONPATH="$path" python -m pytest -q -p no:cacheprovider tests/test_compile.py \
        -k "launch_specialization_is_tritons or marks_reach_the_compiler"
    if [[ "$version" == "$floor" ]]; then
        step "Triton $version: the interpreter tests, numpy 1.26"
        python -m pip install --quiet --no-deps --target "$tmp/numpy1" "numpy==1.26.*"
        PYTHONPATH="$path:$tmp/numpy1" TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider \
            -W "ignore:Conversion of an array with ndim:DeprecationWarning" -k "$FLOOR_SELECT" \
            "${FLOOR_INTERPRETER[@]}"
    fi
done
step "done"
