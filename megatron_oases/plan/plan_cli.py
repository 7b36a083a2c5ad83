"""``megatron-oases plan``: the Oases planner from the command line.

Prices every block x TP degree on a topology, solves the ILP, prints a per-block table and the
paper's compact notation, writes the plan JSON and the launch flags (or a rewritten launch
command). Bad input is one line on stderr, exit 2. Here: the parser, the priced model from the
flags and the ``--model`` file, the run; the launch's checks are ``launch_checks.py``, the printed
plan ``plan_report.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ..describe.core_attention import check_flash_dtype
from ..describe.split import SUB_BATCHES, split_refusal
from ..errors import comma_names, range_refusal
from ..precision import PRECISION_FLAGS, priced_dtype
from ..flags import RecordsGiven, Renamed, add_flag, add_flags, given_in, option
from ..run_config import check_gqa_flags, gqa_groups, options_present
from .graph import PlanError, PlanModel, family_names, model_from_mapping
from .launch_checks import (VIRTUAL_STAGES_FLAG, check_recompute_layers, launch_world, stage_model,
                            virtual_stages_refusal, world_given)
from .model import MOE_FIELDS, stated_fields
from .plan_file import (plan_record, whole_model_backend, compact_notation, launch_flags, plan_launch_flags,
                        rewrite_command, write_plan)
from .plan_report import GiB, format_plan

PROG = "megatron-oases plan"


class _UsageError(Exception):
    pass


class _Parser(RecordsGiven, argparse.ArgumentParser):
    """argparse's complaints as one-line errors; the namespace records the flags given
    (``given``), which win over the ``--model`` file, which wins over the flags' defaults."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, allow_abbrev=False, description="Oases planner: one TP degree per block (attention, MLP) of a GPT "
                "under a memory budget, from the layer description, a topology and a device model or profile.")
    p.add_argument("--model", metavar="CONFIG", help="YAML/JSON with num_layers, hidden_size, num_attention_heads, "
                   "seq_length, ffn_hidden_size, vocab_size, micro_batch_size, tensor_model_parallel_size "
                   "(flags below override it)")
    add_flags(p, ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "ffn_hidden_size",
                  "vocab_size", "micro_batch_size"))
    add_flag(p, "tensor_model_parallel_size", "--tp",
             note="T: the megatron family's block degrees are powers of two dividing it")
    add_flag(p, "bf16", note="the launch's precision, priced as --dtype bf16 (precision.priced_dtype)")
    add_flag(p, "fp16", note="priced as --dtype fp16")
    add_flag(p, "fp32")  # refused, as by every front end (flags.py)
    add_flags(p, ("dtype", "group_query_attention"))
    add_flag(p, "num_query_groups", note="a block's degree must divide it")
    add_flags(p, ("swiglu", "normalization", "add_bias_linear", "position_embedding_type", "rotary_percent",
                  "qk_layernorm"))
    add_flag(p, "sequence_parallel", note="priced at the uniform degree T only")
    add_flags(p, ("hidden_dropout", "attention_dropout", "attention_backend"))
    add_flags(p, ("recompute_granularity", "recompute_method", "recompute_num_layers"))
    add_flag(p, "oases_fine_grained_recompute", note="the plan prices it under --schedule oases with "
             "--recompute-granularity full")
    add_flag(p, "num_experts", note="MoE layers (describe.moe), planned at the uniform degree T under the "
             "executor --schedule names, where the trainer runs them (describe.moe.moe_refusal)")
    add_flags(p, ("moe_router_topk", "moe_token_dispatcher_type", "moe_ffn_hidden_size", "moe_layer_freq",
                  "moe_expert_capacity_factor", "moe_grouped_gemm", "moe_router_load_balancing_type"))
    add_flag(p, "moe_aux_loss_coeff", note="> 0 for --moe-router-load-balancing-type aux_loss prices, under "
             "--schedule oases, the join of the sub-batches after routing (as sim)")
    add_flag(p, "expert_model_parallel_size", "--ep", note="fixed by the launch (the plan chooses TP only)")
    p.add_argument("--plan-recompute", "--no-plan-recompute", "--recompute", "--no-recompute", action=Renamed,
                   new=f"the trainer's {option('recompute_granularity')} full|selective (with "
                       f"{option('recompute_method')}; under --schedule oases {option('oases_fine_grained_recompute')}"
                       "), which plan prices as the launch runs them; without them no recompute")
    add_flag(p, "schedule", note="oases prices the two-sub-batch overlap, default Megatron's sequential "
             "executor; the plan file records it")
    p.add_argument("--sub-batches", type=int, choices=(1, SUB_BATCHES), default=None,
                   help=f"follows --schedule ({SUB_BATCHES} under oases, 1 under default); given "
                        "without it, sets it (older command lines)")
    add_flag(p, "use_distributed_optimizer")
    add_flag(p, "topology", required=True)
    add_flag(p, "pipeline_model_parallel_size", note="the plan prices one stage's layers (each stage runs the "
             "same degrees), 1F1B's bubble and the first stage's micro-batches in flight; the plan file records it")
    add_flag(p, "num_layers_per_virtual_pipeline_stage", note="refused: the plan prices non-interleaved 1F1B only")
    p.add_argument(VIRTUAL_STAGES_FLAG, type=int, default=None,
                   help="Megatron-LM's other spelling of virtual stages; refused as the flag above")
    add_flag(p, "nproc_per_node", note="the world is --nproc-per-node x --nnodes, its data-parallel size "
             "world / (TP x PP)")
    p.add_argument("--nnodes", type=int, default=None, help="the launch's nodes (torchrun's flag; default 1)")
    add_flag(p, "data_parallel_size", note="instead of the launch's world; the plan file records it, and a "
             "launch of another data-parallel size refuses the plan")
    add_flag(p, "global_batch_size")
    add_flags(p, ("memory_gb", "gpu", "profile"))
    p.add_argument("--strict-profile", action="store_true", help="fail when the profile lacks an event")
    p.add_argument("--granularity", choices=("block", "layer"), default="layer",
                   help="layer: one degree per TransformerLayer, as in Table 6 (default); block: "
                        "attention and MLP choose separately (both run with --schedule default "
                        "and oases)")
    p.add_argument("--degrees", default=None, help="restrict the candidate degrees, e.g. 2,4")
    p.add_argument("--families", default="megatron",
                   help="strategy families to consider, comma-separated: megatron (1-D TP at each "
                        "degree, default), atp (ATP's 2-D meshes d1 x d2 = T over the whole TP "
                        "group) and 3d (the cube p^3 = T; stock executor, --schedule default). The "
                        "runtime runs ATP and 3-D as whole-model backends, so a plan is either all "
                        "one of them, launched with --tp-backend atp --atp-mesh / --tp-backend 3d, "
                        "or has none")
    p.add_argument("--grad-sync", choices=("none", "exposed"), default="none",
                   help="none: the paper's Eq. 5, gradient all-reduce hidden behind backward (default); "
                        "exposed: also charge each block's fp32 gradient all-reduce over its "
                        "data-parallel replicas (T/d x DP ranks) once per iteration, unoverlapped")
    p.add_argument("--solver", choices=("auto", "dp", "ilp", "cbc", "highs"), default="auto",
                   help="auto/dp: exact chain DP (default, milliseconds); ilp: PuLP with HiGHS when "
                        "installed, else CBC; cbc, highs: that ILP solver")
    p.add_argument("--time-limit", type=float, default=None, help="solver time limit, s")
    p.add_argument("--out", default="plan.json", help="plan JSON to write (default plan.json)")
    p.add_argument("--rewrite-cmd", default=None, metavar="CMD",
                   help="a launch command whose TP size and --oases-plan flags to set")
    p.add_argument("--quiet", action="store_true", help="no per-block table")
    return p


def _load_config(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise PlanError(f"--model {path}: cannot be read ({e.strerror or e})") from None
    try:
        if path.endswith(".json"):
            return json.loads(text)
        import yaml
        return yaml.safe_load(text)
    except ValueError as e:  # json.JSONDecodeError and yaml.YAMLError both
        raise PlanError(f"--model {path}: cannot be parsed ({str(e).splitlines()[0]})") from None
    except Exception as e:  # noqa: BLE001 - yaml errors are not ValueErrors
        raise PlanError(f"--model {path}: cannot be parsed ({str(e).splitlines()[0]})") from None


def _gqa_groups(a: argparse.Namespace) -> int | None:
    check_gqa_flags(a, PlanError)
    return gqa_groups(a)


def _sub_batches(a: argparse.Namespace, stated: dict[str, Any]) -> int | None:
    """The schedule's sub-batches: ``--schedule``'s; without it ``--sub-batches``, else the model
    file's ``sub_batches`` (None: the file's), else the trainer's default schedule's. ``PlanModel``
    then keeps them where the executor splits (``describe.split.sub_batches_at``: not for a dense
    model at TP 1)."""
    if "schedule" not in (given_in(a) or ()):
        if a.sub_batches is None and "sub_batches" in stated:
            return None
        return a.sub_batches or _schedule_sub_batches(a.schedule)
    want = _schedule_sub_batches(a.schedule)
    if a.sub_batches is not None and a.sub_batches != want:
        raise PlanError(f"--sub-batches {a.sub_batches} contradicts --schedule {a.schedule} ({want} "
                        f"sub-batch{'es' if want > 1 else ''}); drop --sub-batches")
    return want


def _schedule_sub_batches(schedule: str) -> int:
    """Sub-batches per micro-batch of ``--schedule`` (where the executor splits: ``PlanModel``)."""
    return SUB_BATCHES if schedule == "oases" else 1


def schedule_of(m: PlanModel, a: argparse.Namespace | None = None) -> str:
    """The ``--schedule`` a plan is made for: ``a``'s when given (at TP 1 a dense model is priced
    with one sub-batch under either), else oases with sub-batches, else default."""
    if a is not None and "schedule" in (given_in(a) or ()):
        return a.schedule
    return "oases" if m.sub_batches > 1 else "default"


MODEL_FIELDS = {"num_layers": "num_layers", "hidden_size": "hidden_size",
                "num_attention_heads": "num_attention_heads", "seq_length": "seq_length",
                "ffn_hidden_size": "ffn_hidden_size", "vocab_size": "vocab_size",
                "micro_batch_size": "micro_batch_size", "tp": "tensor_model_parallel_size",
                "fine_grained_recompute": "oases_fine_grained_recompute",
                "distributed_optimizer": "use_distributed_optimizer",
                "hidden_dropout": "hidden_dropout", "attention_dropout": "attention_dropout",
                "attention_backend": "attention_backend", "swiglu": "swiglu", "normalization": "normalization",
                "add_bias_linear": "add_bias_linear", "position_embedding_type": "position_embedding_type",
                "rotary_percent": "rotary_percent", "qk_layernorm": "qk_layernorm",
                "sequence_parallel": "sequence_parallel",
                **{f: f for f in MOE_FIELDS + ("expert_model_parallel_size",)}}
"""``PlanModel`` field -> the flag (``dest``) that sets it."""


def model_from_args(a: argparse.Namespace) -> PlanModel:
    """The priced model: each field from its flag when given, else from the ``--model`` file,
    else the flag's default (``megatron-oases train``'s, from the flag table)."""
    config = _load_config(a.model)
    stated = stated_fields(config)
    values = options_present(a, MODEL_FIELDS.values())
    given = given_in(a)
    given = set(values) if given is None else given  # a namespace built by hand: all given
    over = {field: values[dest] for field, dest in MODEL_FIELDS.items()
            if dest in given or field not in stated}
    if given & {"dtype", *PRECISION_FLAGS} or "dtype" not in stated:
        over["dtype"] = priced_dtype(a, PlanError)
    if "num_query_groups" in given or "group_query_attention" in given or "num_query_groups" not in stated:
        over["num_query_groups"] = _gqa_groups(a)
    over["sub_batches"] = _sub_batches(a, stated)
    if given & {"recompute_granularity", "recompute_method", "recompute_num_layers"} or not \
            {"recompute", "selective_recompute"} & set(stated):
        over.update(recompute=a.recompute_granularity == "full",
                    selective_recompute=a.recompute_granularity == "selective")
    model = model_from_mapping(config, source=f"--model {a.model}" if a.model else "model flags", **over)
    # the plan prices a GPU, where flash has no fp32 kernel (a model file may still state it for
    # a CPU run of the trainer, whose torch kernels take fp32)
    check_flash_dtype(over.get("attention_backend") or stated.get("attention_backend"),
                      half=model.dtype != "fp32", half_flags="--dtype bf16 or fp16", error=PlanError)
    return model



def make_plan(a: argparse.Namespace) -> tuple[dict[str, Any], Any, Any]:
    """(plan JSON dict, CostModel, Solution) for parsed arguments."""
    from megatron_oases.topology import load_topology

    from .cost_model import build_cost_model
    from .ilp import evaluate, solve
    from .pricing import DevicePricer, resolve_gpu

    refused = virtual_stages_refusal(a)  # before any work
    if refused:
        raise PlanError(refused)
    m = model_from_args(a)
    topo = load_topology(a.topology)
    if m.sub_batches > 1 and split_refusal(m.micro_batch_size, m.sub_batches):
        raise PlanError(f"{split_refusal(m.micro_batch_size, m.sub_batches)} (--schedule default)")
    pp = a.pipeline_model_parallel_size
    world, dp = launch_world(a, topo.world_size, topo.name, m.tp, pp)
    stage = stage_model(m, pp)
    check_recompute_layers(a, stage.num_layers)
    degrees = None
    if a.degrees is not None:  # "" restricts to nothing: refused, not read as "every degree"
        try:
            degrees = tuple(int(x) for x in a.degrees.split(","))
        except ValueError:
            raise PlanError(f"--degrees must be comma-separated integers (got {a.degrees!r})") from None
        if len(set(degrees)) != len(degrees):
            raise PlanError(f"--degrees {a.degrees} names one twice; give each once")
    if a.rewrite_cmd is not None and not a.rewrite_cmd.strip():
        raise PlanError("--rewrite-cmd is empty; give the launch command whose TP flags to set")
    if a.time_limit is not None and not a.time_limit > 0:
        raise PlanError(range_refusal("--time-limit", a.time_limit, 0, inclusive=False))
    if a.strict_profile and not a.profile:
        raise PlanError("--strict-profile requires every event in --profile and has no effect without it; "
                        "drop it or add --profile DB.json")
    pricer = DevicePricer(topology=topo, model=m, gpu=a.gpu, profile_path=a.profile, strict=a.strict_profile)
    memory_gb = a.memory_gb
    if memory_gb is None:
        from megatron_oases.pricing.device_model import gpu_spec
        memory_gb = gpu_spec(resolve_gpu(a.gpu or topo.device or "")).memory_GB
    if not 0 < memory_gb < math.inf:  # nan too
        raise PlanError(f"--memory-gb must be a number > 0 (got {memory_gb:g})")
    cm = build_cost_model(stage, topology=topo, pipeline=pp, global_batch_size=a.global_batch_size, pricer=pricer,
                          data_parallel=dp, memory_gb=memory_gb, grad_sync=a.grad_sync == "exposed", granularity=a.granularity,
                          degrees=degrees, families=comma_names("--families", a.families, family_names(),
                                                                error=PlanError))
    sol = solve(cm.problem, solver=a.solver, time_limit=a.time_limit)
    data = plan_record(cm.strategies, sol.assignment, num_layers=m.num_layers, world_size=world,
                       data_parallel_size=dp, pipeline_model_parallel_size=pp, micro_batch_size=m.micro_batch_size,
                       schedule=schedule_of(m, a), tp=m.tp)
    degs = data["degrees"]
    per_layer = degs[::2] if all(degs[i] == degs[i + 1] for i in range(0, len(degs), 2)) else None
    uni = cm.uniform(m.tp)
    uni_t, uni_m = evaluate(cm.problem, uni) if uni else (None, None)
    rows = cm.breakdown(sol.assignment)
    data.update({
        "compact_layers": compact_notation(per_layer) if per_layer else None,
        "granularity": a.granularity,
        "predicted": {
            "iteration_ms": sol.time_ms, "memory_gib": sol.memory_bytes / GiB,
            "uniform_tp_iteration_ms": uni_t, "uniform_tp_memory_gib": None if uni_m is None else uni_m / GiB,
            "scope": "transformer blocks only (embedding, logits, optimizer step excluded); "
                     "analytical or profiled, not measured",
            "blocks": [{"block": r["block"], "layer": r["layer"], "kind": r["kind"], "degree": r["degree"],
                        "strategy": r["strategy"],
                        "time_ms": r["time_ms"], "node_ms": r["node_ms"], "edge_in_ms": r["edge_in_ms"],
                        "grad_sync_ms": r["grad_sync_ms"],
                        "memory_bytes": r["memory_bytes"], "backward_peak_bytes": r["runtime_bytes"]}
                       for r in rows],
        },
        "inputs": {"model": m.to_dict(), "topology": topo.name, "topology_arg": a.topology,
                   "world_from": "launch" if world_given(a) else "topology",
                   "global_batch_size": a.global_batch_size, "data_parallel_size": cm.data_parallel,
                   "num_microbatches": cm.num_microbatches, "memory_gb": memory_gb, "grad_sync": a.grad_sync,
                   "candidate_degrees": cm.degrees,
                   "candidate_strategies": [s.label for s in cm.strategies], "pricing": cm.pricing},
        "solver": {"name": sol.solver, "status": sol.status, "build_ms": sol.build_s * 1e3,
                   "solve_ms": sol.solve_s * 1e3},
    })
    return data, cm, sol



def plan_main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-oases plan``; exit 2 with one line on bad input."""
    from megatron_oases.errors import ConfigError
    from megatron_oases.output_paths import check_output_file
    from megatron_oases.topology import TopologyError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = build_parser().parse_args(argv)
        check_output_file("--out", a.out)  # before the work, and no plan is written on a refusal
        data, _, _ = make_plan(a)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (_UsageError, ConfigError, TopologyError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        write_plan(a.out, data)
    except OSError as e:
        print(f"{PROG}: error: cannot write --out {a.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(format_plan(data, table=not a.quiet))
    print(f"wrote {a.out}")
    flags = plan_launch_flags(data, a.out)
    print(f"launch flags: {launch_flags(flags)}")
    if a.rewrite_cmd is not None:
        print(f"launch command: {rewrite_command(a.rewrite_cmd, flags=flags)}")
    runs_with = (launch_flags(whole_model_backend(data)) if whole_model_backend(data)
                 else option("oases_plan") if flags.get(option("oases_plan")) else
                 "uniform TP and the MoE flags, without --oases-plan (which refuses MoE)"
                 if data["inputs"]["model"].get("num_experts") else
                 "uniform TP and --sequence-parallel, without --oases-plan (which refuses it)")
    print("note: times are cost-model predictions; `megatron-oases train` and Megatron-LM "
          "(megatron_oases.pretrain_gpt) run the plan with " + runs_with)
    return 0


if __name__ == "__main__":
    sys.exit(plan_main())
