"""Saved-bytes budget of the Oases schedule under recompute, against the memory model's numbers
(``describe.registry.layer_input_bytes``; ``sim.core.memory``: fine-grained recompute keeps each layer's
input and its two forward all-reduce outputs, Megatron-style full recompute the input only;
dropout masks are redrawn, not kept)."""
from __future__ import annotations

import pytest

from megatron_oases.runtime.spawn import run_on_ranks
from megatron_oases.describe.registry import layer_input_bytes
from tests.rank_fns_saved import oases_saved_bytes_after_one_step

LAYERS, B, S, H = 2, 4, 8, 32
MODEL = ["--num-layers", str(LAYERS), "--hidden-size", str(H), "--num-attention-heads", "4",
         "--seq-length", str(S), "--vocab-size", "256", "--micro-batch-size", str(B),
         "--global-batch-size", str(B), "--device", "cpu", "--tensor-model-parallel-size", "2",
         "--schedule", "oases", "--hidden-dropout", "0.1",
         "--recompute-granularity", "full", "--recompute-method", "uniform"]


@pytest.mark.parametrize("flag, inputs_per_layer", [
    ("--oases-fine-grained-recompute", 3), ("--no-oases-fine-grained-recompute", 1)])
def test_saved_bytes_per_layer_equal_the_memory_model(flag, inputs_per_layer):
    saved = run_on_ranks(oases_saved_bytes_after_one_step, 2, args=(MODEL + [flag],), timeout_s=120)
    want = LAYERS * inputs_per_layer * layer_input_bytes("megatron", b=B, s=S, h=H, e=4, layout=None)
    assert saved == [want, want]
