"""Shared test helpers: spawn gloo ranks (per-rank deadline) and compare with tolerances."""
from __future__ import annotations

import os
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")


def max_rel_diff(a, b) -> float:
    """max |a - b| / max(|b|, tiny) over paired floats (or tensors, element-wise on the max norm)."""
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.fixture
def on_ranks():
    """``on_ranks(fn, world_size, *args, timeout_s=...)`` -> list of per-rank results."""
    from megatron_oases.runtime.spawn import run_on_ranks

    def call(fn, world_size, *args, timeout_s: float = 120.0, **kwargs):
        return run_on_ranks(fn, world_size, args=args, kwargs=kwargs, timeout_s=timeout_s)

    return call
