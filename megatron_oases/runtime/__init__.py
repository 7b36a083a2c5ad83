"""Where code runs: device and backend choice, streams/events, the Megatron-Core CPU layer.

The names below load on first use (PEP 562), so a module of this package that needs no torch
(``exit_signal``, read by the trainer's flags) can be imported without importing torch: a bad
flag is then refused before torch loads."""
import importlib

_HOMES = {
    "cpu_compat_installed": "cpu_compat", "install_cpu_compat": "cpu_compat",
    "Runtime": "device", "current_runtime": "device", "detect_runtime": "device",
    "init_distributed": "device", "init_runtime": "device",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
