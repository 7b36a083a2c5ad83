"""ATP's candidate meshes and the d1 x d2 = TP rule have one home (``describe/atp_meshes.py``):
the planner, the simulator's search and the mesh picker offer its meshes, and every place that
validates a mesh refuses a wrong one in its words (issue 36: the three enumerations disagreed,
the planner never tried 2 x 3 at TP 6)."""
from __future__ import annotations

import pytest

from megatron_oases.describe.atp_meshes import atp_mesh_refusal, atp_meshes
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.errors import ConfigError
from megatron_oases.parallel.mesh import DeviceMesh
from megatron_oases.plan.atp_mesh import MeshError, axis_groups, enumerate_meshes, search_mesh
from megatron_oases.plan.graph import BlockStrategy, PlanModel, candidate_strategies, feasible
from megatron_oases.run_config import run_config
from megatron_oases.sim.core.search import SearchSpace, candidates
from megatron_oases.train_args import build_parser, validate_config
from megatron_oases.describe.atp_2d import atp_layout

# 24 heads of 8, an FFN of 768 and the vocabulary split over every mesh of TP 6, 8 and 12.
SHAPE = dict(num_layers=2, hidden_size=192, num_attention_heads=24, seq_length=16, micro_batch_size=2,
             padded_vocab_size=1536)


def test_the_candidate_set():
    assert atp_meshes(6, with_1d=True) == ((6, 1), (3, 2), (2, 3), (1, 6))
    assert atp_meshes(6, with_1d=False) == ((3, 2), (2, 3), (1, 6))
    assert atp_meshes(1, with_1d=False) == ()
    assert enumerate_meshes(12) == list(atp_meshes(12, with_1d=True))  # the picker keeps (TP, 1)


@pytest.mark.parametrize("tp", [6, 8, 12])
def test_planner_and_search_offer_the_same_meshes(tp):
    plan = candidate_strategies(PlanModel(**SHAPE, tp=tp, sub_batches=1), families=("atp",))
    space = SearchSpace(gpus=tp, global_batch=2, tp_sizes=(tp,), pp_sizes=(1,), backends=("atp",),
                        schedules=("default",), recompute=("off",))
    searched = [c.strategy.layout.shape for c in candidates(GPTShape(**SHAPE), space)]
    # both offer (T, 1) as ATP's layer, which keeps more than Megatron's (plan.graph._atp_layouts)
    assert [s.layout.shape for s in plan] == searched == list(atp_meshes(tp, with_1d=True))
    if tp == 6:
        assert (2, 3) in searched


def _raised(exc_type, fn, *args, **kw) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args, **kw)
    return str(info.value)


def test_every_check_refuses_3x3_at_tp8_in_the_same_words():
    want = atp_mesh_refusal((3, 3), 8)
    assert want.startswith("--atp-mesh 3,3: d1 x d2 = 9 must equal --tensor-model-parallel-size 8")
    assert "one of: 8,1 4,2 2,4 1,8" in want
    argv = ["--tensor-model-parallel-size", "8", "--tp-backend", "atp", "--atp-mesh", "3,3",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8"]
    trainer = _raised(ConfigError, validate_config, run_config(build_parser().parse_args(argv)), 8, False)
    runtime = _raised(ConfigError, DeviceMesh, 3, 3, tuple(range(8)))
    planner = feasible(BlockStrategy(degree=8, family="atp", layout=atp_layout(3, 3)), PlanModel(**SHAPE, tp=8))
    picker = _raised(MeshError, search_mesh, "dgx-a100", 8, GPTShape(**SHAPE), meshes=[(3, 3)])
    groups = _raised(MeshError, axis_groups, 8, 3, 3, 1)
    assert trainer == runtime == planner == picker == groups == want


def test_the_simulators_strategy_refuses_in_the_same_words():
    from megatron_oases.pricing.device_model import SimError
    from megatron_oases.sim.core.strategy import Strategy

    got = _raised(SimError, Strategy, tp=8, pp=1, dp=1, num_microbatches=1, backend="atp", layout=atp_layout(3, 3))
    assert got == atp_mesh_refusal((3, 3), 8)


def test_megatron_lm_flags_refuse_in_the_same_words(monkeypatch, capsys):
    from test_megatron_lm_flags import parse  # the Megatron-LM-like parser with our provider

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        parse(["--tensor-model-parallel-size", "8", "--num-attention-heads", "8", "--tp-backend", "atp",
               "--atp-mesh", "3,3"], world=8, monkeypatch=monkeypatch)
    assert capsys.readouterr().err.strip() == "pretrain_gpt.py: error: " + atp_mesh_refusal((3, 3), 8)
