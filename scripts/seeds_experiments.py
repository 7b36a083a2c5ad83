"""Simulate the four seed papers' headline experiments beside their published numbers (docs/sim_seeds.md).

Each row of ``examples/validation/seeds_experiments.yaml`` is one published number (Oases Tables
2, 3 and 6, ATP Table 3 and §5.1, 3-D TP Tables 1 and 2, DistSim Table 2). Its runs are simulated
with the analytical device model through ``megatron-oases sim``'s own flag mapping
(``megatron_oases.sim.frontends.published``), converted to the paper's unit (the file's header lists them),
and a ratio row divides two runs' values (a run marked ``layers_only`` is timed as its transformer
layers alone, one with ``batch_between`` at a batch its backend cannot split by interpolation;
the YAML's header). A plan row runs ``megatron-oases plan``'s solver
(``plan.plan_cli.make_plan``) and lists its per-layer TP degrees beside the paper's pick; its
number is the planned speedup over uniform TP.

Prints the table (row, paper, where, configuration, published, predicted, error %), the median and
max |error|, and writes ``<out>.csv`` and ``<out>.json``.

    python scripts/seeds_experiments.py --out /tmp/seeds/seeds
    python scripts/seeds_experiments.py --rows atp-t3-ic3-m2 tp3d-t1-64-1d-over-3d   # a subset
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from megatron_oases.flops import gpt_flops_per_iteration  # noqa: E402
from megatron_oases.sim.frontends.published import (script_parser, selected, simulate_run,  # noqa: E402
                                          topology_path, write_outputs)
from megatron_oases.sim.core.timeline import SimResult  # noqa: E402

DATA = os.path.join(ROOT, "examples", "validation", "seeds_experiments.yaml")
UNITS = ("ktokens_per_s", "busy_pct", "tflops2p40_per_gpu", "s_per_sequence", "iter_per_s")


def load(path: str = DATA) -> tuple[dict, dict, list[dict]]:
    """(sources, runs, rows); each run merged over its source's defaults (flags merged too)."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    sources, defaults = data["sources"], data.get("defaults", {})
    runs = {}
    for name, run in data["runs"].items():
        base = defaults.get(run["source"], {})
        runs[name] = {**base, **run, "name": name, "flags": {**base.get("flags", {}), **run["flags"]}}
    for row in data["rows"]:
        _check_row(row, runs, sources)
    return sources, runs, data["rows"]


def _check_row(row: dict, runs: dict, sources: dict) -> None:
    """A row names existing runs (or a plan), a published number or range, and a known unit."""
    names = [row["run"]] if "run" in row else row.get("ratio", [])
    if not names and "plan" not in row:
        raise ValueError(f"row {row['id']}: needs run, ratio or plan")
    for n in names:
        if n not in runs:
            raise ValueError(f"row {row['id']}: unknown run {n!r}")
        if row.get("unit", runs[n]["unit"]) not in UNITS:
            raise ValueError(f"row {row['id']}: unknown unit {row.get('unit', runs[n]['unit'])!r}")
    if ("published" in row) == ("published_range" in row):
        raise ValueError(f"row {row['id']}: give published or published_range")
    if row.get("unit") == "busy_pct" and any(runs[n].get("layers_only") for n in names):
        raise ValueError(f"row {row['id']}: busy_pct of a layers_only run")
    if source_of(row, runs) not in sources:
        raise ValueError(f"row {row['id']}: unknown source")


def source_of(row: dict, runs: dict) -> str:
    """The paper a row belongs to (its own ``source``, else its first run's)."""
    if "source" in row:
        return row["source"]
    return runs[row["run"] if "run" in row else row["ratio"][0]]["source"]


def layer_flops(r: SimResult) -> float:
    """Transformer-layer FLOPs of the iteration by Megatron's formula (no logits, no recompute)."""
    m, s = r.model, r.strategy
    return gpt_flops_per_iteration(
        global_batch_size=m.micro_batch_size * s.num_microbatches * s.dp, seq_length=m.seq_length,
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size, padded_vocab_size=0)


def in_unit(r: SimResult, unit: str) -> float:
    """A simulated iteration in one of ``UNITS``."""
    secs = r.iteration_ms / 1e3
    batch = r.model.micro_batch_size * r.strategy.num_microbatches * r.strategy.dp
    if unit == "ktokens_per_s":
        return batch * r.model.seq_length / secs / 1e3
    if unit == "busy_pct":
        return 100.0 * statistics.mean(st.compute_ms for st in r.stages) / r.iteration_ms
    if unit == "tflops2p40_per_gpu":
        return layer_flops(r) / 2**40 / (secs * r.strategy.world_size)
    if unit == "s_per_sequence":
        return secs / batch
    return 1.0 / secs


class Simulator:
    """Simulates each named run once (rows share runs)."""

    def __init__(self, runs: dict):
        self.runs, self.cache = runs, {}

    def result(self, name: str) -> SimResult:
        if name not in self.cache:
            run = self.runs[name]
            self.cache[name] = (between_batches if run.get("batch_between") else self.timed)(run)
        return self.cache[name]

    @staticmethod
    def timed(run: dict) -> SimResult:
        """The run simulated, its transformer layers alone where it says ``layers_only``."""
        return (layers_only if run.get("layers_only") else Simulator.simulate)(run)

    @staticmethod
    def simulate(run: dict) -> SimResult:
        return simulate_run(topology_path(run["topology"], DATA), run.get("nodes"), run["flags"],
                            optimizer_step=run.get("optimizer_step", True))

    def value(self, name: str, unit: str | None = None) -> float:
        return in_unit(self.result(name), unit or self.runs[name]["unit"])


def layers_only(run: dict) -> SimResult:
    """The run's transformer layers alone, for a source that times only "the consecutive Transformer
    layers" (3-D TP §4.1): the simulated step at 2L layers minus the one at L. The difference drops
    what a step holds outside the layers whatever its size: the embedding and head with their
    collectives (at 3-D TP's batches an activation-sized all-reduce over TP 64) and a layout's
    entry and exit (the 3-D cube's), the tail. The result is the L-layer run with that time."""
    one = Simulator.simulate(run)
    flags = {**run["flags"], "num-layers": 2 * run["flags"]["num-layers"]}
    two = Simulator.simulate({**run, "flags": flags})
    return dataclasses.replace(one, iteration_ms=two.iteration_ms - one.iteration_ms)


def between_batches(run: dict) -> SimResult:
    """A run at a micro-batch its backend cannot split (3-D TP Table 2's batch 24 on the 4 x 4 x 4
    cube, which splits a micro-batch into p^2 = 16 blocks): its step interpolated linearly between
    the two batches ``batch_between`` that it can split. Each collective's bytes and each kernel's
    work grow with the batch and their latencies do not, so the step is affine in the batch up to
    GEMM tile rounding; simulating the larger batch alone (as before) prices the fixed part per
    sequence too low."""
    lo, hi = run["batch_between"]
    b = run["flags"]["micro-batch-size"]
    if not lo < b < hi:
        raise ValueError(f"run {run['name']}: micro-batch-size {b} not inside batch_between {lo}-{hi}")
    ends = [Simulator.timed({**run, "flags": {**run["flags"], "micro-batch-size": x}}) for x in (lo, hi)]
    ms = ends[0].iteration_ms + (ends[1].iteration_ms - ends[0].iteration_ms) * (b - lo) / (hi - lo)
    return dataclasses.replace(ends[0], iteration_ms=ms, model=dataclasses.replace(ends[0].model, micro_batch_size=b))


def describe(r: SimResult, run: dict) -> str:
    """Short configuration of a simulated run: model, strategy, topology."""
    m, s = r.model, r.strategy
    back = {"megatron": "1-D", "atp": f"ATP{s.layout.shape}", "3d": "3-D"}[s.backend]
    extra = (" oases" if s.schedule == "oases" else "") + (" rc" if s.recompute else "")
    nodes = f"x{run['nodes']}" if run.get("nodes") else ""
    return (f"L{m.num_layers} h{m.hidden_size} b{m.micro_batch_size} {back} TP{s.tp} PP{s.pp} DP{s.dp} "
            f"m{s.num_microbatches}{extra} @{run['topology']}{nodes}")


def plan_argv(plan: dict, out: str) -> list[str]:
    """``megatron-oases plan`` argv of a plan row's flag dict."""
    argv = []
    for name, value in plan.items():
        argv += [f"--{name}", str(value)]
    return argv + ["--out", out, "--quiet"]


def run_plan(plan: dict) -> tuple[float, str, str]:
    """(planned speedup over uniform TP, our per-layer pick, configuration) from the planner."""
    import tempfile

    from megatron_oases.plan.plan_cli import build_parser as plan_parser, make_plan

    with tempfile.TemporaryDirectory() as tmp:
        data, _, _ = make_plan(plan_parser().parse_args(plan_argv(plan, os.path.join(tmp, "plan.json"))))
    pred = data["predicted"]
    pick = data["compact_layers"] or data["compact"]
    conf = (f"L{plan['num-layers']} h{plan['hidden-size']} TP{plan['tp']} gbs{plan['global-batch-size']} "
            f"{plan['memory-gb']} GiB @{plan['topology']}")
    return pred["uniform_tp_iteration_ms"] / pred["iteration_ms"], pick, conf


def error_pct(predicted: float, row: dict) -> float:
    """Signed error (percent) against the published number; against a range, 0 inside it, else
    against its nearest end."""
    if "published" in row:
        ref = row["published"]
    else:
        lo, hi = row["published_range"]
        ref = min(max(predicted, lo), hi)
    return 100.0 * (predicted - ref) / ref


def predict(row: dict, sim: Simulator, runs: dict) -> dict:
    """One row: its configuration, published number, prediction and error."""
    pick = ours = ""
    if "plan" in row:
        predicted, ours, conf = run_plan(row["plan"])
        unit, pick = "planned/uniform", row.get("published_pick", "")
    elif "run" in row:
        unit = row.get("unit", runs[row["run"]]["unit"])
        predicted = sim.value(row["run"], unit)
        conf = describe(sim.result(row["run"]), runs[row["run"]])
    else:
        a, b = row["ratio"]
        unit = f"ratio of {runs[a]['unit']}"
        predicted = sim.value(a) / sim.value(b)
        conf = f"{describe(sim.result(a), runs[a])} / {describe(sim.result(b), runs[b])}"
    published = row.get("published", row.get("published_range"))
    return {"id": row["id"], "paper": source_of(row, runs), "where": row["where"], "configuration": conf,
            "unit": unit, "published": published, "predicted": round(predicted, 3),
            "error_pct": round(error_pct(predicted, row), 1), "published_pick": pick, "our_pick": ours}


def fmt_published(p) -> str:
    return f"{p[0]:g}-{p[1]:g}" if isinstance(p, list) else f"{p:g}"


def summary(results: list[dict]) -> dict:
    """Median and max |error| overall and per paper, and the rows beyond 15%."""
    def stats(rs):
        errs = [abs(r["error_pct"]) for r in rs]
        return {"rows": len(errs), "median_abs_error_pct": round(statistics.median(errs), 1),
                "max_abs_error_pct": round(max(errs), 1), "over_15_pct": sum(e > 15 for e in errs)}
    papers = sorted({r["paper"] for r in results})
    return {"all": stats(results), **{p: stats([r for r in results if r["paper"] == p]) for p in papers}}


def format_table(results: list[dict]) -> str:
    """Markdown table, one line a row, then the per-paper error summary."""
    lines = ["| row | paper | where | configuration | unit | published | predicted | error % |",
             "|---|---|---|---|---|---:|---:|---:|"]
    for r in results:
        pick = f" (paper {r['published_pick']}; ours {r['our_pick']})" if r["our_pick"] else ""
        lines.append(f"| {r['id']} | {r['paper']} | {r['where']}{pick} | {r['configuration']} | {r['unit']} | "
                     f"{fmt_published(r['published'])} | {r['predicted']:.3g} | {r['error_pct']:+.1f} |")
    lines.append("")
    for name, s in summary(results).items():
        lines.append(f"{name}: {s['rows']} rows, median |error| {s['median_abs_error_pct']}%, "
                     f"max {s['max_abs_error_pct']}%, {s['over_15_pct']} beyond 15%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__.splitlines()[0], DATA, "/tmp/seeds/seeds")
    a = p.parse_args(argv)
    sources, runs, rows = load(a.data)
    try:
        rows = selected(rows, a.rows)
    except ValueError as e:
        p.error(str(e))
    sim = Simulator(runs)
    results = [predict(r, sim, runs) for r in rows]
    print(format_table(results))
    write_outputs(results, summary=summary(results), sources=sources, source_key="paper", out=a.out,
                  csv_rows=[{**r, "published": fmt_published(r["published"])} for r in results])
    print(f"wrote {a.out}.csv and {a.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
