"""Measure on the GPU at hand what the analytical device model assumes (issue 23, docs/sim.md).

For published rows of ``examples/validation/published_megatron.yaml`` (default: the H100 ones),
three measurements, each printed as a table and written to ``<out>/gpu_<what>.json``:

* ``gemms``: every distinct GEMM ``(M, N, K)`` of the rows' compute events (the layer
  description's ``Compute.gemms``), timed alone in the rows' dtype (``torch.mm``, inputs rotated
  over three sets so the L2 cache does not serve them), beside the analytical model's time for
  that GEMM alone (best-shape ceiling x tile / wave quantization x size curve). Per row: the
  FLOP-weighted ratio measured / model over every GEMM of one layer's events.
* ``dispatch``: host microseconds to issue one small kernel in eager PyTorch (the model's
  ``dispatch_us``), and one ``F.linear`` + bias + GeLU chain.
* ``events``: each row's compute events as ``megatron-oases profile`` times them (Megatron's
  local layer through the profiler's workloads; the row run with ``--transformer-impl local``,
  without ``--tp-comm-overlap``, since Transformer Engine is not installed there), beside
  ``DeviceModel.compute_ms`` for the same event (unfused attention). With ``--tiny`` the same
  events at hidden 256, sequence 256: there the host's issue time dominates, which is what the
  model's dispatch floor and ``layer_framework_us`` price.

The model is the row's (its topology's GPU, e.g. ``h100-sxm``); run on an H200 the GEMM and
event times are those of the same Hopper SM array and clocks (the H200 differs in memory size and
bandwidth), which the summary states. Runs on CPU too, for testing the script; its numbers then
say nothing about the model.

    python scripts/gpu_measure.py --out /tmp/gpu --rows h100-1.7B h100-7.1B
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PUBLISHED = os.path.join(ROOT, "examples", "validation", "published_megatron.yaml")
"""The rows whose GEMMs and events this script times (scripts/validate_published.py's table)."""

import torch  # noqa: E402

from megatron_oases.errors import ConfigError  # noqa: E402
from megatron_oases.output_paths import check_output_root  # noqa: E402
from megatron_oases.sim.frontends.cli import build_parser, simulation_inputs  # noqa: E402
from megatron_oases.sim.core.events import build_stage_events, unique_events  # noqa: E402
from megatron_oases.sim.frontends.published import sim_argv  # noqa: E402
from megatron_oases.sim.calibrate.profiler import ProfileSettings, profile_compute, time_ms  # noqa: E402
from megatron_oases.errors import OneLineErrorParser  # noqa: E402
from megatron_oases.train_args import cuda_wanted  # noqa: E402
from megatron_oases.sim.frontends.published import load_rows  # noqa: E402  (as the validation reads them)

DTYPES = {2: torch.bfloat16, 4: torch.float32}


def row_inputs(row: dict, **override):
    """(model, strategy, device model) of a row, its flags overridden by ``override``."""
    flags = {**row["flags"], **override}
    return simulation_inputs(build_parser().parse_args(sim_argv(row["topology"], row["nodes"], flags)))


def compute_events(model, strategy, dm) -> dict:
    """key -> compute Event of the first pipeline stage (what one layer's micro-batch runs)."""
    stages = build_stage_events(model, strategy, dm.topology)
    return {k: e for k, e in unique_events(stages[:1]).items() if e.kind == "compute"}


def model_gemm_ms(dm, m: int, n: int, k: int) -> float:
    """The analytical model's time of one GEMM alone (``DeviceModel.gpu_compute_ms`` of a segment
    holding only it)."""
    from megatron_oases.describe.ops import Compute

    return dm.gpu_compute_ms(Compute(name="gemm", gemm_flops=2.0 * m * n * k, gemms=((m, n, k),)))


def time_gemm(m: int, n: int, k: int, dtype, device, reps: int) -> float:
    sets = [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
            for _ in range(3)]
    out = torch.empty(m, n, device=device, dtype=dtype)
    i = [0]

    def fn():
        a, b = sets[i[0] % 3]
        i[0] += 1
        torch.mm(a, b, out=out)

    return time_ms(fn, warmup=3, reps=reps, device=device)


def measure_gemms(rows: list[dict], device, reps: int, limit_s: float) -> dict:
    start = time.perf_counter()
    shapes: dict[tuple, float] = {}  # (M, N, K, dtype) -> ms: rows of one dtype share a timing
    per_row = []
    for row in rows:
        model, strategy, dm = row_inputs(row)
        dtype = DTYPES[model.bytes_per_element]
        flops = meas = modeled = 0.0
        complete = True
        for ev in compute_events(model, strategy, dm).values():
            for m, n, k in ev.op.gemms:
                key = (m, n, k, str(dtype).split(".")[-1])
                if key not in shapes:
                    if time.perf_counter() - start > limit_s:
                        complete = False
                        continue
                    shapes[key] = time_gemm(m, n, k, dtype, device, reps)
                f = 2.0 * m * n * k
                flops += f
                meas += shapes[key]
                modeled += model_gemm_ms(dm, m, n, k)
        if flops:
            per_row.append({"row": row["id"], "gpu": dm.gpu.name, "gemm_tflop": round(flops / 1e12, 4),
                            "measured_ms": round(meas, 4), "model_ms": round(modeled, 4),
                            "measured_over_model": round(meas / modeled, 4),
                            "measured_tflops": round(flops / meas / 1e9, 1), "complete": complete})
    _, _, dm = row_inputs(rows[0])
    table = [{"m": m, "n": n, "k": k, "dtype": dt, "measured_ms": round(t, 5),
              "measured_tflops": round(2.0 * m * n * k / t / 1e9, 1),
              "model_ms": round(model_gemm_ms(dm, m, n, k), 5), "model_gpu": dm.gpu.name}
             for (m, n, k, dt), t in sorted(shapes.items())]  # the first row's GPU model
    return {"shapes": table, "rows": per_row}


def time_gemm_sustained(m: int, n: int, k: int, dtype, device, reps: int) -> float:
    """Milliseconds of one GEMM in a run of ``reps`` issued back to back (one pair of events, no
    synchronisation between them: the clocks and queue of a training step, not of a lone GEMM;
    inputs rotated over three sets), median of three runs after a warm-up run."""
    sets = [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
            for _ in range(3)]
    out = torch.empty(m, n, device=device, dtype=dtype)

    def run():
        for i in range(reps):
            a, b = sets[i % 3]
            torch.mm(a, b, out=out)

    return time_ms(run, warmup=1, reps=3, device=device) / reps


def gemm_table_shapes() -> list[tuple[int, int, int]]:
    """Every distinct (M, N, K) of the device model's measured GEMM table, any card."""
    from megatron_oases.pricing.gemm_table import load_tables

    return sorted({(p.m, p.n, p.k) for t in load_tables().values() for p in t.points})


def measure_table(shapes: list[tuple[int, int, int]], device, reps: int, limit_s: float) -> dict:
    """The table's shapes timed on this card in bf16 (``time_gemm_sustained``), in the format
    ``scripts/gemm_table_build.py --gemms`` adds to the table."""
    start = time.perf_counter()
    out = []
    for m, n, k in shapes:
        if time.perf_counter() - start > limit_s:
            break
        ms = time_gemm_sustained(m, n, k, torch.bfloat16, device, reps)
        out.append({"m": m, "n": n, "k": k, "dtype": "bf16", "measured_ms": round(ms, 5),
                    "measured_tflops": round(2.0 * m * n * k / ms / 1e9, 1)})
    return {"shapes": out, "complete": len(out) == len(shapes),
            "method": f"torch.mm, {reps} back to back per timing, median of 3 after a warm-up run"}


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxNxK, e.g. 4096x6144x4096 (got {text!r})") from None
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1 (got {text!r})")
    return m, n, k


def measure_dispatch(device) -> dict:
    """Host microseconds per eager kernel issue (median of 5 runs of 2,000 issues)."""
    x = torch.ones(8, device=device)
    w = torch.randn(64, 64, device=device)
    b = torch.randn(64, device=device)
    h = torch.randn(8, 64, device=device)

    def per_call_us(fn, n=2000):
        runs = []
        for _ in range(5):
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n * 1e6)
            if device.type == "cuda":
                torch.cuda.synchronize()
        return statistics.median(runs)

    return {"add_us": round(per_call_us(lambda: x.add_(1.0)), 2),
            "linear_bias_gelu_us": round(per_call_us(
                lambda: torch.nn.functional.gelu(torch.nn.functional.linear(h, w, b))), 2)}


def measure_events(rows: list[dict], device, reps: int, tiny: bool, limit_s: float) -> list[dict]:
    start = time.perf_counter()
    out = []
    settings = ProfileSettings(device=device.type, warmup=2, reps=reps, nproc=1)
    for row in rows:
        over = {"transformer-impl": "local", "tp-comm-overlap": False}
        if tiny:
            over.update({"hidden-size": 256, "num-attention-heads": 4, "seq-length": 256})
        model, strategy, dm = row_inputs(row, **over)
        evs = compute_events(model, strategy, dm)
        for key, ev in evs.items():
            if ev.name in ("optimizer", "grad_norm") or time.perf_counter() - start > limit_s:
                continue
            try:
                ms = profile_compute([ev], settings)[key]
            except Exception as e:  # noqa: BLE001 - a workload the profiler lacks is reported, not fatal
                out.append({"row": row["id"], "event": key, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            c = ev.op
            out.append({"row": row["id"], "event": key, "kernels": c.kernels,
                        "measured_ms": round(ms, 4), "model_ms": round(dm.compute_ms(c), 4),
                        "model_gpu_ms": round(dm.gpu_compute_ms(c), 4),
                        "model_dispatch_ms": round(dm.dispatch_floor_ms(c), 4)})
    return out


def kernel_class(name: str) -> str:
    """A CUDA kernel's kind by its name: GEMM, softmax, dropout / random, or other element-wise."""
    n = name.lower()
    if any(t in n for t in ("gemm", "xmma", "cutlass", "sm90_", "sm80_", "cublas", "nvjet")):
        return "gemm"
    if "softmax" in n:
        return "softmax"
    if any(t in n for t in ("philox", "dropout", "fused_dropout", "bernoulli", "rand")):
        return "dropout"
    return "elementwise"


def measure_kernels(rows: list[dict], device, reps: int) -> list[dict]:
    """Device time per kernel class of each row's layer events (torch.profiler, CUDA activity),
    averaged over ``reps`` runs after warm-up: where an event's time goes."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_oases.sim.calibrate.layer_workloads import single_rank_world
    from megatron_oases.sim.calibrate.workloads import compute_workload

    out = []
    for row in rows:
        model, strategy, dm = row_inputs(row, **{"transformer-impl": "local", "tp-comm-overlap": False})
        with single_rank_world():
            for key, ev in compute_events(model, strategy, dm).items():
                if ev.name.split(".")[0] not in ("attention", "mlp"):
                    continue
                fn = compute_workload(ev.name, dict(ev.dims), device)
                for _ in range(2):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(reps):
                        fn()
                    torch.cuda.synchronize()
                by_class: dict[str, float] = {}
                top: dict[str, float] = {}
                for e in prof.events():
                    if str(e.device_type).split(".")[-1] != "CUDA":
                        continue
                    t = e.time_range.elapsed_us()
                    by_class[kernel_class(e.name)] = by_class.get(kernel_class(e.name), 0.0) + t / 1e3 / reps
                    top[e.name[:90]] = top.get(e.name[:90], 0.0) + t / 1e3 / reps
                c = ev.op
                out.append({"row": row["id"], "event": key, **{f"{k}_ms": round(v, 4) for k, v in sorted(by_class.items())},
                            "model_gemm_ms": round(dm.gpu_compute_ms(dataclasses.replace(
                                c, attention_flops=0.0, elementwise_bytes=0.0, score_bytes=0.0)), 4),
                            "model_gpu_ms": round(dm.gpu_compute_ms(c), 4),
                            "model_elementwise_GB": round(c.elementwise_bytes / 1e9, 3),
                            "model_score_GB": round(c.score_bytes / 1e9, 3),
                            "top": {k: round(v, 4) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:8]}})
                del fn
    return out


def _print(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    if not rows:
        print("(nothing)")
        return
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))


def chosen_rows(p: argparse.ArgumentParser, flag: str, rows: list[dict], wanted: list[str]) -> list[dict]:
    """The rows ``flag`` names, in file order; one error line naming the flag and the unknown ids."""
    ids = {r["id"] for r in rows}
    unknown = [w for w in wanted if w not in ids]
    if unknown:
        p.error(f"{flag}: unknown row {', '.join(unknown)}; the ids are those of "
                f"examples/validation/published_megatron.yaml (e.g. {', '.join(sorted(ids)[:3])})")
    return [r for r in rows if r["id"] in wanted]


def main(argv: list[str] | None = None) -> int:
    p = OneLineErrorParser(prog="gpu_measure.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for gpu_gemms.json, gpu_dispatch.json, gpu_events*.json")
    p.add_argument("--rows", nargs="+", default=None, help="row ids (default: every H100 row)")
    p.add_argument("--what", nargs="+", default=["gemms", "dispatch", "events", "tiny"],
                   choices=["gemms", "dispatch", "events", "tiny", "kernels", "table"],
                   help="table: the measured GEMM table's shapes (pricing/gemm_table.json) in bf16, "
                        "timed back to back, into gpu_table.json (gpu_check.sh's gemm step)")
    p.add_argument("--table-shapes", type=_shape, nargs="+", default=None, metavar="MxNxK",
                   help="with --what table: these shapes instead of the table's (tests on CPU)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--event-rows", nargs="+", default=None, help="rows whose events are timed (default: --rows' first two)")
    p.add_argument("--limit-s", type=float, default=60.0, help="stop timing new shapes / events after this long (per part)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--shrink", action="store_true", help="rows at hidden 128, seq 64, vocabulary 512 (tests on CPU)")
    a = p.parse_args(argv)
    try:
        check_output_root("--out", a.out)
        cuda = cuda_wanted(a)  # --device cuda needs a visible CUDA device
    except ConfigError as e:
        p.error(str(e))
    if "kernels" in a.what and not cuda:
        p.error("--what kernels times CUDA kernels (torch.profiler's CUDA activity); run it on a "
                "CUDA device or drop kernels from --what")
    if a.reps < 1:
        p.error(f"--reps must be >= 1 (got {a.reps})")
    if a.limit_s <= 0:
        p.error(f"--limit-s must be > 0 (got {a.limit_s}): each part stops timing new shapes after it")
    rows_needed = set(a.what) - {"table"}  # the table's shapes need no published row
    _, rows = load_rows(PUBLISHED) if rows_needed else ({}, [])  # each row's flags merged over its source's defaults
    if a.shrink:
        small = {"hidden-size": 128, "num-attention-heads": 2, "seq-length": 64, "vocab-size": 512}
        rows = [{**r, "flags": {**r["flags"], **small}} for r in rows]
    wanted = a.rows or [r["id"] for r in rows if r["id"].startswith("h100-")] if rows_needed else []
    chosen = chosen_rows(p, "--rows", rows, wanted)
    ev_rows = chosen_rows(p, "--event-rows", rows, a.event_rows or wanted[:2])
    device = torch.device("cuda" if cuda else "cpu")
    os.makedirs(a.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "note": "model = the row's GPU (e.g. h100-sxm); an H200 has the H100 SXM's SM array and clocks"}
    results: dict[str, object] = {}
    if "gemms" in a.what:
        results["gemms"] = measure_gemms(chosen, device, a.reps, a.limit_s)
        _print("GEMMs per row (measured / model)", results["gemms"]["rows"])
        _print("GEMM shapes", results["gemms"]["shapes"])
    if "table" in a.what:
        results["table"] = measure_table(a.table_shapes or gemm_table_shapes(), device, a.reps, a.limit_s)
        meta["method"] = results["table"]["method"]
        _print("GEMM table shapes", results["table"]["shapes"])
    if "dispatch" in a.what:
        results["dispatch"] = measure_dispatch(device)
        _print("host dispatch", [results["dispatch"]])
    for part, tiny in (("events", False), ("tiny", True)):
        if part in a.what:
            results[part] = measure_events(ev_rows, device, a.reps, tiny, a.limit_s)
            _print(f"compute events{' at hidden 256, seq 256' if tiny else ''}", results[part])
    if "kernels" in a.what:
        try:
            results["kernels"] = measure_kernels(ev_rows, device, a.reps)
        except Exception as e:  # noqa: BLE001 - keep the other parts' results
            import traceback

            traceback.print_exc()
            results["kernels"] = [{"error": f"{type(e).__name__}: {e}"}]
        _print("kernel time by class", [{k: v for k, v in r.items() if k != "top"} for r in results["kernels"]])
    for part, value in results.items():
        with open(os.path.join(a.out, f"gpu_{part}.json"), "w", encoding="utf-8") as f:
            json.dump({"meta": meta, part: value}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
