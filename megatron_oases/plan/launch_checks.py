"""The launch a plan is made for, checked before any pricing: its world and data-parallel size,
one pipeline stage's layers, the recompute the planner prices, and no virtual stages. Each check
is one line naming the flag (``PlanError``), given before any pricing (``plan_cli.make_plan``); ``sim
--search`` reads the virtual-stage one for its per-block plans."""
from __future__ import annotations

import argparse
import dataclasses

from ..errors import range_refusal
from ..flags import filled_recompute_num_layers, option
from .graph import PlanError, PlanModel


VIRTUAL_STAGES_FLAG = "--num-virtual-stages-per-pipeline-rank"
"""Megatron-LM's flag for virtual stages per rank (``RunConfig.megatron_lm``; the trainer and ``sim``
take ``--num-layers-per-virtual-pipeline-stage``)."""


def virtual_stages_refusal(a: argparse.Namespace) -> str:
    """The one line refusing the virtual pipeline stages ``a`` names ("" without them):
    :func:`interleaved_refusal` for the first of Megatron-LM's two spellings given."""
    given = [(flag, v) for flag, v in ((option("num_layers_per_virtual_pipeline_stage"),
                                        a.num_layers_per_virtual_pipeline_stage),
                                       (VIRTUAL_STAGES_FLAG, a.num_virtual_stages_per_pipeline_rank)) if v is not None]
    return interleaved_refusal(*given[0]) if given else ""


def interleaved_refusal(flag: str, value: int) -> str:
    """Why no plan is made for a launch with virtual pipeline stages (``flag value``): the planner
    prices a stage as one contiguous run of layers under non-interleaved 1F1B (one lock-step chain,
    its bubble, its micro-batches in flight: ``cost_model.build_cost_model``'s ``pipeline``) and
    writes the same degrees for every stage's layers in order (``plan_file.plan_record``), neither
    of which an interleaved stage is (its layers are ``v`` chunks spread over the model). ``plan``
    refuses such a launch with it, and ``sim --search`` gives no interleaved candidate a per-block
    plan for it (``sim.frontends.search_plans.plan_refusal``): one rule, one wording."""
    return (f"{flag} {value}: plan prices each pipeline stage as contiguous layers under non-interleaved 1F1B, "
            f"not virtual stages; drop it to plan the non-interleaved launch, or compare interleaved "
            f"strategies with `megatron-oases sim --search`")


def world_given(a: argparse.Namespace) -> bool:
    """Whether the flags name the launch's world (else the plan takes the topology's ranks)."""
    return a.nproc_per_node is not None or a.data_parallel_size is not None


def check_recompute_layers(a: argparse.Namespace, stage_layers: int) -> None:
    """The recompute the planner prices is every layer of a stage or none: ``uniform`` with
    groups of one layer, or ``block`` covering the stage; one line naming the flag otherwise (and
    the trainer's pairing of the flags)."""
    n = filled_recompute_num_layers(a, stage_layers, PlanError)  # Megatron's pairing, the trainer's words
    if n is None:
        return
    method, meth, num = a.recompute_method, option("recompute_method"), option("recompute_num_layers")
    if method == "uniform" and n != 1:
        raise PlanError(f"{meth} uniform {num} {n} checkpoints groups of {n} layers, which the planner does not "
                        f"price; plan with {num} 1")
    if method == "block" and n < stage_layers:
        raise PlanError(f"{meth} block {num} {n} recomputes {n} of a stage's {stage_layers} layers, which the "
                        f"planner does not price (every layer or none); plan with {num} {stage_layers}")


def stage_model(m: PlanModel, pp: int) -> PlanModel:
    """The model of one pipeline stage: its ``num_layers / pp`` layers (Megatron's even split,
    which the trainer requires); one line naming the flag when they do not divide."""
    if m.num_layers % pp:
        raise PlanError(f"{option('num_layers')} {m.num_layers} is not a multiple of "
                        f"{option('pipeline_model_parallel_size')} {pp}; give a divisor")
    return dataclasses.replace(m, num_layers=m.num_layers // pp)


def launch_world(a: argparse.Namespace, ranks: int, topology: str, tp: int, pp: int = 1) -> tuple[int, int]:
    """(world size, data-parallel size) of the launch: ``--nproc-per-node`` x ``--nnodes``, or
    ``--data-parallel-size`` x TP x PP, else the topology's ``ranks``; DP = world / (TP x PP), as
    the trainer derives it. One line naming the flag when they disagree or do not fit."""
    for flag, v in ((option("nproc_per_node"), a.nproc_per_node), ("--nnodes", a.nnodes),
                    ("--data-parallel-size", a.data_parallel_size),
                    (option("pipeline_model_parallel_size"), pp)):
        if v is not None and v < 1:
            raise PlanError(range_refusal(flag, v, 1))
    if a.nnodes is not None and a.nproc_per_node is None:
        raise PlanError("--nnodes needs --nproc-per-node (the launch's world is their product)")
    world = a.nproc_per_node * (a.nnodes or 1) if a.nproc_per_node is not None else None
    model = tp * pp
    if a.data_parallel_size is not None:
        if world is not None and world != a.data_parallel_size * model:
            raise PlanError(f"--data-parallel-size {a.data_parallel_size} x --tensor-model-parallel-size {tp} x "
                            f"{option('pipeline_model_parallel_size')} {pp} is not the world of --nproc-per-node x "
                            f"--nnodes ({world}); give one of them")
        world = a.data_parallel_size * model
    world = ranks if world is None else world
    if world % model:
        raise PlanError(f"the launch's {world} ranks are not a multiple of --tensor-model-parallel-size {tp} x "
                        f"{option('pipeline_model_parallel_size')} {pp}")
    if world > ranks:
        raise PlanError(f"the launch's {world} ranks exceed the {ranks} of --topology {topology}; "
                        "give the launch's cluster")
    return world, world // model
