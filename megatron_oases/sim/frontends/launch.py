"""The launch command of a searched strategy: what ``sim --search`` prints under its table, in
the trainer's form and in Megatron-LM's, so that the best strategy is run as it was priced.

The model part is ``sim``'s model flags in the trainer's words (``cli.model_flags``); the
strategy part comes from the candidate: TP / PP / virtual stages, the backend record's own
``launch_flags``, the executor, recompute, sequence parallelism, expert parallelism and the DP flags the search
applied. ``tests/test_sim_search.py`` parses the trainer form with the trainer's parser.
"""
from __future__ import annotations

import shlex

from ...describe.backends import backend as record
from ..core.search import Candidate
from ...flags import option


def strategy_flags(c: Candidate, *, global_batch: int, num_layers: int) -> list[str]:
    """The trainer / Megatron-LM flags that run candidate ``c``'s strategy."""
    st = c.strategy
    out = [option("tensor_model_parallel_size"), str(st.tp), option("pipeline_model_parallel_size"), str(st.pp)]
    for flag, value in record(st.backend).launch_flags(st.layout).items():  # the default backend: none
        out += [flag] + ([value] if value is not None else [])
    if st.virtual_stages > 1:
        out += [option("num_layers_per_virtual_pipeline_stage"), str(num_layers // (st.pp * st.virtual_stages))]
    if st.schedule == "oases":
        out += [option("schedule"), "oases"]
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


def launch_commands(c: Candidate, model_flags: list[str], *, global_batch: int, num_layers: int, gpus: int,
                    nodes: int) -> dict[str, str]:
    """``{"trainer": ..., "Megatron-LM": ...}`` command lines for candidate ``c`` on ``gpus`` GPUs
    in ``nodes`` nodes (one node: the trainer spawns its ranks; more: torchrun on each node)."""
    flags = shlex.join([*model_flags, *strategy_flags(c, global_batch=global_batch, num_layers=num_layers)])
    per_node = gpus // nodes
    torchrun = f"torchrun --nnodes {nodes} --nproc-per-node {per_node}" + (
        " --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500" if nodes > 1 else "")
    trainer = (f"megatron-oases train --nproc-per-node {gpus} {flags}" if nodes == 1
               else f"{torchrun} -m megatron_oases.train {flags}")
    return {"trainer": trainer, "Megatron-LM": f"{torchrun} -m megatron_oases.pretrain_gpt {flags}"}
