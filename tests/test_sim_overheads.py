"""The analytical device model's overhead and kernel terms (docs/sim.md, Device model): the host
dispatch floor, the fused-attention path, the measured GEMM ceilings, TP communication overlap
(Transformer Engine userbuffers) and uneven first / last pipeline stages. A profile still
overrides every event."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_oases.describe.ops import Compute
from megatron_oases.pricing.device_model import GPUS, ProfileDB, SimError, device_model
from megatron_oases.pricing.stack import LOCAL, SoftwareStack
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.sim.core.events import build_stage_events, stage_layers, unique_events
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.core.timeline import simulate
from megatron_oases.topology import Level, Topology


def topo(per_node: int = 8, nodes: int = 1) -> Topology:
    lv = [Level(name="nvlink", size=per_node, scope="intra_node", p2p_bandwidth_GBps=300,
                group_bandwidth_GBps=300, latency_us=2.0)]
    if nodes > 1:
        lv.append(Level(name="ib", size=nodes, scope="inter_node", p2p_bandwidth_GBps=25,
                        group_bandwidth_GBps=25, latency_us=4.0))
    return Topology(name="t", levels=tuple(lv), device="a100-80gb")


def host(dispatch_us: float, layer_framework_us: float) -> SoftwareStack:
    """The local stack with other host costs."""
    return dataclasses.replace(LOCAL, dispatch_us=dispatch_us, layer_framework_us=layer_framework_us)


def test_tiny_workload_gets_the_dispatch_floor():
    dm = device_model(topo(), stack=host(5.0, 20.0))
    tiny = Compute(name="attention", gemm_flops=1e3, elementwise_bytes=1e3, kernels=12)
    assert dm.gpu_compute_ms(tiny) < 0.06
    assert dm.compute_ms(tiny) == pytest.approx((12 * 5.0 + 20.0) / 1e3)
    one = Compute(name="x", gemm_flops=1e3)  # unknown kernels count as one, no framework cost
    assert dm.compute_ms(one) == pytest.approx(max(dm.gpu_compute_ms(one), 5.0 / 1e3))
    big = Compute(name="mlp", gemm_flops=1e13, kernels=5)
    assert dm.compute_ms(big) == dm.gpu_compute_ms(big) > 10.0


def test_a_profile_overrides_the_floor():
    dm = device_model(topo(), stack=host(50.0, 0.0))
    key = "compute:attention[x]"
    tiny = Compute(name="attention", gemm_flops=1e3, kernels=12)
    assert dm.price(key, tiny, kind="compute") == pytest.approx(0.6)
    prof = ProfileDB(device="gpu", events_ms={key: 0.002})
    assert device_model(topo(), stack=host(50.0, 0.0), profile=prof).price(key, tiny, kind="compute") == 0.002


def test_measured_gemm_ceilings_and_fused_attention():
    assert device_model(topo()).max_gemm_efficiency == GPUS["a100-80gb"].gemm_efficiency == 0.869
    assert device_model(topo(), max_gemm_efficiency=0.75).max_gemm_efficiency == 0.75
    assert GPUS["h100-sxm"].gemm_efficiency == 0.803 and GPUS["v100-sxm2"].gemm_efficiency == 0.75
    c = Compute(name="attention", gemm_flops=0.0, attention_flops=3.12e12, elementwise_bytes=4e9, score_bytes=3e9)
    plain, fused = device_model(topo()), device_model(topo(), fused_attention=True)
    # fused: half the FLOPs (causal) at the flash efficiency, the scores' bytes never reach HBM
    assert fused.gpu_compute_ms(c) == pytest.approx(0.5 * 10.0 / 0.5 + 1e9 / (2039 * 1e6 * 0.8))
    assert fused.gpu_compute_ms(c) < plain.gpu_compute_ms(c)


def _model(**kw) -> GPTShape:
    return GPTShape(num_layers=kw.pop("layers", 4), hidden_size=1024, num_attention_heads=16, seq_length=2048,
                    padded_vocab_size=32768, micro_batch_size=1, **kw)


def test_tp_comm_overlap_hides_sp_collectives_behind_their_gemms():
    m = _model()
    sp = Strategy(tp=8, sequence_parallel=True, num_microbatches=2)
    ub = Strategy(tp=8, sequence_parallel=True, tp_comm_overlap=True, num_microbatches=2)
    dm = device_model(topo())
    keys = unique_events(build_stage_events(m, ub, dm.topology))
    hidden = {k: e for k, e in keys.items() if e.hidden_by is not None}
    assert {e.name for e in hidden.values()} == {"attention.ag", "attention.rs", "attention.rs.bwd",
                                                "attention.ag.wgrad", "mlp.ag", "mlp.rs", "mlp.rs.bwd",
                                                "mlp.ag.wgrad"}
    assert all(k.endswith("~ub") for k in hidden)
    assert simulate(m, ub, dm).iteration_ms < simulate(m, sp, dm).iteration_ms
    with pytest.raises(SimError, match="tp-comm-overlap needs --sequence-parallel"):
        Strategy(tp=8, tp_comm_overlap=True)


def test_uneven_first_and_last_stages():
    m = _model(layers=22)
    s = Strategy(pp=8, num_microbatches=8, first_stage_layers=2, last_stage_layers=2)
    stages = build_stage_events(m, s, topo().with_nodes(1))
    assert [st.chunks[0].layers for st in stages] == [2, 3, 3, 3, 3, 3, 3, 2]
    assert stage_layers(m, s, 0) == [0, 1] and stage_layers(m, s, 1) == [2, 3, 4] and stage_layers(m, s, 7) == [20, 21]
    assert simulate(m, s, device_model(topo())).iteration_ms > 0
    with pytest.raises(SimError, match="do not split"):
        build_stage_events(_model(layers=23), s, topo())


def test_host_issues_ahead_of_the_gpu_across_collectives():
    """A host-bound event's issue overlaps the collective before it (the host does not wait for an
    async all-reduce): two events of 1 ms host, 0.1 ms GPU around a 0.6 ms all-reduce take 2 ms
    (the host's), not 1 + 0.6 + 1; a GPU-bound template is unchanged."""
    from megatron_oases.describe.ops import Collective
    from megatron_oases.pricing.event import Event
    from megatron_oases.sim.core.timeline import run_template

    a = Event(key="compute:a", name="a", kind="compute", op=Compute(name="a", gemm_flops=1.0))
    ar = Event(key="comm:ar", name="ar", kind="collective",
               op=Collective(name="ar", kind="all_reduce", axis="tp", group_size=2, payload_bytes=1))
    b = Event(key="compute:b", name="b", kind="compute", op=Compute(name="b", gemm_flops=1.0))
    price = {"compute:a": 1.0, "comm:ar": 0.6, "compute:b": 1.0}
    assert run_template((a, ar, b), 1, price).duration == pytest.approx(2.6)
    host = {"compute:a": (0.1, 1.0), "compute:b": (0.1, 1.0)}
    assert run_template((a, ar, b), 1, price, host=host).duration == pytest.approx(2.0)
    gpu_bound = {"compute:a": (1.0, 0.1), "compute:b": (1.0, 0.1)}
    assert run_template((a, ar, b), 1, price, host=gpu_bound).duration == pytest.approx(2.6)
