"""Leave-one-source-out cross-validation of the device model's unmeasurable constants (issue 35,
item 2; ``scripts/validate_published.py``, docs/sim_validation.md).

Two kinds of constant cannot be measured on any machine this project has: how far below the
best-shape GEMM ceiling training GEMMs run at a published run's real shapes on a card we do not
have (``DeviceModel.gemm_shape_factor``), and the host cost per layer event of a software stack we
cannot run (``SoftwareStack.layer_framework_us`` of ``apex-fused`` and ``transformer_engine``).
They are estimated the one honest way left: fit them on every source but one, predict the
left-out source, repeat for each source. Only those held-out predictions are reported; the fitted
values of each fold and their spread go beside them.

The fit is a grid search: each row is simulated once per grid point (``grid_errors``) and a fold
picks the point that minimises its training rows' squared log error (``fit``), each source weighing
the same (a source's rows share its cluster, software and way of measuring: 30 rows of one layout
search are one piece of evidence, not thirty, and must not outvote a source of ten). The GEMM factor is
shared by every row (it is a property of real shapes against a best-shape measurement, not of
one GPU, so a fold without a GPU's other source still has a value); the host cost is per stack,
each row informing its own stack's.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable

GEMM_FACTORS = (0.70, 0.725, 0.75, 0.775, 0.80, 0.825, 0.85, 0.875, 0.90, 0.925, 0.95, 0.975, 1.0)
"""Candidate ``gemm_shape_factor`` values (1.0: the best-shape ceiling itself)."""
HOST_US = (0.0, 100.0, 200.0, 300.0, 500.0, 800.0, 1200.0)
"""Candidate per-event host costs (us) of the row's stack; the local stack measured 287 us plus
42 us a kernel on an H200 (pricing/stack.py)."""


TIME_UNITS = ("s_per_iteration",)
"""Units in which a larger number is slower (a row's ``unit``)."""


OPTIMISTIC = (max(GEMM_FACTORS), min(HOST_US))
"""The default grid's corner where compute is fastest: every GEMM at the best-shape ceiling, no
host cost. A row the simulator predicts slower than measured even there cannot be reached by any
fit; its stated configuration (or an assumption about it) is in question, not a constant
(``infeasible``)."""


def fastest_corner(ratios: dict[str, dict[tuple[float, float], float]]) -> tuple[float, float]:
    """The grid's fastest point: its largest GEMM factor and smallest host cost."""
    points = next(iter(ratios.values())).keys()
    return max(g for g, _ in points), min(h for _, h in points)


def infeasible(ratios: dict[str, dict[tuple[float, float], float]]) -> list[str]:
    """Rows predicted slower than measured (ratio < 1) at the grid's fastest corner. Any shortfall
    counts; whether a row's configuration then changes is a judgement the data file states."""
    if not ratios:
        return []
    corner = fastest_corner(ratios)
    return sorted(i for i, r in ratios.items() if r[corner] < 1.0)


def tune(gemm_factor: float, host_us: float):
    """A ``simulate_run(tune=...)`` function: the device model with these two constants."""
    def apply(dm):
        stack = dataclasses.replace(dm.stack, layer_framework_us=host_us)
        return dataclasses.replace(dm, gemm_shape_factor=gemm_factor, stack=stack)
    return apply


def grid_errors(rows: list[dict], predict: Callable[[dict, object], float], *,
                gemm_factors=GEMM_FACTORS, host_us=HOST_US) -> dict[str, dict[tuple[float, float], float]]:
    """{row id: {(gemm factor, host us): prediction / measured}}, ``predict(row, tune)`` returning
    the row's prediction in its unit (a time unit is inverted, so > 1 is always "too fast")."""
    def speed_ratio(r: dict, predicted: float) -> float:
        return r["measured"] / predicted if r["unit"] in TIME_UNITS else predicted / r["measured"]
    return {r["id"]: {(g, h): speed_ratio(r, predict(r, tune(g, h))) for g in gemm_factors for h in host_us}
            for r in rows}


def _loss(ratios: list[float], weights: list[float]) -> float:
    return sum(w * math.log(x) ** 2 for x, w in zip(ratios, weights))


def source_weights(rows: list[dict]) -> dict[str, float]:
    """{row id: 1 / rows of its source}: every source's rows weigh 1 together in ``fit``."""
    n: dict[str, int] = {}
    for r in rows:
        n[r["source"]] = n.get(r["source"], 0) + 1
    return {r["id"]: 1.0 / n[r["source"]] for r in rows}


TIE = 1e-9
"""Losses closer than this are equal: the rows cannot tell those host costs apart."""


def prior_host_us(hosts) -> float:
    """The grid point nearest the one measured host cost per layer event (the local stack's,
    Megatron's eager layer on an H200; pricing/stack.py)."""
    from ...pricing.stack import LOCAL

    return min(hosts, key=lambda h: abs(h - LOCAL.layer_framework_us))


def fit(rows: list[dict], ratios: dict[str, dict[tuple[float, float], float]]) -> dict:
    """The grid point that minimises the rows' squared log error, each source's rows weighing 1
    together (``source_weights``): one GEMM factor for all rows,
    one host cost per stack (``row["stack"]``); a stack without rows keeps None. Where a stack's
    rows fit several host costs equally (GEMM-bound rows: the host issues ahead and its cost never
    shows), the data say nothing, so the measured prior (``prior_host_us``) is taken among them,
    not the grid's smallest value."""
    stacks = sorted({r["stack"] for r in rows})
    points = next(iter(ratios.values())).keys()
    gemms, hosts = sorted({g for g, _ in points}), sorted({h for _, h in points})
    prior = prior_host_us(hosts)
    weight = source_weights(rows)
    best = None
    for g in gemms:
        total, chosen = 0.0, {}
        for st in stacks:
            mine = [r["id"] for r in rows if r["stack"] == st]
            losses = {h: _loss([ratios[i][(g, h)] for i in mine], [weight[i] for i in mine]) for h in hosts}
            loss = min(losses.values())
            h = min((h for h, v in losses.items() if v <= loss + TIE), key=lambda h: abs(h - prior))
            total += loss
            chosen[st] = h
        if best is None or total < best[0]:
            best = (total, g, chosen)
    return {"gemm_shape_factor": best[1], "layer_framework_us": best[2]}


def leave_one_source_out(rows: list[dict], ratios: dict[str, dict[tuple[float, float], float]]) -> tuple[list[dict], list[dict]]:
    """(held-out results, folds). Each result is the row's prediction ratio under the fit of the
    fold that left its source out, with that fold's training sources (``fit_sources``); a stack
    no training row informs takes the grid point nearest the host cost measured for the local
    stack (the one measured prior; stated in the fold as ``unfitted``)."""
    sources = sorted({r["source"] for r in rows})
    results, folds = [], []
    prior = prior_host_us(sorted({h for _, h in next(iter(ratios.values())).keys()}))
    for held in sources:
        train = [r for r in rows if r["source"] != held]
        if not train:
            raise ValueError("leave-one-source-out needs rows from at least two sources")
        f = fit(train, ratios)
        fold = {"held_out": held, "fit_sources": sorted({r["source"] for r in train}), **f, "unfitted": []}
        for r in rows:
            if r["source"] != held:
                continue
            h = f["layer_framework_us"].get(r["stack"])
            if h is None:
                h = prior
                fold["unfitted"].append(r["stack"])
            results.append({"id": r["id"], "source": held, "fit_sources": fold["fit_sources"],
                            "gemm_shape_factor": f["gemm_shape_factor"], "layer_framework_us": h,
                            "ratio": ratios[r["id"]][(f["gemm_shape_factor"], h)]})
        fold["unfitted"] = sorted(set(fold["unfitted"]))
        folds.append(fold)
    return results, folds


def spread(folds: list[dict]) -> dict:
    """Per fitted constant: median, min and max over the folds."""
    out = {"gemm_shape_factor": [f["gemm_shape_factor"] for f in folds]}
    for st in sorted({s for f in folds for s in f["layer_framework_us"]}):
        out[f"{st}.layer_framework_us"] = [f["layer_framework_us"][st] for f in folds if st in f["layer_framework_us"]]
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "folds": len(v)} for k, v in out.items()}
