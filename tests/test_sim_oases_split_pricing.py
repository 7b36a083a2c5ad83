"""Issue 49 item 2: under the Oases schedule each sub-batch's layer events are the layer described
at the sub-batch's size (``describe/split.py``), priced at their own shapes and kernel counts."""
from __future__ import annotations

import dataclasses

import pytest

from benchmarks.standin.standins import Link, link_topology
from megatron_oases.describe.split import SUB_BATCHES
from megatron_oases.pricing.device_model import DeviceModel, gpu_spec
from megatron_oases.pricing.stack import LOCAL
from megatron_oases.sim.core.events import build_stage_events
from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
from megatron_oases.train_args import build_parser

FLAGS = ["--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "1024",
         "--max-position-embeddings", "1024", "--vocab-size", "1024", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--bf16", "--tensor-model-parallel-size", "2", "--nproc-per-node", "2"]


def _layer_events(schedule: str):
    args = build_parser().parse_args(FLAGS + ["--schedule", schedule])
    model, strategy = sim_inputs_from_train_args(args, 2)
    strategy = dataclasses.replace(strategy, optimizer_step=False, loop_overhead=False)
    topo = link_topology(Link(GBps=25.0, latency_us=5.0), 2, "h100-sxm")
    st = build_stage_events(model, strategy, topo)[0]
    evs = {ev.name: (ev, chains) for segs in (st.chunks[0].forward_segments, st.chunks[0].backward_segments)
           for evs_, chains in segs for ev in evs_ if ev.kind == "compute"}
    return evs, DeviceModel(gpu=gpu_spec("h100-sxm"), topology=topo, bytes_per_element=2, stack=LOCAL)


@pytest.mark.parametrize("name", ["attention", "mlp", "attention.bwd", "mlp.bwd"])
def test_sub_batch_events_are_priced_at_their_own_shapes_and_kernels(name):
    stock, dm = _layer_events("default")
    oases, _ = _layer_events("oases")
    (s_ev, s_chains), (o_ev, o_chains) = stock[name], oases[name]
    assert (s_chains, o_chains) == (1, SUB_BATCHES)
    # every GEMM's tokens dimension is the sub-batch's (M for dgrad / forward, K for wgrad)
    tokens = 2 * 1024
    for (m, n, k), (m2, n2, k2) in zip(s_ev.op.gemms, o_ev.op.gemms):
        assert (m2, n2, k2) in ((m // SUB_BATCHES, n, k), (m, n, k // SUB_BATCHES))
        assert tokens in (m, k)
    assert o_ev.op.gemm_flops * SUB_BATCHES == s_ev.op.gemm_flops
    # the same kernels per sub-batch: twice the launches (host cost) per micro-batch
    assert o_ev.op.kernels == s_ev.op.kernels
    assert dm.dispatch_floor_ms(o_ev.op) * o_chains == pytest.approx(SUB_BATCHES * dm.dispatch_floor_ms(s_ev.op))
    # two half-size segments cost at least one whole one (quantization and fixed costs per segment)
    assert dm.gpu_compute_ms(o_ev.op) * o_chains >= dm.gpu_compute_ms(s_ev.op) * (1 - 1e-9)


def test_main_grad_accumulation_is_priced_once_per_micro_batch_under_either_schedule():
    """DDP's add of each layer's weight gradients into the fp32 main_grad: (8 + 2) bytes a
    parameter per micro-batch in bf16, shared by the Oases sub-batches, plus the executor's
    16-bit addmm_ read of the first sub-batch's sum (schedules/oases/wgrad.py); 0 under a stack
    that fuses the accumulation into the weight-gradient GEMM."""
    from megatron_oases.pricing.device_model import GRAD_ACCUMULATE
    from megatron_oases.pricing.stack import APEX_FUSED, TRANSFORMER_ENGINE

    stock, dm = _layer_events("default")
    oases, _ = _layer_events("oases")
    (s_ev, s_chains), (o_ev, o_chains) = stock[GRAD_ACCUMULATE], oases[GRAD_ACCUMULATE]
    h, f = 1024, 4096
    params = (4 * h * h + 2 * h * f) // 2 + 3 * h + (h + f) // 2 + h + 4 * h  # weights, biases, norms on TP rank 0
    assert s_ev.op.elementwise_bytes == pytest.approx(10 * params, rel=0.01)
    assert o_ev.op.elementwise_bytes * o_chains == pytest.approx(s_ev.op.elementwise_bytes + 2 * params, rel=0.01)
    for stack in (APEX_FUSED, TRANSFORMER_ENGINE):
        assert dataclasses.replace(dm, stack=stack).compute_ms(s_ev.op) == 0.0
    assert dm.compute_ms(s_ev.op) > 0


def test_the_committed_h100_stand_in_runs_each_step_within_8_percent():
    """scripts/sim_vs_standin.py on the committed H100 runs (issue 49 item 2's check): every
    `sleep` step within 8% of measured; stock / Oases within 8% (the issue asks 5%: not met, the
    gap is Oases' exposed communication, docs/sim.md)."""
    import glob

    from tests.script_modules import ROOT, load_script

    svs = load_script("scripts/sim_vs_standin.py")
    files = sorted(glob.glob(f"{ROOT}/examples/gpu/h100-2026-11-27/call1/overlap_standin*.json"))
    rows = [r for f in files for r in svs.compare(f)]
    assert len(rows) == 6
    for r in rows:
        assert abs(r["sim_step_ms"] / r["sleep_step_ms"] - 1) < 0.08, r
    for q in svs.ratios(rows):
        assert abs(q["error_pct"]) < 8.0, q
