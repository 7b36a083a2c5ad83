"""Find the Megatron-LM checkout (``MEGATRON_LM_PATH``) and import its ``pretrain_gpt.py``.

We import Megatron-LM's entry script as a module (its ``__main__`` block does not run) to reuse
its ``forward_step``, dataset provider, ``get_embedding_ranks`` and model provider, rather than
re-implementing them. Megatron-Core itself comes from the installed ``megatron-core`` package;
the checkout adds ``megatron.training`` (``megatron`` is a namespace package; from 0.17 the wheel
ships it too, and the checkout's copy comes first on ``sys.path``) and must be the same
MAJOR.MINOR release: tag core_v0.16.1, or any core_v0.17.x, 0.18.x, 0.19.x
(``mcore_compat.supported``).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

from megatron_oases.mcore_compat import parse_version, supported
from megatron_oases.errors import ConfigError

ENV = "MEGATRON_LM_PATH"
SUPPORTED_TAGS = "core_v0.16.1, core_v0.17.x, core_v0.18.x or core_v0.19.x"
"""For messages; the rule is ``mcore_compat.supported`` and the installed MAJOR.MINOR."""
TAGS = {(0, 16): "core_v0.16.1", (0, 17): "core_v0.17.1", (0, 18): "core_v0.18.2",
        (0, 19): "core_v0.19.0"}
"""The Megatron-LM tag each supported MAJOR.MINOR is tested at (patches/README.md), which hints
name: megatron-core's wheel versions are not Megatron-LM's tags (megatron-core 0.19.2 has no
core_v0.19.2; core_v0.19.0's package_info.py says 0.19.1)."""
STOCK_MODULE = "megatron_lm_pretrain_gpt"
"""Name the checkout's pretrain_gpt.py is imported under (ours is megatron_oases.pretrain_gpt)."""


def checkout_path(path: str | os.PathLike | None = None) -> Path:
    """The checkout directory (``path`` or $MEGATRON_LM_PATH), checked to hold pretrain_gpt.py."""
    text = os.fspath(path) if path is not None else os.environ.get(ENV, "")
    if not text:
        raise ConfigError(f"set {ENV} to a Megatron-LM checkout of the installed release "
                          f"({_installed_tag()}), e.g. `git clone -b {_installed_tag()} "
                          f"https://github.com/NVIDIA/Megatron-LM`")
    root = Path(text).expanduser().resolve()
    for need in ("pretrain_gpt.py", "megatron/training/__init__.py"):
        if not (root / need).is_file():
            raise ConfigError(f"{ENV}={text} is not a Megatron-LM checkout: {need} is missing")
    return root


def checkout_version(root: Path) -> str | None:
    """``MAJOR.MINOR.PATCH`` from the checkout's megatron/core/package_info.py (None if absent)."""
    try:
        text = (root / "megatron/core/package_info.py").read_text(encoding="utf-8")
    except OSError:
        return None
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def _installed_tag() -> str:
    """The Megatron-LM tag to check out for the installed megatron-core (``TAGS``)."""
    from megatron.core.package_info import __version__ as installed

    major, minor, _ = parse_version(installed)
    return TAGS.get((major, minor), f"core_r{major}.{minor}.0")  # else the release branch


def check_versions(root: Path) -> None:
    """The checkout must be a supported release (``mcore_compat.supported``) with the installed
    megatron-core's MAJOR.MINOR."""
    from megatron.core.package_info import __version__ as installed

    found = checkout_version(root)
    if found is None:
        raise ConfigError(f"{root} has no megatron/core/package_info.py; use a Megatron-LM "
                          f"checkout of tag {_installed_tag()}")
    if not supported(parse_version(found)):
        raise ConfigError(f"{ENV} checkout is Megatron-Core {found}; supported: "
                          f"{SUPPORTED_TAGS} (check out {_installed_tag()})")
    if found.split(".")[:2] != installed.split(".")[:2]:
        raise ConfigError(f"{ENV} checkout is Megatron-Core {found} but megatron-core {installed} "
                          f"is installed; check out tag {_installed_tag()}")


def add_to_path(root: Path) -> None:
    """Put the checkout first on sys.path (pretrain_gpt.py imports gpt_builders, model_provider)."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def import_stock_pretrain_gpt(path: str | os.PathLike | None = None) -> ModuleType:
    """The checkout's pretrain_gpt.py as module ``megatron_lm_pretrain_gpt`` (cached)."""
    if STOCK_MODULE in sys.modules:
        return sys.modules[STOCK_MODULE]
    root = checkout_path(path)
    check_versions(root)
    add_to_path(root)
    spec = importlib.util.spec_from_file_location(STOCK_MODULE, root / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[STOCK_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[STOCK_MODULE]
        raise
    return module


def use_prebuilt_dataset_helpers() -> bool:
    """Let ``initialize_megatron`` use the installed megatron-core's prebuilt dataset helpers.

    ``megatron.training.initialize._compile_dependencies`` runs
    ``megatron.core.datasets.utils.compile_helpers`` on rank 0, which runs ``make`` in the folder
    of the *imported* ``megatron.core.datasets``. With megatron-core installed from its wheel
    (our setup), that folder holds the compiled ``helpers_cpp`` extension but no Makefile, so
    ``make`` fails and rank 0 exits ("Failed to compile the C++ dataset helper functions").
    When the extension imports, building it again is not needed: ``compile_helpers`` is wrapped
    to return without running ``make``. Otherwise (a source tree) it runs as upstream.
    Returns whether the prebuilt extension is used.
    """
    import functools

    from megatron.core.datasets import utils

    if getattr(utils.compile_helpers, "__prebuilt__", False):
        return True
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    original = utils.compile_helpers

    @functools.wraps(original)
    def compile_helpers():
        return None  # helpers_cpp is already built and importable

    compile_helpers.__prebuilt__ = True
    compile_helpers.__wrapped_original__ = original
    utils.compile_helpers = compile_helpers
    return True
