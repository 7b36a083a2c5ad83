"""Import a repository script (``scripts/*.py``, ``examples/*.py``) as a module, for tests."""
from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(relpath: str, name: str | None = None):
    """The module at ``ROOT/relpath`` (registered in ``sys.modules`` under ``name``, since
    dataclasses look their module up there)."""
    name = name or os.path.splitext(os.path.basename(relpath))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
