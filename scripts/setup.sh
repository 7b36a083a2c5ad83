#!/usr/bin/env bash
# Create .venv (once) and install megatron_oases with its test extra.
# TORCH_SPEC picks the torch build: the default pins the CPU wheel this project is tested with;
# on a GPU cluster use your site's CUDA build, e.g. TORCH_SPEC="torch==2.6.0" or an existing env
# (VENV=/path/to/env). EXTRAS=megatron-lm also installs what a Megatron-LM checkout imports.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull the newest CUDA build (several GB).
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
# EXTRAS adds optional extras, e.g. EXTRAS=megatron-lm for a Megatron-LM checkout's
# megatron.training (six, einops, pydantic, regex, triton, ...; docs/megatron_lm.md).
"$VENV/bin/python" -m pip install -q -e ".[test${EXTRAS:+,$EXTRAS}]"
# --data-path / --mock-data need Megatron-Core's compiled dataset helpers; its wheels ship them.
"$VENV/bin/python" -c "import megatron.core.datasets.helpers_cpp" 2>/dev/null \
  || echo "warning: megatron.core.datasets.helpers_cpp does not import; --data-path and --mock-data will refuse to start (docs/data.md)" >&2
echo "megatron_oases installed in $VENV"
