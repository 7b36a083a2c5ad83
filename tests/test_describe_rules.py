"""Rules that used to have several homes and now have one in ``describe/`` (issue 47 item 3): the
degrees a plan may give a block and its batch split (``describe.plan_degrees``), the model-state
bytes per parameter (``describe.optimizer``) and a 3-D GEMM's §3.1.2 cost (``describe.gemm_3d``).
Each is checked against what its callers did before and against its other readers."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_oases.describe.gemm_3d import gemm_3d_bytes
from megatron_oases.describe.optimizer import state_bytes_per_param
from megatron_oases.describe.plan_degrees import (degree_refusal, micro_batch_multiple, plan_degrees,
                                                  replica_share)
from megatron_oases.describe.split import sub_batches_at


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6, 8, 12, 16])
def test_plan_degrees_are_the_powers_of_two_that_divide_tp_and_nothing_else(tp):
    degrees = plan_degrees(tp)
    for d in range(0, 2 * tp + 1):
        power_of_two_divisor = d >= 1 and tp % d == 0 and bin(d).count("1") == 1
        assert (d in degrees) == power_of_two_divisor == (degree_refusal(d, tp) == ""), (tp, d)
    assert list(degrees) == sorted(degrees) and degrees[0] == 1
    refusal = degree_refusal(3, 4)
    assert "--tensor-model-parallel-size 4" in refusal and "\n" not in refusal


@pytest.mark.parametrize("oases", [False, True])
def test_the_micro_batch_multiple_is_what_every_replica_and_sub_batch_needs(oases):
    """A micro-batch splits over a degree's replicas and then into its sub-batches exactly when it
    is a multiple of ``micro_batch_multiple``; for a set of degrees, the most demanding one."""
    tp = 8
    for d in plan_degrees(tp):
        need, at = micro_batch_multiple((d,), tp=tp, oases=oases)
        assert at == d
        for mb in range(1, 4 * tp + 1):
            share, whole = replica_share(mb, d, tp), mb * d % tp == 0
            subs = sub_batches_at(d, oases=oases)
            assert (mb % need == 0) == (whole and share >= subs and share % subs == 0), (d, mb)
    need, at = micro_batch_multiple((1, 2, 8), tp=tp, oases=oases)  # a tie names the smaller degree
    assert (need, -at) == max((micro_batch_multiple((d,), tp=tp, oases=oases)[0], -d) for d in (1, 2, 8))
    assert all(need % micro_batch_multiple((d,), tp=tp, oases=oases)[0] == 0 for d in (1, 2, 8))


def test_planner_and_runtime_read_the_plan_degree_rule():
    """The planner offers exactly ``plan_degrees``; the runtime refuses the others in one line."""
    from megatron_oases.errors import ConfigError
    from megatron_oases.parallel.degree_groups import build_degree_groups
    from megatron_oases.plan.graph import candidate_strategies, model_from_mapping

    m = model_from_mapping({"hidden_size": 256, "num_layers": 2, "num_attention_heads": 8, "seq_length": 64,
                            "micro_batch_size": 8, "tp": 8, "dtype": "bf16", "sub_batches": 1})
    assert tuple(s.degree for s in candidate_strategies(m)) == plan_degrees(8)
    with pytest.raises(ConfigError, match="degree 3 is not a power of two dividing --tensor-model-parallel-size 6"):
        build_degree_groups([list(range(6))], [3], rank=0)


def test_planner_and_simulator_read_one_table_of_model_state_bytes():
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.plan.graph import model_from_mapping
    from megatron_oases.plan.memory import state_bytes_per_param as planner_bytes
    from megatron_oases.sim.core.memory import model_state_bytes
    from megatron_oases.sim.core.strategy import Strategy

    # Megatron's mixed precision with Adam: weights, fp32 main_grad, fp32 master copy of 2-byte
    # weights and two fp32 moments
    assert sum(state_bytes_per_param(bytes_per_element=2)) == 2 + 4 + 4 + 8
    assert sum(state_bytes_per_param(bytes_per_element=4)) == 4 + 4 + 8
    assert state_bytes_per_param(bytes_per_element=2, shard=4)[2] == (4 + 8) / 4
    assert state_bytes_per_param(bytes_per_element=2, grad_reduce_bytes=2)[1] == 2
    shape = {"hidden_size": 256, "num_layers": 2, "num_attention_heads": 8, "seq_length": 64,
             "micro_batch_size": 4}
    for dtype, dp, dist in (("bf16", 1, False), ("fp32", 1, False), ("bf16", 4, True)):
        plan = model_from_mapping({**shape, "tp": 2, "dtype": dtype})
        sim = sum(model_state_bytes(1000, GPTShape(**shape, dtype=dtype),
                                    Strategy(tp=2, dp=dp, distributed_optimizer=dist)))
        assert planner_bytes(plan, dp if dist else 1) * 1000 == pytest.approx(sim), (dtype, dp)


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_the_described_cube_gemms_move_what_section_3_1_2_says(variant):
    """Each Linear3D of ``describe``'s cube layer moves, forward, the §3.1.2 cost of its GEMM."""
    from megatron_oases.describe.cube_3d import cube_3d_gpt_layer
    from megatron_oases.describe.ops import GPT2, LayerVariant

    v = GPT2 if variant == "gpt2" else dataclasses.replace(
        LayerVariant(), gated=True, query_groups=4, normalization="RMSNorm", bias=False)
    b, s, h, heads, f, e, p = 8, 16, 64, 8, 128, 2, 2
    desc = cube_3d_gpt_layer(micro_batch=b, seq=s, hidden=h, heads=heads, ffn=f, tp=p ** 3, bytes_per_element=e,
                             variant=v)
    fwd = {c.name: c for c in desc.collectives("forward")}
    widths = {"qkv": (h, v.qkv_rows(h, heads)), "proj": (h, h), "fc1": (h, v.fc1_rows(f)), "fc2": (f, h)}
    for name, (n_in, n_out) in widths.items():
        gemm = [fwd[f"{name}.{k}"] for k in ("ag_a", "ag_w", "rs")]
        want = gemm_3d_bytes(b * s, n_in, n_out, p, elem_size=e)
        assert sum(c.payload_bytes for c in gemm) == pytest.approx(want["payload_bytes"]), name
        assert sum(c.wire_bytes_per_rank for c in gemm) == pytest.approx(want["wire_bytes_per_rank"]), name
        assert {c.group_size for c in gemm} == {want["group_size"]} and len(gemm) == want["collectives"]


@pytest.mark.parametrize("tp, seq", [(4, 62), (1, 64)])
def test_the_planner_refuses_sequence_parallelism_in_the_trainers_words(tp, seq):
    from megatron_oases.describe.megatron_1d import sequence_parallel_refusal
    from megatron_oases.plan.graph import PlanError, model_from_mapping

    with pytest.raises(PlanError) as e:
        model_from_mapping({"hidden_size": 256, "num_layers": 2, "num_attention_heads": 8, "seq_length": seq,
                            "micro_batch_size": 4, "tp": tp, "sequence_parallel": True})
    assert str(e.value) == sequence_parallel_refusal(tp, seq) != ""
