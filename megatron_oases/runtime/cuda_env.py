"""``CUDA_DEVICE_MAX_CONNECTIONS=1`` for overlapped tensor-parallel communication (CUDA only).

With one hardware work queue per device the GPU starts kernels in the order the host issued
them, whatever their streams. A TP collective launched just before a GEMM on another stream
(Megatron's async TP all-reduce and sequence parallelism, ATP's chunked all-reduces, the Oases
sub-batch schedule) then takes its few SMs first and runs under the GEMM. With more queues the
GEMM may be scheduled first, fill every SM and leave the collective waiting behind it: the
overlap is lost. Megatron-LM asks for 1 for the same reason. The variable is read when the CUDA
context is created, so it must be set before anything initialises CUDA in the process.
"""
from __future__ import annotations

import os
import warnings
from typing import MutableMapping

ENV_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def ensure_cuda_device_max_connections(device: str | None = None,
                                       environ: MutableMapping[str, str] | None = None
                                       ) -> str | None:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` when unset, before CUDA is initialised.

    ``device`` is the trainer's ``--device`` (``None``: CUDA when available). On CPU, or on a
    build without CUDA, nothing is touched and ``None`` is returned. A value the user set to
    something other than 1 is kept, with one warning naming the variable and why 1 is needed;
    so is an unset variable once CUDA is already initialised (too late to take effect).
    Returns the variable's value afterwards.
    """
    import torch

    env = os.environ if environ is None else environ
    if device == "cpu" or not torch.cuda.is_available():
        return None
    value = env.get(ENV_VAR)
    if value is None:
        if torch.cuda.is_initialized():
            _warn_once("late", f"{ENV_VAR} is unset and CUDA is already initialised, so setting it "
                               "now has no effect; export CUDA_DEVICE_MAX_CONNECTIONS=1 before launch "
                               "so TP collectives overlap the GEMMs issued after them")
            return None
        env[ENV_VAR] = "1"
        return "1"
    if value.strip() != "1":
        _warn_once(f"value={value}",
                   f"{ENV_VAR}={value}: with more than one hardware queue the GPU may run a GEMM "
                   "before the TP collective launched ahead of it, so communication stops "
                   "overlapping compute (Megatron, ATP chunks and the Oases schedule rely on launch "
                   f"order); keeping your value, but unset it or set {ENV_VAR}=1")
    return value
