"""One reading of "Oases at TP 1" (``describe.split.oases_splits``): the trainer runs a dense model's
layers as stock ones there under ``--schedule oases`` (``options.oases_runs``), so ``sim`` and
``plan`` price exactly what ``--schedule default`` prices (time and memory, with either
recompute), nothing refuses a micro-batch that is not split, and an MoE model over EP > 1
still splits (its all-to-alls to overlap). And ``sim``'s ``--moe-aux-loss-coeff``: the flag the
trainer declares, priced (the aux loss joins the sub-batches) and launched as given."""
from __future__ import annotations

import dataclasses
import re
import shlex

import pytest

from megatron_oases.describe.moe import MoEShape
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.describe.split import split_refusal
from megatron_oases.pricing.device_model import SimError, device_model
from megatron_oases.sim.calibrate.profiler import resolve_topology
from megatron_oases.sim.core.strategy import Strategy, block_sub_batches, check
from megatron_oases.sim.core.timeline import simulate

DENSE = dict(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, padded_vocab_size=512)
MOE = MoEShape(num_experts=4, ffn=512, topk=2, dispatcher="alltoall")


def _priced(model: GPTShape, **kw):
    """(iteration ms, per-stage memory) of ``model`` on one DGX A100 (DP 8)."""
    dm = device_model(resolve_topology("dgx-a100", 8))
    r = simulate(model, Strategy(dp=8, num_microbatches=2, **kw), dm, timeline=False)
    return r.iteration_ms, [dataclasses.astuple(m) for m in r.memory]


@pytest.mark.parametrize("recompute", [False, True])
def test_sim_prices_a_dense_tp1_oases_run_as_the_default_schedule(recompute):
    model = GPTShape(**DENSE, micro_batch_size=2)
    oases = Strategy(dp=2, schedule="oases", recompute=recompute)
    assert not oases.oases_runs and block_sub_batches(oases) == 1
    assert _priced(model, schedule="oases", recompute=recompute) == _priced(model, recompute=recompute)


def test_sim_still_splits_an_moe_model_at_tp1_over_ep2():
    model = GPTShape(**DENSE, micro_batch_size=2, moe=MOE)
    oases = Strategy(dp=2, ep=2, schedule="oases")
    assert oases.oases_runs and block_sub_batches(oases) == 2
    assert Strategy(dp=2, ep=1, schedule="oases").oases_runs is False  # EP 1: no all-to-all either
    assert _priced(model, ep=2, schedule="oases") != _priced(model, ep=2)


def _trainer_refusal(argv: list[str], world: int) -> str:
    from megatron_oases.errors import ConfigError
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    try:
        validate_config(run_config(build_parser().parse_args(argv)), world, cuda=False)
    except ConfigError as e:
        return str(e)
    return ""


def _plan_refusal(argv: list[str]) -> str:
    from megatron_oases.plan.cost_model import build_cost_model
    from megatron_oases.plan.model import PlanError
    from megatron_oases.plan.plan_cli import build_parser, model_from_args
    from megatron_oases.sim.calibrate.profiler import local_topology

    try:
        m = model_from_args(build_parser().parse_args([*argv, "--topology", "local"]))
        build_cost_model(m, topology=local_topology(2), global_batch_size=4, gpu="a100-80gb")
    except PlanError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("experts", [0, 4])
def test_micro_batch_1_is_refused_only_where_it_is_split(experts):
    """Dense at TP 1: ``--schedule oases --micro-batch-size 1`` runs (stock layers) in the trainer,
    Megatron-LM's early check, ``sim`` and ``plan``; an MoE model over EP 2 splits, so all four refuse it."""
    from megatron_oases.megatron_lm.flags import early_refusal

    moe = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
           "--disable-bias-linear"] if experts else []
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "4", "--schedule", "oases", *moe]
    why = split_refusal(1) if experts else ""
    model = GPTShape(**DENSE, micro_batch_size=1, moe=MOE if experts else None)
    model = dataclasses.replace(model, variant=dataclasses.replace(model.variant, bias=False))
    try:
        check(model, Strategy(dp=2, ep=2 if experts else 1, num_microbatches=2, schedule="oases"), 2)
        sim = ""
    except SimError as e:
        sim = str(e)
    assert [_trainer_refusal(argv, 2), early_refusal(argv) or "", sim, _plan_refusal(argv)] == [why] * 4


def test_plan_prices_a_dense_tp1_oases_run_as_the_default_schedule():
    """The cost model's node, edge and memory terms are the default schedule's; the plan file still
    records the launch's ``--schedule oases`` (``check_plan_launch`` compares it)."""
    from megatron_oases.plan.cost_model import build_cost_model
    from megatron_oases.plan.plan_cli import build_parser, model_from_args, schedule_of
    from megatron_oases.sim.calibrate.profiler import local_topology

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--vocab-size", "128", "--micro-batch-size", "2", "--recompute-granularity", "full",
            "--recompute-method", "uniform"]
    problems, schedules = [], []
    for schedule in ("default", "oases"):
        a = build_parser().parse_args([*base, "--schedule", schedule, "--topology", "local"])
        m = model_from_args(a)
        p = build_cost_model(m, topology=local_topology(2), global_batch_size=8, gpu="a100-80gb").problem
        problems.append([p.node.tolist(), p.edge.tolist(), p.mem.tolist(), p.peak.tolist(), p.mem_const])
        schedules.append((m.sub_batches, schedule_of(m, a)))
    assert problems[0] == problems[1]
    assert schedules == [(1, "default"), (1, "oases")]


def test_search_lists_no_tp1_oases_twin_of_a_default_row():
    from megatron_oases.sim.core.search import SearchSpace, candidates

    def rows(model, schedules, ep_sizes=None):
        space = SearchSpace(gpus=4, global_batch=16, tp_sizes=(1, 2), pp_sizes=(1,), backends=("megatron",),
                            schedules=schedules, recompute=("off",), sequence_parallel=(False, True),
                            ep_sizes=ep_sizes)
        return {(c.tp, c.ep, c.schedule) for c in candidates(model, space) if c.strategy is not None}

    dense = GPTShape(**DENSE, micro_batch_size=2)
    assert rows(dense, ("default", "oases")) == {(1, 1, "default"), (2, 1, "default"), (2, 1, "oases")}
    assert (1, 1, "oases") in rows(dense, ("oases",))  # asked for alone: priced as stock, not dropped
    moe = dataclasses.replace(dense, moe=MOE, variant=dataclasses.replace(dense.variant, bias=False))
    assert {r for r in rows(moe, ("default", "oases"), ep_sizes=(1, 2)) if r[0] == 1} == {
        (1, 1, "default"), (1, 2, "default"), (1, 2, "oases")}


SIM_MOE = ["--topology", "dgx-a100", "--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "4",
           "--seq-length", "1024", "--micro-batch-size", "2", "--global-batch-size", "16", "--num-experts", "4",
           "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]


def test_sim_prices_the_aux_loss_join_and_launches_the_coefficient(capsys):
    """``--moe-aux-loss-coeff`` (list-valued, as Megatron-LM's) reaches ``MoEShape.aux_loss``, so
    under Oases the sub-batches join after routing; ``sim --search``'s launch prints it as the
    trainer parses it back."""
    from megatron_oases.run_config import run_config
    from megatron_oases.sim.frontends.cli import build_parser, model_from_args, sim_main, simulation_inputs
    from megatron_oases.train_args import build_parser as train_parser

    aux = ["--moe-aux-loss-coeff", "0.01"]
    model, st, dm = simulation_inputs(build_parser().parse_args([*SIM_MOE, *aux, "--ep", "2", "--schedule", "oases"]))
    assert model.moe.aux_loss and not model_from_args(build_parser().parse_args(SIM_MOE)).moe.aux_loss
    apart = dataclasses.replace(model, moe=dataclasses.replace(model.moe, aux_loss=False))
    # fp32 (unstated precision): the sub-batches' compute outlasts the all-to-alls, so the join shows
    assert simulate(model, st, dm, timeline=False).iteration_ms > simulate(apart, st, dm, timeline=False).iteration_ms
    assert sim_main(["--search", *SIM_MOE, *aux, "--tp-sizes", "1", "--pp-sizes", "1", "--ep-sizes", "2",
                     "--schedules", "oases", "--recompute-options", "off", "--jobs", "1",
                     "--search-plans", "0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("launch (trainer):"))
    argv = shlex.split(line.split(":", 1)[1])
    launched = run_config(train_parser().parse_args(argv[argv.index("--nproc-per-node") + 2:]))
    given = run_config(train_parser().parse_args(aux))
    assert launched.moe_aux_loss_coeff == given.moe_aux_loss_coeff and launched.schedule == "oases"


def test_coarse_oases_recompute_at_tp1_is_refused_alike():
    """``--no-oases-fine-grained-recompute`` chooses how the executor recomputes, which does not run
    at TP 1 (dense): the trainer, ``sim`` and ``plan`` refuse it with one line."""
    from megatron_oases.describe.split import unsplit_refusal
    from megatron_oases.plan.model import PlanError, PlanModel

    why = unsplit_refusal("--no-oases-fine-grained-recompute")
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "2", "--schedule", "oases",
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--no-oases-fine-grained-recompute"]
    assert _trainer_refusal(argv, 1) == why
    with pytest.raises(SimError, match="^" + re.escape(why) + "$"):
        Strategy(schedule="oases", recompute=True, fine_grained_recompute=False)
    with pytest.raises(PlanError) as plan:
        PlanModel(**DENSE, micro_batch_size=2, tp=1, recompute=True, fine_grained_recompute=False, sub_batches=2)
    assert str(plan.value) == why
    Strategy(tp=2, schedule="oases", recompute=True, fine_grained_recompute=False)  # where it runs: taken
