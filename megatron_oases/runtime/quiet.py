"""Silence Megatron-Core warnings that are noise for our users, and only those.

TE/Apex fallbacks are expected (both are optional here), and so are megatron-core 0.17+'s import-time
notes about absl-py and MIMO; the CUDA_DEVICE_MAX_CONNECTIONS advice
means nothing on CPU. Set both as filters in this process and as PYTHONWARNINGS for the ranks
it starts (the forkserver imports Megatron before any code of ours runs there).
"""
from __future__ import annotations

import os
import warnings

_ALWAYS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
           "full scope is deprecated",
           # Megatron's distributed optimizer zeroes .grad of its shard views (on any device).
           "The .grad attribute of a Tensor that is not a leaf Tensor",
           # megatron-core 0.17+ on import: optional absl-py, and an experimental model config
           # that Megatron's own modules import (we never build a MIMO model).
           "absl.logging is not installed", "MimoModelConfig is experimental")
_CPU_ONLY = ("When using async grad allreduce it is recommended",)


def quiet_known_warnings(cpu: bool) -> None:
    messages = _ALWAYS + (_CPU_ONLY if cpu else ())
    for msg in messages:
        warnings.filterwarnings("ignore", message=msg)
    entries = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    entries += [f"ignore:{m}" for m in messages if f"ignore:{m}" not in entries]
    os.environ["PYTHONWARNINGS"] = ",".join(entries)
