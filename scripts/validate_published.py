"""Validate the simulator against published Megatron training measurements (docs/sim_validation.md).

Each row of ``examples/validation/published_megatron.yaml`` is one published run: its
configuration as ``megatron-oases sim`` flags, a topology, and the measured number in the
source's unit. The row is simulated with the analytical device model (no profile), through the
same flag mapping ``megatron-oases sim`` uses (``sim.frontends.published.simulate_run``), and converted to
that unit the way the source counts it:

  tflops_per_gpu    FLOPs per iteration / (iteration time x GPUs), the FLOPs by Megatron's formula
                    (``megatron_oases.flops``), with a full recompute's forward counted when the
                    source's ``flops`` is ``recompute`` (the 2021 A100 table) and not when ``model``
  s_per_iteration   the simulated iteration time
  samples_per_gpu_s global batch / (iteration time x GPUs)

The constants no machine here can measure (``DeviceModel.gemm_shape_factor``, the per-event host
cost of the ``apex-fused`` and ``transformer_engine`` stacks) are fitted by leave-one-source-out
cross-validation (``sim.calibrate.crossval``): each source is predicted by a fit on the other sources only.
Prints the table of those held-out predictions (row, source, measured, predicted, error %), the
median and max |error|, the rows slower than measured even at the grid's fastest corner (no
constant can reach them: their configuration is in question), and the fitted constants with their
spread over the folds; writes
``<out>.csv`` and ``<out>.json`` (each row with the sources its fit saw).

    python scripts/validate_published.py --out /tmp/validation/published
    python scripts/validate_published.py --rows a100-1.7B h100-1.7B      # a subset
"""
from __future__ import annotations

import os
import statistics
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from megatron_oases.sim.calibrate import crossval  # noqa: E402
from megatron_oases.sim.frontends.published import (error_pct, iteration_flops, per_source_table, script_parser,
                                                    selected, simulate_run, write_outputs)
from megatron_oases.sim.frontends.published import load_rows as published_rows

DATA = os.path.join(ROOT, "examples", "validation", "published_megatron.yaml")


def load_rows(path: str = DATA) -> tuple[dict, list[dict]]:
    """(sources, rows) of the data file (``published.load_rows``), by default the committed table."""
    return published_rows(path)


def predict_row(row: dict, sources: dict, tune=None) -> dict:
    """Simulate one row (``tune``: the device model's constants of a fold, ``sim.calibrate.crossval.tune``);
    its prediction in the row's unit and the signed error (percent)."""
    r = simulate_run(row["topology"], row["nodes"], row["flags"], tune=tune)
    model, strategy = r.model, r.strategy
    secs = r.iteration_ms / 1e3
    if row["unit"] == "s_per_iteration":
        predicted = secs
    elif row["unit"] == "samples_per_gpu_s":
        samples = model.micro_batch_size * strategy.num_microbatches * strategy.dp
        predicted = samples / (secs * strategy.world_size)
    else:
        recompute = sources[row["source"]].get("flops") == "recompute"
        predicted = iteration_flops(model, strategy, recompute) / (secs * strategy.world_size) / 1e12
    return {"id": row["id"], "source": row["source"], "gpus": strategy.world_size,
            "strategy": f"TP{strategy.tp} PP{strategy.pp} DP{strategy.dp} m{strategy.num_microbatches}",
            "unit": row["unit"], "measured": row["measured"], "predicted": round(predicted, 3),
            "error_pct": round(100.0 * (predicted - row["measured"]) / row["measured"], 1),
            "iteration_s": round(secs, 3), "bubble_pct": round(100.0 * r.bubble_fraction, 1),
            "exposed_comm_ms": round(r.exposed_comm_ms, 1), "peak_memory_GB": round(r.peak_memory_GB, 1),
            "fits_memory": r.fits}


def error_summary(results: list[dict]) -> dict:
    """Median and max |error| (percent), the rows and the sources they came from."""
    errs = [abs(r["error_pct"]) for r in results]
    return {"rows": len(errs), "sources": len({r["source"] for r in results}),
            "median_abs_error_pct": round(statistics.median(errs), 1) if errs else None,
            "max_abs_error_pct": round(max(errs), 1) if errs else None}


def format_table(results: list[dict]) -> str:
    """Markdown table: row, source, GPUs, strategy, unit, measured, predicted, error."""
    lines = ["| row | source | GPUs | strategy | unit | measured | predicted | error % |",
             "|---|---|---:|---|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['id']} | {r['source']} | {r['gpus']} | {r['strategy']} | {r['unit']} | "
                     f"{r['measured']:g} | {r['predicted']:.1f} | {r['error_pct']:+.1f} |")
    s = error_summary(results)
    lines.append(f"\nmedian |error| {s['median_abs_error_pct']}%, max |error| {s['max_abs_error_pct']}% "
                 f"over {s['rows']} rows from {s['sources']} sources")
    slow = [r["id"] for r in results if r.get("unreachable")]
    if slow:
        lines.append(f"slower than measured even at the grid's fastest corner (best-shape GEMM ceiling, no host "
                     f"cost), so no fit reaches them: {', '.join(slow)}")
    return "\n".join(lines)


def cross_validate(rows: list[dict], sources: dict, *, gemm_factors=crossval.GEMM_FACTORS,
                   host_us=crossval.HOST_US) -> tuple[list[dict], list[dict], dict]:
    """(held-out results, folds, spread): every row simulated on the grid, each source predicted
    by the fit on the others (``sim.calibrate.crossval``). A result carries the fold's ``fit_sources``."""
    ratios = crossval.grid_errors(rows, lambda r, t: predict_row(r, sources, t)["predicted"],
                                  gemm_factors=gemm_factors, host_us=host_us)
    held, folds = crossval.leave_one_source_out(rows, ratios)
    everyone = crossval.fit(rows, ratios)  # in-source: the fit that saw every row (reported only as the gap)
    by_id = {r["id"]: r for r in rows}
    unreachable = set(crossval.infeasible(ratios))
    results = []
    for h in held:
        row = by_id[h["id"]]
        res = predict_row(row, sources, crossval.tune(h["gemm_shape_factor"], h["layer_framework_us"]))
        results.append({**res, "stack": row["stack"], "fit_sources": " ".join(h["fit_sources"]),
                        "gemm_shape_factor": h["gemm_shape_factor"], "layer_framework_us": h["layer_framework_us"],
                        "unreachable": h["id"] in unreachable,
                        "in_source_error_pct": error_pct(row["unit"], ratios[h["id"]][(
                            everyone["gemm_shape_factor"], everyone["layer_framework_us"][row["stack"]])])})
    order = {r["id"]: i for i, r in enumerate(rows)}
    return sorted(results, key=lambda r: order[r["id"]]), folds, crossval.spread(folds)


def format_spread(spread: dict, folds: list[dict]) -> str:
    """The fitted constants: median and range over the folds, and each fold's values."""
    lines = ["| constant | median | min | max | folds |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v['median']:g} | {v['min']:g} | {v['max']:g} | {v['folds']} |" for k, v in spread.items()]
    for f in folds:
        hosts = ", ".join(f"{k} {v:g} us" for k, v in f["layer_framework_us"].items())
        miss = f" (no training row for {', '.join(f['unfitted'])}: the local stack's measured host cost)" if f["unfitted"] else ""
        lines.append(f"fold without {f['held_out']}: gemm_shape_factor {f['gemm_shape_factor']:g}; {hosts}{miss}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__.splitlines()[0], DATA, "/tmp/validation/published")
    p.add_argument("--gemm-factors", type=float, nargs="+", default=list(crossval.GEMM_FACTORS),
                   help="candidate gemm_shape_factor values of the fit")
    p.add_argument("--host-us", type=float, nargs="+", default=list(crossval.HOST_US),
                   help="candidate per-event host costs (us) of each stack")
    a = p.parse_args(argv)
    sources, rows = load_rows(a.data)
    try:
        rows = selected(rows, a.rows)
    except ValueError as e:
        p.error(str(e))
    if len({r["source"] for r in rows}) < 2:
        p.error("leave-one-source-out needs rows from at least two sources")
    results, folds, spread = cross_validate(rows, sources, gemm_factors=tuple(a.gemm_factors),
                                            host_us=tuple(a.host_us))
    print(format_table(results))
    print(per_source_table(results))
    print(format_spread(spread, folds))
    summary = {**error_summary(results), "fitted": spread, "folds": folds}
    write_outputs(results, summary=summary, sources=sources, source_key="source", out=a.out)
    print(f"wrote {a.out}.csv and {a.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
