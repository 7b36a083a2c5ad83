"""The launch command of a searched strategy: what ``sim --search`` prints under its table, in
the trainer's form and in Megatron-LM's, so that the best strategy is run as it was priced.

The model part is ``sim``'s model flags in the trainer's words (``cli.model_flags``); the
strategy part comes from the candidate: TP / PP / virtual stages, the backend record's own
``launch_flags``, the executor, recompute, sequence parallelism, expert parallelism and the DP flags the search
applied, and ``--oases-plan FILE`` for a per-block plan the search wrote.
``tests/test_sim_search.py`` parses the trainer form with the trainer's parser.
"""
from __future__ import annotations

import logging
import shlex
import warnings

from ...describe.backends import backend as record
from ..core.search import Candidate
from ...flags import option


def strategy_flags(c: Candidate, *, global_batch: int, num_layers: int, plan_path: str | None = None) -> list[str]:
    """The trainer / Megatron-LM flags that run candidate ``c``'s strategy (``plan_path``: the
    per-block plan file a planned candidate runs, ``--oases-plan``)."""
    st = c.strategy
    if (st.block_degrees is None) != (plan_path is None):
        raise ValueError("a planned strategy launches with its plan file, a uniform one with none")
    out = [option("tensor_model_parallel_size"), str(st.tp), option("pipeline_model_parallel_size"), str(st.pp)]
    for flag, value in record(st.backend).launch_flags(st.layout).items():  # the default backend: none
        out += [flag] + ([value] if value is not None else [])
    if st.virtual_stages > 1:
        out += [option("num_layers_per_virtual_pipeline_stage"), str(layers_per_virtual_stage(c, num_layers))]
    if st.schedule == "oases":
        out += [option("schedule"), "oases"]
    if plan_path is not None:
        out += [option("oases_plan"), plan_path]
    if st.recompute:
        out += [option("recompute_granularity"), "full", option("recompute_method"), "uniform"]
    if st.selective_recompute:
        out += [option("recompute_granularity"), "selective"]
    if st.sequence_parallel:
        out.append("--sequence-parallel")
    if st.ep > 1:
        out += [option("expert_model_parallel_size"), str(st.ep)]
    if st.tp_comm_overlap:
        out.append("--tp-comm-overlap")
    if st.distributed_optimizer:
        out.append("--use-distributed-optimizer")
    if st.overlap_grad_reduce:
        out.append("--overlap-grad-reduce")
    if st.overlap_param_gather:
        out.append("--overlap-param-gather")
    return out + ["--global-batch-size", str(global_batch)]


def layers_per_virtual_stage(c: Candidate, num_layers: int) -> int:
    """``--num-layers-per-virtual-pipeline-stage`` of candidate ``c``'s launch (with virtual stages)."""
    return num_layers // (c.strategy.pp * c.strategy.virtual_stages)


def launch_commands(c: Candidate, model_flags: list[str], *, global_batch: int, num_layers: int, gpus: int,
                    nodes: int, plan_path: str | None = None) -> dict[str, str]:
    """``{"trainer": ..., "Megatron-LM": ...}`` command lines for candidate ``c`` on ``gpus`` GPUs
    in ``nodes`` nodes (one node: the trainer spawns its ranks; more: torchrun on each node)."""
    flags = shlex.join([*model_flags, *strategy_flags(c, global_batch=global_batch, num_layers=num_layers,
                                                      plan_path=plan_path)])
    per_node = gpus // nodes
    torchrun = f"torchrun --nnodes {nodes} --nproc-per-node {per_node}" + (
        " --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500" if nodes > 1 else "")
    trainer = (f"megatron-oases train --nproc-per-node {gpus} {flags}" if nodes == 1
               else f"{torchrun} -m megatron_oases.train {flags}")
    return {"trainer": trainer, "Megatron-LM": f"{torchrun} -m megatron_oases.pretrain_gpt {flags}"}


def trainer_refusal(command: str, gpus: int) -> str:
    """What the trainer says of the trainer form of a launch (``launch_commands``'s), checked as
    ``megatron-oases train`` checks its flags before any process starts (``cuda=False``: the
    checks that need no GPU); "" when it accepts it. So the search never prints a launch the
    trainer refuses (e.g. ``--moe-grouped-gemm`` where this megatron-core's local spec has no
    grouped-GEMM experts): the search says why instead."""
    from ...errors import ConfigError
    from ...run_config import run_config
    from ...train_args import build_parser, validate_config

    words = shlex.split(command)
    flags = words[words.index("megatron_oases.train") + 1:] if "megatron_oases.train" in words else words[2:]
    logging.disable(logging.WARNING)  # torch's and Megatron's notes on this box (no CUDA, no Apex)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_config(run_config(build_parser().parse_args(flags)), gpus, cuda=False)
    except ConfigError as e:
        return str(e)
    finally:
        logging.disable(logging.NOTSET)
    return ""
