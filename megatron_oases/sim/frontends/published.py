"""Simulate a published run given as ``megatron-oases sim`` flags (shared by
``scripts/validate_published.py`` and ``scripts/seeds_experiments.py``).

A run is a topology, an optional node count and a dict of sim flags (Megatron's names without the
leading ``--``; ``True`` -> the bare flag). It goes through the CLI's own mapping
(``sim.frontends.cli.simulation_inputs``), so a run here is priced exactly as ``megatron-oases sim`` prices it.
"""
from __future__ import annotations

import dataclasses
import os

import yaml

from ...flops import gpt_flops_per_iteration
from ...pricing.stack import stack_of
from ...flags import option
from .cli import build_parser, simulation_inputs
from ..core.moe import flops_ffn
from ..core.timeline import SimResult, simulate


UNITS = ("tflops_per_gpu", "s_per_iteration", "samples_per_gpu_s")
"""What a published row measured (``examples/validation/*.yaml``'s ``unit``)."""


def load_rows(path: str) -> tuple[dict, list[dict]]:
    """(sources, rows) of the data file; each row's flags and topology merged over its source's defaults."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    sources, defaults = data["sources"], data.get("defaults", {})
    rows = []
    for row in data["rows"]:
        if row["source"] not in sources or row["unit"] not in UNITS:
            raise ValueError(f"row {row['id']}: unknown source {row['source']!r} or unit {row['unit']!r}")
        base = defaults.get(row["source"], {})
        flags = {**base.get("flags", {}), **row["flags"]}
        stack = stack_of(transformer_impl=flags.get("transformer-impl", "local"),
                         masked_softmax_fusion=not flags.get("no-masked-softmax-fusion", False)).name
        topology = topology_path(row.get("topology", base.get("topology", "")), path)
        rows.append({**base, **row, "flags": flags, "stack": stack, "topology": topology})
    return sources, rows


def topology_path(topology: str, data_file: str) -> str:
    """A row's topology: a built-in name, or a YAML file named relative to the data file that holds
    the row (a paper's machine that only those rows use, e.g. ``topologies/atp-machine-b.yaml``),
    so the scripts run from any folder."""
    if topology.endswith((".yaml", ".yml")) and not os.path.isabs(topology):
        return os.path.join(os.path.dirname(os.path.abspath(data_file)), topology)
    return topology


def sim_argv(topology: str, nodes: int | None, flags: dict) -> list[str]:
    """The ``megatron-oases sim`` command line of a run (flag dict -> ``--name value`` / ``--name``)."""
    argv = [option("topology"), topology] + ([] if nodes is None else ["--nodes", str(nodes)])
    for name, value in flags.items():
        if value is True:
            argv.append(f"--{name}")
        elif value is not False:
            argv += [f"--{name}", str(value)]
    return argv


def simulate_run(topology: str, nodes: int | None, flags: dict, *, optimizer_step: bool = True,
                 tune=None) -> SimResult:
    """Simulate one run with the analytical device model; ``optimizer_step=False`` drops the grad
    norm and Adam (for sources that time forward + backward only); ``tune``: a function that
    returns the device model with other constants (the cross-validation's candidate values)."""
    model, strategy, dm = simulation_inputs(build_parser().parse_args(sim_argv(topology, nodes, flags)))
    if tune is not None:
        dm = tune(dm)
    if not optimizer_step:
        strategy = dataclasses.replace(strategy, optimizer_step=False)
    return simulate(model, strategy, dm)


def iteration_flops(model, strategy, recompute: bool) -> float:
    """FLOPs of one iteration by Megatron's formula (``recompute``: a full recompute counted too)."""
    v = model.variant
    return gpt_flops_per_iteration(
        global_batch_size=model.micro_batch_size * strategy.num_microbatches * strategy.dp,
        seq_length=model.seq_length, num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, ffn_hidden_size=flops_ffn(model),  # MoE: top-k x FFN
        padded_vocab_size=model.padded_vocab_size,
        num_query_groups=v.query_groups, gated_mlp=v.gated, recompute=recompute)


def selected(rows: list[dict], wanted: list[str] | None) -> list[dict]:
    """``rows`` whose ``id`` is in ``wanted`` (all of them for None); unknown ids: ValueError."""
    if not wanted:
        return rows
    unknown = sorted(set(wanted) - {r["id"] for r in rows})
    if unknown:
        raise ValueError(f"unknown rows: {', '.join(unknown)}")
    return [r for r in rows if r["id"] in wanted]


def error_pct(unit: str, ratio: float) -> float:
    """Signed error (percent, in the row's unit) of a prediction whose speed ratio is ``ratio``
    (``sim.calibrate.crossval.grid_errors``: measured / predicted for a time, predicted / measured
    for a rate)."""
    from ..calibrate.crossval import TIME_UNITS

    predicted_over_measured = 1.0 / ratio if unit in TIME_UNITS else ratio
    return round(100.0 * (predicted_over_measured - 1.0), 1)


def per_source_table(results: list[dict]) -> str:
    """Per source and overall: held-out |error| (the fit without the source) against in-source
    |error| (the fit on every row, the source included), median and max, and the gap between the
    medians: how much of the agreement the held-out number would lose to a fit that saw the row.
    ``results``: rows with ``source``, ``error_pct`` (held out) and ``in_source_error_pct``."""
    import statistics

    def line(name: str, rs: list[dict]) -> str:
        out = [abs(r["error_pct"]) for r in rs]
        ins = [abs(r["in_source_error_pct"]) for r in rs]
        gap = statistics.median(out) - statistics.median(ins)
        return (f"| {name} | {len(rs)} | {statistics.median(out):.1f}% | {max(out):.1f}% | "
                f"{statistics.median(ins):.1f}% | {max(ins):.1f}% | {gap:+.1f} |")

    lines = ["| source | rows | held-out median | held-out max | in-source median | in-source max | gap (median) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for src in dict.fromkeys(r["source"] for r in results):
        lines.append(line(f"`{src}`", [r for r in results if r["source"] == src]))
    lines.append(line("**all**", results))
    return "\n".join(lines)


def write_outputs(results: list[dict], *, summary: dict, sources: dict, source_key: str, out: str,
                  csv_rows: list[dict] | None = None) -> None:
    """``<out>.csv`` (one line a row; ``csv_rows`` if the CSV spells values differently) and
    ``<out>.json`` (rows, summary, the sources the rows cite through ``source_key``)."""
    import csv
    import json
    import os

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(results[0]))
        w.writeheader()
        w.writerows(csv_rows if csv_rows is not None else results)
    used = {r[source_key] for r in results}
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump({"rows": results, "summary": summary,
                   "sources": {k: v for k, v in sources.items() if k in used}}, f, indent=1)
        f.write("\n")


def script_parser(description: str, data: str, out: str):
    """The two validation scripts' command line: ``--data``, ``--rows``, ``--out``."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", default=data, help="the rows (YAML)")
    p.add_argument("--rows", nargs="+", default=None, help="row ids to run (default: all)")
    p.add_argument("--out", default=out, help="prefix of the CSV / JSON")
    return p
