"""Optional CUDA-only accelerators (Apex, Transformer Engine), probed lazily, as Megatron does.

Nothing imports them at module level; ``HAVE_APEX`` / ``HAVE_TE`` are computed on first use and a
feature that needs one calls ``require(...)``, which raises a clear ImportError naming the feature.
"""
from __future__ import annotations

import functools
import importlib.util

_PACKAGES = {"apex": "apex", "te": "transformer_engine"}


@functools.cache
def have(name: str) -> bool:
    """Whether the optional package ``name`` ("apex" or "te") is importable here."""
    return importlib.util.find_spec(_PACKAGES[name]) is not None


def require(name: str, feature: str):
    """Import and return the optional package, or raise an ImportError that names ``feature``."""
    if not have(name):
        pkg = _PACKAGES[name]
        raise ImportError(f"{feature} needs {pkg} (CUDA only); install it or turn {feature} off")
    return importlib.import_module(_PACKAGES[name])


def __getattr__(attr: str):
    if attr == "HAVE_APEX":
        return have("apex")
    if attr == "HAVE_TE":
        return have("te")
    raise AttributeError(attr)
