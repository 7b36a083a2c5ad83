"""Simulator: Megatron-Core DDP's --overlap-grad-reduce / --overlap-param-gather (per-bucket DP
collectives released during the last backward, gathers ahead of the forward)."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_oases.pricing.device_model import SimError, device_model
from megatron_oases.sim.frontends.cli import sim_main
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.sim.core.events import build_stage_events, layer_tensors, stage_param_tensors
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.core.timeline import simulate
from megatron_oases.sim.core.trace import TIDS, chrome_trace
from megatron_oases.topology import Level, Topology
from tests.script_modules import load_script

MODEL = GPTShape(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=512, padded_vocab_size=8192,
                 micro_batch_size=2)


def topo(nodes: int = 4, ib_GBps: float = 25) -> Topology:
    lv = [Level(name="nvlink", size=8, scope="intra_node", p2p_bandwidth_GBps=300, group_bandwidth_GBps=300,
                latency_us=2)]
    if nodes > 1:
        lv.append(Level(name="ib", size=nodes, scope="inter_node", p2p_bandwidth_GBps=ib_GBps,
                        group_bandwidth_GBps=ib_GBps, latency_us=4))
    return Topology(name="t", levels=tuple(lv), device="a100-80gb")


def dp_exposed(r) -> float:
    """Exposed time of the DP gradient reduction, summed over stages (after each stage's last
    backward and send)."""
    end = {}
    for p in r.placements:
        end[p.stage] = max(end.get(p.stage, 0.0), p.end + r.p2p_ms[p.stage][p.chunk][1])
    return sum(max(0.0, x.end - max(x.start, end[x.stage])) for x in r.tail if x.name.startswith("grad."))


@pytest.mark.parametrize("kw", [dict(tp=2, pp=1, dp=16), dict(tp=2, pp=2, dp=8, distributed_optimizer=True),
                                dict(tp=2, pp=2, dp=8, virtual_stages=2, distributed_optimizer=True)])
def test_overlap_hides_part_of_the_dp_reduction(kw):
    dm = device_model(topo())
    base = Strategy(num_microbatches=4, ddp_bucket_size=3_000_000, **kw)
    off = simulate(MODEL, base, dm)
    on = simulate(MODEL, dataclasses.replace(base, overlap_grad_reduce=True), dm)
    assert 0.0 <= dp_exposed(on) < dp_exposed(off)
    assert on.iteration_ms < off.iteration_ms
    assert all(x.exposed_comm_ms >= 0.0 and x.bubble_ms >= -1e-9 for x in on.stages)
    assert on.grad_ms == pytest.approx(off.grad_ms, rel=0.2)  # same bytes, more (smaller) collectives


def test_a_fast_reduction_leaves_only_the_last_buckets_exposed():
    """DP 2 inside a node, a bucket about a layer: a bucket's all-reduce is far shorter than a
    layer's backward, so every bucket finishes under the backward but the last two: layer 0's
    (released after its backward, only the embedding's short backward left) and the embeddings'
    (ready at the very end)."""
    dm = device_model(topo(nodes=1))
    s = Strategy(tp=4, pp=1, dp=2, num_microbatches=2, overlap_grad_reduce=True)
    s = dataclasses.replace(s, ddp_bucket_size=sum(layer_tensors(MODEL, s, 0)))
    r = simulate(MODEL, s, dm)
    assert len(build_stage_events(MODEL, s, dm.topology)[0].grad_buckets) == MODEL.num_layers + 1
    end = max(p.end for p in r.placements)
    grads = [x for x in r.tail if x.name == "grad.ar"]
    assert all(x.end <= end for x in grads[:-2])
    assert 0.0 < dp_exposed(r) <= sum(x.end - x.start for x in grads[-2:]) + 1e-9
    off = simulate(MODEL, dataclasses.replace(s, overlap_grad_reduce=False), dm)
    assert dp_exposed(r) < 0.5 * dp_exposed(off)
    # the buckets get their own trace row, beside the backward's TP collectives
    rows = {e["tid"] for e in chrome_trace(r)["traceEvents"] if e.get("name") == "grad.ar"}
    assert rows == {TIDS["dp"]}


@pytest.mark.parametrize("kw", [dict(tp=2, pp=1, dp=16), dict(tp=1, pp=4, dp=8, distributed_optimizer=True),
                                dict(tp=2, pp=2, dp=8, virtual_stages=2, distributed_optimizer=True)])
def test_buckets_add_up_to_the_whole_reduction(kw):
    t = topo()
    base = Strategy(num_microbatches=4, **kw)
    for size in (0, 2_000_000, 1):
        s = dataclasses.replace(base, overlap_grad_reduce=True, overlap_param_gather=base.distributed_optimizer,
                                ddp_bucket_size=size)
        whole = build_stage_events(MODEL, base, t)
        for i, st in enumerate(build_stage_events(MODEL, s, t)):
            assert sum(b.params for b in st.grad_buckets) == sum(stage_param_tensors(MODEL, s, i))
            assert sum(b.reduce.nbytes for b in st.grad_buckets) == whole[i].grad_allreduce.nbytes
            if s.overlap_param_gather:
                assert sum(b.gather.nbytes for b in st.grad_buckets) == whole[i].param_allgather.nbytes
            # Megatron buckets only the first stage's first chunk; later chunks reduce as one group
            assert len({b.chunk for b in st.grad_buckets}) == len(st.chunks)
            if i > 0 and not (i == s.pp - 1 and s.distributed_optimizer and s.virtual_stages == 1):
                assert len(st.grad_buckets) == len(st.chunks)


def test_default_bucket_size_is_megatrons():
    assert Strategy(dp=8).bucket_params == 40_000_000
    assert Strategy(dp=64).bucket_params == 64_000_000
    assert Strategy(dp=64, ddp_bucket_size=5).bucket_params == 5


def test_param_gather_overlap_hides_part_of_the_all_gather():
    dm = device_model(topo())
    base = Strategy(tp=2, pp=1, dp=16, num_microbatches=4, distributed_optimizer=True, overlap_grad_reduce=True,
                    ddp_bucket_size=3_000_000)
    off = simulate(MODEL, base, dm)
    on = simulate(MODEL, dataclasses.replace(base, overlap_param_gather=True), dm)
    whole = sum(x.end - x.start for x in off.tail if x.name == "param.ag")
    wait = sum(x.end - x.start for x in on.tail if x.name == "param.ag.wait")
    assert 0.0 < wait < whole


def test_param_gather_overlap_needs_the_distributed_optimizer(capsys):
    with pytest.raises(SimError, match="--overlap-param-gather needs --use-distributed-optimizer"):
        Strategy(dp=2, overlap_grad_reduce=True, overlap_param_gather=True)
    argv = ["--topology", "dgx-a100", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads",
            "16", "--seq-length", "512", "--micro-batch-size", "2", "--tp", "8", "--overlap-grad-reduce",
            "--overlap-param-gather"]
    assert sim_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overlap-param-gather" in err[0] and "--use-distributed-optimizer" in err[0]
    assert sim_main([*argv, "--use-distributed-optimizer"]) == 0
    assert "DP overlap grad + param" in capsys.readouterr().out


def test_3072_gpus_with_dp_overlap_keep_events_deduplicated():
    bench = load_script("scripts/bench_sim_scale.py")
    off, _ = bench.run()
    on, _ = bench.run(ddp_overlap=True)
    buckets = sum(len(st.grad_buckets) for st in build_stage_events(on.model, on.strategy,
                                                                   bench.cluster(3072)))
    assert buckets > 2 * on.strategy.pp  # stage 0 is bucketed
    assert on.unique_events <= off.unique_events + 10  # equal-sized buckets share their events
    assert on.iteration_ms < off.iteration_ms


def test_predict_maps_the_trainers_overlap_grad_reduce():
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser as train_parser

    train = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--device", "cpu"]
    for extra, want in (([], False), (["--overlap-grad-reduce"], True)):
        _, s = sim_inputs_from_train_args(train_parser().parse_args(train + extra), 4)
        assert s.overlap_grad_reduce is want and s.overlap_param_gather is False
