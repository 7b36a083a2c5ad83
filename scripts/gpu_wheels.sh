#!/usr/bin/env bash
# Fill .whl/ with what scripts/gpu_check.sh installs on a lent GPU machine, which has Python 3.12
# and torch with CUDA but no package index: megatron-core (default: the newest release we
# support) and pulp, as wheels for that Python. Run it here, then carry .whl with the run.
#   bash scripts/gpu_wheels.sh            # MCORE=0.19.2 PYV=3.12 by default
set -euo pipefail
cd "$(dirname "$0")/.."
MCORE="${MCORE:-0.19.2}"
PYV="${PYV:-3.12}"
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" -d .whl \
    "megatron-core==$MCORE" "pulp<4"
ls -l .whl
