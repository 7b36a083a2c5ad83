"""Simulate a published run given as ``megatron-oases sim`` flags (shared by
``scripts/validate_published.py`` and ``scripts/seeds_experiments.py``).

A run is a topology, an optional node count and a dict of sim flags (Megatron's names without the
leading ``--``; ``True`` -> the bare flag). It goes through the CLI's own mapping
(``sim.cli.simulation_inputs``), so a run here is priced exactly as ``megatron-oases sim`` prices it.
"""
from __future__ import annotations

import dataclasses

from ..flops import gpt_flops_per_iteration
from .cli import build_parser, simulation_inputs
from .timeline import SimResult, simulate


def sim_argv(topology: str, nodes: int | None, flags: dict) -> list[str]:
    """The ``megatron-oases sim`` command line of a run (flag dict -> ``--name value`` / ``--name``)."""
    argv = ["--topology", topology] + ([] if nodes is None else ["--nodes", str(nodes)])
    for name, value in flags.items():
        if value is True:
            argv.append(f"--{name}")
        elif value is not False:
            argv += [f"--{name}", str(value)]
    return argv


def simulate_run(topology: str, nodes: int | None, flags: dict, *, optimizer_step: bool = True) -> SimResult:
    """Simulate one run with the analytical device model; ``optimizer_step=False`` drops the grad
    norm and Adam (for sources that time forward + backward only)."""
    model, strategy, dm = simulation_inputs(build_parser().parse_args(sim_argv(topology, nodes, flags)))
    if not optimizer_step:
        strategy = dataclasses.replace(strategy, optimizer_step=False)
    return simulate(model, strategy, dm)


def iteration_flops(model, strategy, recompute: bool) -> float:
    """FLOPs of one iteration by Megatron's formula (``recompute``: a full recompute counted too)."""
    v = model.variant
    return gpt_flops_per_iteration(
        global_batch_size=model.micro_batch * strategy.num_microbatches * strategy.dp,
        seq_length=model.seq, num_layers=model.num_layers, hidden_size=model.hidden,
        num_attention_heads=model.heads, ffn_hidden_size=model.ffn, padded_vocab_size=model.vocab,
        num_query_groups=v.query_groups, gated_mlp=v.gated, recompute=recompute)
