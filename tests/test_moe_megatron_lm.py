"""Megatron-Core's MoE layers through Megatron-LM's own ``pretrain`` (issue 51 item 1): the entry
takes ``--num-experts`` (no longer refused) and builds them, here at EP 2 on 2 CPU ranks."""
from __future__ import annotations

import pytest

from tests.test_megatron_lm_wheel import _skip_without_entry, train

MOE = ["--global-batch-size", "4", "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="the CPU training layer is only installed without CUDA")
def test_pretrain_ep2_trains_moe_layers():
    _skip_without_entry()
    import math
    import re

    losses, log = train(2, MOE, 3, timeout_s=240)
    start = [ln for ln in log.splitlines() if ln.startswith("megatron_oases: model")]
    assert start and "MoE 4 experts top-2, alltoall, dropless" in start[0] and "(EP 2)" in start[0], start
    # Megatron-LM logs the router's load-balancing loss of the MoE layers it trains, per iteration
    aux = [float(v) for v in re.findall(r"load_balancing_loss: ([0-9.E+-]+)", log)]
    assert len(aux) == len(losses) == 3 and all(math.isfinite(v) and v > 0 for v in aux), log[-3000:]
