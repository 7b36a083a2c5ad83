"""Where code runs: device and backend choice, streams/events, the Megatron-Core CPU layer."""
from megatron_oases.runtime.cpu_compat import cpu_compat_installed, install_cpu_compat
from megatron_oases.runtime.device import (
    Runtime,
    current_runtime,
    detect_runtime,
    init_distributed,
    init_runtime,
)

__all__ = [
    "Runtime",
    "current_runtime",
    "detect_runtime",
    "init_distributed",
    "init_runtime",
    "install_cpu_compat",
    "cpu_compat_installed",
]
