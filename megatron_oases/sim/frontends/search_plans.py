"""Per-block plans as a step of ``sim --search``: for the best few uniform strategies a plan can
run on, the planner (``megatron_oases.plan``: its cost model and chain DP, for the same stage,
pipeline, data-parallel size and global batch) picks a TP degree per block, and the simulator
prices that plan as it priced the uniform strategies, so the two are compared on one scale.

The planner's own number is for the transformer blocks only and its pipeline is plain 1F1B; the
simulator's covers the whole step (head, pipeline schedule, virtual stages, DP, optimizer), so a
plan is ranked by the simulator's number, never the planner's. This module is a front end: the
simulator's core does not import the planner (``tests/test_import_graph.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from ...describe.backends import backend as record
from ...describe.shapes import GPTShape
from ...flags import option
from ...pricing.device_model import DeviceModel, SimError
from ..core.search import Candidate
from ..core.strategy import block_sub_batches
from ..core.timeline import simulate
from .launch import layers_per_virtual_stage


@dataclasses.dataclass(frozen=True)
class PlannedRow:
    """One uniform strategy and its planned twin (``planned`` None: ``reason`` says why)."""

    uniform: Candidate
    planned: Candidate | None
    plan: dict | None
    reason: str = ""


def plan_refusal(c: Candidate, model: GPTShape) -> str:
    """Why no per-block plan runs on candidate ``c`` (the runtime's and the simulator's limits on
    ``--oases-plan``, and the planner's: no virtual stages, refused in ``plan``'s words); empty
    when one can."""
    st = c.strategy
    if st is None or not record(st.backend).per_block_plans:
        return "per-block plans run Megatron 1-D TP sub-groups only"
    if st.tp == 1:
        return "TP 1 has no sub-group to plan"
    if st.virtual_stages > 1:  # the planner's own refusal of the launch the search would print
        from ...plan.launch_checks import interleaved_refusal

        return interleaved_refusal(option("num_layers_per_virtual_pipeline_stage"),
                                   layers_per_virtual_stage(c, model.num_layers))
    if st.sequence_parallel:
        return "--oases-plan cannot be combined with --sequence-parallel"
    if st.recompute or st.selective_recompute:
        return "--oases-plan with recompute is not modeled by the simulator"
    if model.moe is not None:
        return "the trainer runs --oases-plan's per-block degrees for dense MLPs only"
    return ""


def plan_model(model: GPTShape, c: Candidate):
    """The planner's model of one pipeline stage of candidate ``c`` (``plan.model.PlanModel``).

    Untied embeddings are planned as tied: the planner prices the transformer blocks and counts
    the head only in its memory budget, as the tied embedding's (it refuses an untied model), so
    an untied model's blocks are planned with a head one output matrix lighter; the simulator then
    prices the plan on the model as given (untied head included) and refuses it if it does not fit."""
    from ...plan.model import PlanModel

    st = c.strategy
    shape = {f.name: getattr(model, f.name) for f in dataclasses.fields(GPTShape) if f.init}
    shape.update(num_layers=model.num_layers // st.pp, tied_embeddings=True)
    return PlanModel(**shape, tp=st.tp, sub_batches=block_sub_batches(st),  # the stage's split (describe.split)
                     distributed_optimizer=st.distributed_optimizer)


def make_plan(c: Candidate, model: GPTShape, dm: DeviceModel, *, global_batch: int,
              memory_limit_GB: float | None) -> dict:
    """The planner's per-block degrees for candidate ``c`` as a plan file's dict (what
    ``--oases-plan`` reads: ``plan.plan_file.load_plan`` and ``check_plan_launch``)."""
    from ...plan.cost_model import build_cost_model
    from ...plan.ilp import solve
    from ...plan.plan_file import plan_record
    from ...plan.pricing import DevicePricer

    st = c.strategy
    stage = plan_model(model, c)
    pricer = DevicePricer(topology=dm.topology, model=stage, gpu=dm.gpu.name)
    cm = build_cost_model(stage, topology=dm.topology, pipeline=st.pp, global_batch_size=global_batch,
                          pricer=pricer, data_parallel=st.dp, memory_gb=memory_limit_GB or dm.gpu.memory_GB)
    sol = solve(cm.problem)
    data = plan_record(cm.strategies, sol.assignment, num_layers=model.num_layers, world_size=st.world_size,
                       data_parallel_size=st.dp, pipeline_model_parallel_size=st.pp,
                       micro_batch_size=model.micro_batch_size, schedule=st.schedule, tp=st.tp)
    data["made_by"] = "megatron-oases sim --search (the planner's chain DP on one stage; priced by the simulator)"
    return data


def plan_search(cands: Sequence[Candidate], model: GPTShape, dm: DeviceModel, *, top: int, global_batch: int,
                memory_limit_GB: float | None) -> list[PlannedRow]:
    """For the ``top`` best feasible candidates a plan can run on: the planner's plan, priced by
    the simulator (a plan equal to the uniform degrees is reported as such, not simulated again)."""
    rows: list[PlannedRow] = []
    seen: set[tuple] = set()
    for c in (c for c in cands if c.feasible and not plan_refusal(c, model)):
        key = (c.tp, c.pp, c.dp, c.schedule)  # what the planner sees
        if len(rows) == top:
            break
        if key in seen:
            continue
        seen.add(key)
        try:
            plan = make_plan(c, model, dm, global_batch=global_batch, memory_limit_GB=memory_limit_GB)
        except ValueError as e:  # the planner's refusals (PlanError, MemoryInfeasible) and the simulator's
            rows.append(PlannedRow(c, None, None, f"planner: {e}"))
            continue
        if set(plan["degrees"]) == {c.tp}:
            rows.append(PlannedRow(c, None, plan, "the planner keeps every block at TP"))
            continue
        st = dataclasses.replace(c.strategy, block_degrees=tuple(plan["degrees"]))
        try:
            r = simulate(model, st, dm, memory_limit_GB=memory_limit_GB, timeline=False)
        except SimError as e:
            rows.append(PlannedRow(c, None, plan, f"simulator: {e}"))
            continue
        planned = dataclasses.replace(c, strategy=st, result=r, reason=r.infeasible_reason)
        rows.append(PlannedRow(c, planned, plan))
    return rows


def plans_table(rows: Sequence[PlannedRow], best_ms: float | None) -> str:
    """The planned strategies beside their uniform ones (time, slow-down against the best
    uniform strategy, memory), or why a strategy has no plan."""
    lines = [f"per-block plans (the planner on the best {len(rows)} uniform strategies it can plan, "
             f"priced by the simulator):"]
    for row in rows:
        u = row.uniform
        if row.planned is None:
            lines.append(f"     {u.label:<34} {row.reason}")
            continue
        r = row.planned.result
        slow = f"{r.iteration_ms / best_ms:.2f}" if best_ms else "-"
        change = 100 * (r.iteration_ms / u.result.iteration_ms - 1)
        status = "ok" if row.planned.feasible else row.planned.reason
        lines.append(f"     {row.planned.label:<34} {r.iteration_ms:>10.2f} {slow:>7} ({change:+.1f}% vs {u.label} "
                     f"{u.result.iteration_ms:.2f} ms) mem {r.peak_memory_GB:.1f} GB, degrees {row.plan['compact']}  "
                     f"{status}")
    return "\n".join(lines)


def best_plan(rows: Sequence[PlannedRow], best: Candidate | None) -> PlannedRow | None:
    """The planned row that beats the best uniform strategy, if any."""
    ok = [r for r in rows if r.planned is not None and r.planned.feasible]
    win = min(ok, key=lambda r: r.planned.result.iteration_ms, default=None)
    if win is None or (best is not None and win.planned.result.iteration_ms >= best.result.iteration_ms):
        return None
    return win
