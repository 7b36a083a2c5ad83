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


def test_scatter_gather_sends_a_slice_and_gathers_it_over_tp():
    """``--scatter-gather-tensors-in-pipeline`` (Megatron-LM 2021, DeepSpeed's pipeline engine):
    1/TP of the bytes cross the network, then the receiving node all-gathers the whole tensor over
    its 8 GPUs on NVSwitch (the device model's ring price of that all-gather)."""
    ev, price, dm, s = _first_send("--topology", "dgx-a100-hdr8", "--nodes", "2", "--tp", "8", "--pp", "2")
    ev_sg, price_sg, dm_sg, s_sg = _first_send("--topology", "dgx-a100-hdr8", "--nodes", "2", "--tp", "8", "--pp", "2",
                                               "--scatter-gather-tensors-in-pipeline")
    full, scattered = pipeline_send_ms(ev, price, dm, s), pipeline_send_ms(ev_sg, price_sg, dm_sg, s_sg)
    receivers = tuple(range(8, 16))  # the second node: stage 1's TP group
    gather = dm_sg.collective_ms("all_gather", ev_sg.nbytes, receivers)
    assert dm_sg.topology.level_between(8, 15) == 0 and gather > 0
    assert scattered == pytest.approx((full - 0.005) / 8 + 0.005 + gather)
    assert scattered < full
