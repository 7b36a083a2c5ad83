"""The 3-D cube as a planner strategy family: its blocks, parameters and groups come from
``describe.cube_3d``; plans over megatron, atp and 3d are optimal (brute force) and never mix the
cube with other layouts; a 3-D plan's launch flags train like one rank."""
from __future__ import annotations

import shlex

import numpy as np
import pytest

from megatron_oases.describe.cube_3d import cube_3d_gpt_layer
from megatron_oases.describe.registry import layer_params
from megatron_oases.plan.cost_model import build_cost_model
from megatron_oases.plan.graph import BlockStrategy, PlanModel, candidate_strategies, family_of, model_from_mapping
from megatron_oases.plan.ilp import brute_force, evaluate, solve
from megatron_oases.plan.plan_cli import build_parser, make_plan
from megatron_oases.plan.plan_file import launch_flags, plan_launch_flags
from megatron_oases.runtime.spawn import run_on_ranks
from megatron_oases.topology import load_topology
from tests.rank_fns import train_and_gather


def test_cube_family_splits_prices_and_counts_like_the_description():
    m = PlanModel(num_layers=1, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=8,
                  tp=8, sub_batches=1)
    s = BlockStrategy(degree=8, family="3d")
    fam = family_of(s)
    blocks = fam.split(fam.describe(s, m, 8))
    desc = cube_3d_gpt_layer(micro_batch=8, seq=64, hidden=256, heads=8, ffn=1024, tp=8, bytes_per_element=2)
    assert [b.kind for b in blocks] == ["attention", "mlp"]
    assert sum(len(b.fwd_compute) + len(b.fwd_comm) for b in blocks) == len(desc.forward)
    assert sum(len(b.bwd_compute) + len(b.bwd_comm) for b in blocks) == len(desc.backward)
    assert blocks[1].fwd_compute[0].name == "3d.ln2" and blocks[0].bwd_compute[0].name == "3d.proj.bwd"
    assert fam.params(s, m, "attention") + fam.params(s, m, "mlp") == layer_params("3d", 256, 1024, 8, None)
    assert fam.group_ranks(s, "cube_z") == (0, 1) and fam.group_ranks(s, "cube_x") == (0, 2)
    assert fam.group_ranks(s, "cube_y") == (0, 4) and s.label == "3d8"


def test_cube_needs_the_stock_executor_and_a_cube():
    oases = PlanModel(num_layers=1, hidden_size=256, num_attention_heads=8, seq_length=64,
                      micro_batch_size=8, tp=8)
    assert all(s.family != "3d" for s in candidate_strategies(oases, families=("megatron", "3d")))
    stock = PlanModel(num_layers=1, hidden_size=256, num_attention_heads=8, seq_length=64,
                      micro_batch_size=8, tp=4, sub_batches=1)
    assert all(s.family != "3d" for s in candidate_strategies(stock, families=("megatron", "3d")))


def test_plans_over_all_families_are_optimal_and_never_mix_the_cube():
    topo = load_topology("pcie-3090-2node")
    m = PlanModel(num_layers=2, hidden_size=512, num_attention_heads=8, seq_length=256, micro_batch_size=4,
                  tp=8, sub_batches=1)
    cm = build_cost_model(m, topology=topo, global_batch_size=8, granularity="block",
                          families=("megatron", "atp", "3d"))
    labels = [s.label for s in cm.strategies]
    assert "3d8" in labels and "atp4x2" in labels and "tp8" in labels
    best, assignment = brute_force(cm.problem)
    sol = solve(cm.problem, solver="dp")
    assert sol.time_ms == pytest.approx(best)
    assert evaluate(cm.problem, sol.assignment)[0] == pytest.approx(evaluate(cm.problem, assignment)[0])
    k3d, k8 = labels.index("3d8"), labels.index("tp8")
    n = len(cm.blocks)
    assert evaluate(cm.problem, (k3d,) * (n - 1) + (k8,))[0] == np.inf
    assert np.isfinite(evaluate(cm.problem, (k3d,) * n)[0])


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "8", "--seq-length", "8",
         "--micro-batch-size", "4", "--global-batch-size", "8"]
TRAIN = ["--vocab-size", "128", "--make-vocab-size-divisible-by", "16", "--optimizer", "sgd", "--lr", "0.05",
         "--train-iters", "2", "--seed", "3", "--device", "cpu"]


def test_a_3d_plan_launches_and_trains_like_one_rank(tmp_path):
    out = tmp_path / "plan.json"
    a = build_parser().parse_args(MODEL + ["--tensor-model-parallel-size", "8", "--topology", "dgx-a100",
                                           "--families", "3d", "--sub-batches", "1", "--out", str(out)])
    data, _, _ = make_plan(a)
    flags = plan_launch_flags(data, str(out))
    assert flags["--tp-backend"] == "3d"
    argv = MODEL + TRAIN + shlex.split(launch_flags(flags))
    got = run_on_ranks(train_and_gather, 8, args=(argv,), timeout_s=240)[-1]["losses"]
    want = run_on_ranks(train_and_gather, 1, args=(MODEL + TRAIN,), timeout_s=120)[-1]["losses"]
    assert len(got) == 2 and all(abs(g - w) / w <= 1e-5 for g, w in zip(got, want)), (got, want)


def test_llama_models_on_every_family_follow_their_descriptions():
    """A Llama-style model (GQA, SwiGLU, RMSNorm, no bias) is priced on the ATP and 3-D families
    from their descriptions: parameters per block sum to the layer's, and a mesh or cube that
    would split a key/value group is not a candidate."""
    from megatron_oases.describe.ops import LayerVariant

    base = dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=8,
                tp=8, sub_batches=1, swiglu=True, ffn_hidden_size=512, normalization="RMSNorm",
                add_bias_linear=False)
    variant = LayerVariant(query_groups=2, gated=True, normalization="RMSNorm", bias=False)
    m = model_from_mapping(dict(base, num_query_groups=2))
    assert m.variant == variant
    for s in candidate_strategies(m, families=("megatron", "atp", "3d")):
        fam = family_of(s)
        if s.family == "megatron":
            continue
        total = fam.params(s, m, "attention") + fam.params(s, m, "mlp")
        assert total == layer_params(s.family, 256, 512, 8, s.layout, heads=8, variant=variant)
    feasible = {s.label for s in candidate_strategies(m, families=("atp", "3d"))}
    assert "3d8" in feasible  # 2 groups over p = 2
    assert not any(lbl.startswith("atp") for lbl in feasible)  # 2 groups never cover 8 mesh ranks
    eight = {s.label for s in candidate_strategies(model_from_mapping(dict(base, num_query_groups=8)),
                                                   families=("atp",))}
    assert eight and all(lbl.startswith("atp") for lbl in eight)
    topo = load_topology("pcie-3090-2node")
    cm = build_cost_model(m, topology=topo, global_batch_size=16, families=("megatron", "3d"))
    sol = solve(cm.problem, solver="dp")
    assert sol.time_ms == pytest.approx(brute_force(cm.problem)[0])
