#!/usr/bin/env bash
# Download the pure-Python wheels of the alternatives bench/run.py compares fastcl with
# (Cut Cross-Entropy, memeff, Inf-CL), without their dependencies, into bench/wheels/
# (ignored by git). The GPU machine has no package index: the folder travels with the
# checkout and bench/gpu_check.sh installs it with pip --no-deps --no-index.
#
#   bash bench/fetch_wheels.sh            # the versions bench/_alternatives.py pins
#   WHEELS=/some/dir bash bench/fetch_wheels.sh
#
# The whole folder must stay under 64 MiB (what a checkout carries to the GPU machine);
# the three wheels are about 0.1 MiB.
set -eu
cd "$(dirname "$0")/.."
DEST=${WHEELS:-bench/wheels}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
# the pins: one place, bench/_alternatives.py
mapfile -t SPECS < <(PYTHONPATH=bench "$PY" -c \
    "from _alternatives import PINNED; print('\n'.join(f'{k}=={v}' for k, v in PINNED.items()))")
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.10 --implementation py \
    --dest "$DEST" "${SPECS[@]}"
for f in "$DEST"/*.whl; do
    case "$f" in
        *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
        *) echo "not a pure-Python wheel: $f" >&2; exit 1 ;;
    esac
done
size=$(du -sm "$DEST" | cut -f1)
if [ "$size" -gt 64 ]; then echo "$DEST is ${size} MiB (limit 64)" >&2; exit 1; fi
ls -l "$DEST"
