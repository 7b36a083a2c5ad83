"""The one place that knows megatron-core versions: every difference between the supported
releases (0.16.1 up to 0.19.x) is bridged here, each function naming the release that changed.

Layers, trainer, checkpoints and the Megatron-LM entry call these helpers instead of testing the
version themselves, so the next API change is fixed in one file (and a test per supported
version builds one layer of every backend: ``tests/test_mcore_compat.py``).
"""
from __future__ import annotations

import functools
import re

OLDEST = (0, 16, 1)
"""The oldest megatron-core release we support (``setup.py``'s lower bound)."""
NEWEST_MINOR = (0, 19)
"""The newest supported MAJOR.MINOR (``setup.py``'s upper bound is the next minor)."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.19.2"`` / ``"0.19.0rc1"`` -> ``(0, 19, 2)`` / ``(0, 19, 0)``."""
    parts = [int(re.match(r"\d+", p).group()) if re.match(r"\d+", p) else 0
             for p in text.split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def mcore_version() -> tuple[int, int, int]:
    """The installed megatron-core's (major, minor, patch)."""
    from megatron.core.package_info import __version__

    return parse_version(__version__)


def at_least(major: int, minor: int, patch: int = 0) -> bool:
    """Whether the installed megatron-core is this release or newer."""
    return mcore_version() >= (major, minor, patch)


def supported(version: tuple[int, int, int]) -> bool:
    """Whether ``version`` is in the supported range [OLDEST, NEWEST_MINOR.x]."""
    return OLDEST <= tuple(version) and tuple(version[:2]) <= NEWEST_MINOR
