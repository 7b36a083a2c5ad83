#!/usr/bin/env bash
# Create .venv (once) and install megatron_oases with its test extra.
#
# Python: 3.12 by default (megatron-core 0.17 and newer need it): $PYTHON if set, else pyenv's
# 3.12.1, else python3.12 on PATH, else python3. On Python 3.11 pip resolves megatron-core 0.16.1,
# the oldest release we support; on 3.12 the newest in setup.py's range (0.19.x).
# TORCH_SPEC picks the torch build: the default pins 2.13.0 (on Python 3.11 the CPU wheel on these
# machines; on 3.12 PyPI's CUDA build, which also runs on CPU: ~4.8 GB, several minutes the first
# time). On a GPU cluster use your site's CUDA build, or an existing env (VENV=/path/to/env).
# MCORE_SPEC pins megatron-core, e.g. MCORE_SPEC="megatron-core==0.18.2".
# EXTRAS=megatron-lm also installs what Megatron-LM's megatron.training imports (docs/megatron_lm.md).
# MCORE_RELEASES="0.16.1 0.17.1" also unpacks those megatron-core releases under .mcore/<version>
# (no dependencies) for tests/test_mcore_compat.py, which trains one step of every backend on each.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

pick_python() {
    [ -n "${PYTHON:-}" ] && { echo "$PYTHON"; return; }
    local root
    root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
    for p in "$root/versions/3.12.1/bin/python" "$(command -v python3.12 || true)"; do
        [ -n "$p" ] && [ -x "$p" ] && { echo "$p"; return; }
    done
    echo python3
}

if [ ! -x "$VENV/bin/python" ]; then
    PY="$(pick_python)"
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull the newest CUDA build (several GB).
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
if [ -n "${MCORE_SPEC:-}" ]; then
    "$VENV/bin/python" -m pip install -q "$MCORE_SPEC"
fi
"$VENV/bin/python" -m pip install -q -e ".[test${EXTRAS:+,$EXTRAS}]"
# --data-path / --mock-data need Megatron-Core's compiled dataset helpers; its wheels ship them.
"$VENV/bin/python" -c "import megatron.core.datasets.helpers_cpp" 2>/dev/null \
  || echo "warning: megatron.core.datasets.helpers_cpp does not import; --data-path and --mock-data will refuse to start (docs/data.md)" >&2
for release in ${MCORE_RELEASES:-}; do
    [ -d ".mcore/$release/megatron/core" ] \
        || "$VENV/bin/python" -m pip install -q --no-deps --target ".mcore/$release" "megatron-core==$release"
done
"$VENV/bin/python" - "$VENV" <<'EOF'
import platform, sys
import torch
from megatron.core.package_info import __version__ as mcore
print(f"megatron_oases installed in {sys.argv[1]}: Python {platform.python_version()}, "
      f"torch {torch.__version__}, megatron-core {mcore}")
EOF
