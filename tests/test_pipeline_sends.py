"""Pipeline sends as Megatron-Core runs them (``sim.core.timeline.pipeline_send_ms``): between nodes
at one GPU's share of the node's network cards, and only the sequence-parallel shard with
``--sequence-parallel``. Priced from the topology's own numbers; no device."""
from __future__ import annotations

import pytest

from megatron_oases.sim.core.events import build_stage_events
from megatron_oases.sim.core.timeline import pipeline_send_ms, price_events
from megatron_oases.sim.frontends.cli import build_parser, simulation_inputs

MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "512",
         "--vocab-size", "1024", "--micro-batch-size", "2", "--global-batch-size", "16", "--dtype", "bf16"]


def _first_send(*flags: str):
    model, strategy, dm = simulation_inputs(build_parser().parse_args([*MODEL, *flags]))
    stages = build_stage_events(model, strategy, dm.topology)
    ev = stages[0].chunks[0].send_forward
    return ev, price_events(stages, dm), dm, strategy


def test_inter_node_send_gets_one_gpus_share_of_the_node():
    """TP 8 x PP 2 on two DGX A100 nodes: each stage is a node, every send crosses HDR InfiniBand
    at 200 GB/s per node = 25 GB/s a GPU (one card), times NCCL's 0.91, plus the 5 us latency."""
    ev, price, dm, s = _first_send("--topology", "dgx-a100-hdr8", "--nodes", "2", "--tp", "8", "--pp", "2")
    assert dm.topology.level_between(*ev.ranks) == 1
    ms = pipeline_send_ms(ev, price, dm, s)
    assert ms == pytest.approx(ev.nbytes / (200e9 / 8 * 0.91) * 1e3 + 0.005)
    assert ms > price[ev.key]  # the device model's pair price assumed the whole node's cards


def test_sequence_parallel_sends_the_shard():
    ev, price, dm, s = _first_send("--topology", "dgx-a100-hdr8", "--nodes", "2", "--tp", "8", "--pp", "2")
    ev_sp, price_sp, dm_sp, s_sp = _first_send("--topology", "dgx-a100-hdr8", "--nodes", "2", "--tp", "8", "--pp", "2",
                                               "--sequence-parallel")
    full, shard = pipeline_send_ms(ev, price, dm, s), pipeline_send_ms(ev_sp, price_sp, dm_sp, s_sp)
    assert shard - 0.005 == pytest.approx((full - 0.005) / 8)


def test_intra_node_send_keeps_the_device_models_price():
    ev, price, dm, s = _first_send("--topology", "dgx-a100-hdr8", "--nodes", "1", "--tp", "1", "--pp", "2")
    assert dm.topology.level_between(*ev.ranks) == 0
    assert pipeline_send_ms(ev, price, dm, s) == price[ev.key]
    assert pipeline_send_ms(None, price, dm, s) == 0.0
