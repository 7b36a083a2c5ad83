"""Pipeline orders against Megatron-Core's own schedule code; interleaved 1F1B in the timeline."""
from __future__ import annotations

import types

import pytest

from megatron_oases.pricing.device_model import device_model
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.core.schedules import schedule_order
from megatron_oases.sim.core.timeline import simulate
from megatron_oases.topology import Level, Topology


def _megatron_order(stage: int, pp: int, m: int, vp: int | None) -> list[tuple[str, int, int]]:
    """The (phase, chunk, micro-batch) sequence Megatron's schedules run on ``stage``, built from
    Megatron's get_pp_rank_microbatches / get_schedule_table and the loops of
    forward_backward_pipelining_with(out)_interleaving (warm-up F, steady F+B, cool-down B)."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    group = types.SimpleNamespace(size=lambda: pp, rank=lambda: stage)
    comm = types.SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp)
    chunks = vp or 1
    total, _, warm, remaining = get_pp_rank_microbatches(m, chunks, pp, p2p_communicator=comm)
    table = get_schedule_table(m, chunks, pp)  # microbatch_group_size_per_vp_stage defaults to pp

    def f(k):
        mb, c = table[k]
        return ("F", c, mb)

    def b(k):
        mb, c = table[k]
        return ("B", chunks - 1 - c, mb)
    order = [f(k) for k in range(warm)]
    for k in range(remaining):
        order += [f(k + warm), b(k)]
    return order + [b(k) for k in range(remaining, total)]


@pytest.mark.parametrize("pp,m,vp", [(2, 4, None), (4, 8, None), (4, 3, None), (2, 4, 2), (4, 8, 2),
                                     (4, 8, 3), (2, 6, 4), (4, 4, 2), (3, 6, 2)])
def test_orders_match_megatron(pp: int, m: int, vp: int | None):
    for stage in range(pp):
        ours = schedule_order("1f1b", stage, pp, m, vp or 1)
        assert ours == _megatron_order(stage, pp, m, vp), (stage, ours)
        chunks = vp or 1
        assert sorted(ours) == sorted((ph, c, i) for ph in "FB" for c in range(chunks) for i in range(m))
        for c in range(chunks):
            for i in range(m):
                assert ours.index(("F", c, i)) < ours.index(("B", c, i))


def test_gpipe_and_no_pipelining_orders():
    assert schedule_order("gpipe", 0, 2, 2) == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]
    assert schedule_order("1f1b", 0, 1, 2) == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]


def _flat(n: int) -> Topology:
    return Topology(name="flat", device="a100-80gb", levels=(Level(
        name="nvswitch", size=n, scope="intra_node", p2p_bandwidth_GBps=1e6, group_bandwidth_GBps=1e6),))


def test_interleaving_shrinks_the_bubble():
    """Megatron-LM §2.2.2: the bubble shrinks by the number of chunks (cheap P2P, same work)."""
    model = GPTShape(num_layers=16, hidden_size=1024, num_attention_heads=16, seq_length=512, padded_vocab_size=4096,
                     micro_batch_size=2)
    dm = device_model(_flat(4))
    r1 = simulate(model, Strategy(pp=4, num_microbatches=8, optimizer_step=False), dm)
    r2 = simulate(model, Strategy(pp=4, num_microbatches=8, virtual_stages=2, optimizer_step=False), dm)
    assert r2.iteration_ms < r1.iteration_ms
    assert r2.bubble_fraction < 0.75 * r1.bubble_fraction
    assert {p.chunk for p in r2.placements} == {0, 1}
    # the first virtual stage of chunk 1 (on stage 0) waits for chunk 0 of the last stage
    f = {(p.stage, p.chunk, p.phase, p.micro_batch): p for p in r2.placements}
    assert f[(0, 1, "F", 0)].start >= f[(3, 0, "F", 0)].end
    assert f[(3, 0, "B", 0)].start >= f[(0, 1, "B", 0)].end


@pytest.mark.parametrize("kw,msg", [
    (dict(pp=1, dp=4, virtual_stages=2), "need the 1f1b schedule with PP > 1"),
    (dict(pp=4, virtual_stages=3), "not divisible by PP 4 x virtual stages 3"),
    (dict(pp=4, virtual_stages=2, num_microbatches=6), r"micro-batches \(6\) to be a multiple of PP 4"),
    (dict(pp=2, dp=2, virtual_stages=2, pipeline_schedule="gpipe"), "need the 1f1b schedule"),
])
def test_interleaved_bad_input(kw, msg):
    from megatron_oases.pricing.device_model import SimError

    model = GPTShape(num_layers=16, hidden_size=256, num_attention_heads=4, seq_length=64, padded_vocab_size=512,
                     micro_batch_size=2)
    with pytest.raises(SimError, match=msg):
        simulate(model, Strategy(**{"num_microbatches": 8, **kw}), device_model(_flat(4)))
