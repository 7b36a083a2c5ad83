"""The one-GPU overlap benchmark: stock and Oases step times with TP collectives as stand-ins.

``python scripts/bench_gpu_overlap.py [benchmark flags] [trainer flags]``. The model is the
reference trainer's (``train.setup`` with the trainer's own flags, ``--schedule default`` then
``--schedule oases``, the same recompute flags for both), built as rank 0 of a TP-t fake world
(``fake_world``). For each schedule it times forward + backward steps (optimizer with
``--optimizer-step``):

* compute only: the fake collectives return at once (they cost ~0);
* comm-disabled: every collective a stand-in of zero duration (the stream hand-offs stay): the
  step with TP communication switched off, the bound a user understands;
* with stand-ins, per kind (``sleep``, ``copy``, ``channels``, ``nccl``: ``standins``);
* stand-ins only: the same stand-ins of one step back to back, no compute;
* the forward pass alone, each of those ways (``forward_only``), so the step splits into its
  passes: the pass bound, sum over forward and backward of max(compute, stand-ins), is the
  shortest step a schedule can reach that overlaps each pass's collectives with that pass's
  compute only (``pass_bound``): the forward carries half the layers' collectives with about a
  third of the compute, so at a link matched to the whole step it is communication-bound.

``--match-compute`` (default) picks the link speed at which one step's stand-ins of the first
schedule take its compute-only time (the acceptance point of issue 34: Oases within 10% of
max(compute, stand-in) and 1.3x faster than stock); ``--link-gbps`` fixes it instead.

The bound table (``summary.records``) puts stock, Oases, comm-disabled and max(compute,
communication) side by side per kind.

``--ep E`` runs an MoE model (``--num-experts``) as rank 0 of a TP x EP fake world, its
expert-parallel all-to-alls stand-ins too (``moe``: the routing metadata, random router logits,
DP's gradient reduction not priced).

``--trace DIR`` also records one step of each schedule and stand-in kind with ``torch.profiler``
(``DIR/<schedule>-<kind>.json.gz``, Chrome's format) and reports where the compute stream sat
idle in it: while a stand-in ran (exposed communication) or with nothing running (the host)
(``trace_gaps``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys

from megatron_oases.errors import ConfigError, OneLineErrorParser, comma_names, range_refusal

NOTE = ("loss values are meaningless: one process is rank 0 of a fake TP world, its collectives "
        "move no data")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="bench_gpu_overlap.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Every other flag goes to the reference trainer (megatron-oases train --help): "
               "--hidden-size, --num-attention-heads, --seq-length, --micro-batch-size, "
               "--num-layers, --bf16, --device, --recompute-granularity, ...")
    p.add_argument("--tp", type=int, default=2, help="TP size t of the fake world (default 2)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size e of an MoE model (--num-experts): the fake world is t x e "
                        "ranks, DP = e, and the all-to-alls over EP are stand-ins too "
                        "(benchmarks/standin/moe.py; default 1)")
    p.add_argument("--kinds", default="sleep,copy",
                   help="stand-in kernels: sleep, copy, channels, nccl (default sleep,copy)")
    p.add_argument("--channels", type=int, default=None,
                   help="thread blocks of the channels and nccl stand-ins (default: 16 for channels; "
                        "for nccl, NCCL's channels for the link: 2 per 25 GB/s, at most 32)")
    p.add_argument("--schedules", default="default,oases",
                   help="schedules to time, in order (default: default,oases)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per measurement (default 2)")
    link = p.add_mutually_exclusive_group()
    link.add_argument("--link-gbps", type=float, default=None, help="link bandwidth per rank, GB/s")
    link.add_argument("--match-compute", action="store_true",
                      help="(default) the link at which the first schedule's stand-ins take its "
                           "compute-only step time")
    p.add_argument("--latency-us", type=float, default=5.0, help="link latency per ring step (default 5)")
    p.add_argument("--scratch-mb", type=float, default=None,
                   help="copy stand-ins' scratch buffers, MiB each (default 1024 on CUDA, 4 on CPU)")
    p.add_argument("--optimizer-step", action="store_true",
                   help="time the optimizer step too (it synchronises the host: found-inf, grad norm)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write a Chrome trace of one step per schedule and kind here, and report the "
                        "compute stream's idle time in it")
    p.add_argument("--out", default=None, help="write the results as JSON here (its folder is made when missing)")
    p.add_argument("--label", default=None,
                   help="the model's name in the bound table and the JSON (default: tp<t>)")
    return p


# (flag, attribute, lowest allowed, lowest inclusive?): the benchmark's numeric flags
_RANGES = (
    ("--tp", "tp", 1, True),  # TP 1 only with --ep > 1: validate_args
    ("--ep", "ep", 1, True),
    ("--channels", "channels", 1, True),
    ("--steps", "steps", 1, True),
    ("--warmup", "warmup", 0, True),
    ("--link-gbps", "link_gbps", 0, False),
    ("--latency-us", "latency_us", 0, True),
    ("--scratch-mb", "scratch_mb", 0, False),
)


def validate_args(a: argparse.Namespace, rest: list[str]) -> None:
    """Every benchmark flag and the trainer's flags at each schedule, before any model is built
    (``ConfigError``, one line naming the flag)."""
    from benchmarks.standin.moe import is_moe_run
    from benchmarks.standin.standins import KINDS
    from megatron_oases.output_paths import check_output_root
    from megatron_oases.train_args import SCHEDULES, cuda_wanted, validate_config

    from megatron_oases.run_config import options_present

    values = options_present(a, [name for _, name, _, _ in _RANGES])
    for flag, name, low, inclusive in _RANGES:
        value = values.get(name)
        if value is not None and range_refusal(flag, value, low, inclusive=inclusive):
            raise ConfigError(range_refusal(flag, value, low, inclusive=inclusive))
    if a.tp == 1 and a.ep == 1:
        raise ConfigError("--tp must be >= 2 (got 1): TP 1 has no collective to stand in for, unless --ep >= 2 "
                          "runs an MoE model's all-to-alls")
    given = {tok.split("=", 1)[0] for tok in rest}
    for flag, ours in (("--tensor-model-parallel-size", "--tp"), ("--expert-model-parallel-size", "--ep")):
        if flag in given:
            raise ConfigError(f"{flag} sizes the trainer's world; give it to the benchmark as {ours}")
    if a.ep > 1 and not is_moe_run(rest):
        raise ConfigError(f"--ep {a.ep} splits an MoE model's experts; add --num-experts (e.g. --num-experts 8) "
                          f"after -- or drop --ep")
    kinds = comma_names("--kinds", a.kinds, KINDS)
    if a.channels is not None and not {"channels", "nccl"} & set(kinds):
        raise ConfigError(f"--channels sizes the channels and nccl stand-ins, neither of which --kinds "
                          f"{a.kinds} runs; add one to --kinds or drop --channels")
    check_output_root("--trace", a.trace)
    if a.out is not None:  # a file in a folder made when missing, as --trace's is
        if os.path.isdir(a.out):
            raise ConfigError(f"--out {a.out} is a directory; give a file name")
        check_output_root("--out", a.out)
    ignored = _loop_flags_given(rest)
    if ignored:
        raise ConfigError(f"{ignored[0]} has no effect here: the benchmark times {a.warmup} + {a.steps} steps "
                          f"of the model and runs none of the trainer's loop (iterations, evaluation, "
                          f"logging, checkpoints, exits); drop it")
    for schedule in comma_names("--schedules", a.schedules, SCHEDULES):
        cfg = trainer_config(rest, a.tp, schedule, a.ep)
        try:  # rank 0 of a fake world of --tp x --ep ranks: the world the benchmark builds
            validate_config(cfg, a.tp * a.ep, cuda_wanted(cfg))
        except ConfigError as e:  # the benchmark passes the trainer's sizes from --tp and --ep
            raise ConfigError(str(e).replace("--tensor-model-parallel-size", "--tp")
                              .replace("--expert-model-parallel-size", "--ep")) from None


LOOP_GROUPS = ("validation", "logging", "checkpointing", "preemption")
"""The trainer's argument groups (first word of the title) of its loop, which the benchmark does
not run; with ``--train-iters`` they are refused after ``--``."""


def _loop_flags_given(rest: list[str]) -> list[str]:
    """The trainer flags in ``rest`` that belong to its loop (``LOOP_GROUPS``, ``--train-iters``)."""
    from megatron_oases.train_args import build_parser as trainer_parser

    loop = {"--train-iters"} | {o for g in trainer_parser()._action_groups if g.title.split(" ")[0] in LOOP_GROUPS
                                for act in g._group_actions for o in act.option_strings}
    return [tok.split("=", 1)[0] for tok in rest if tok.split("=", 1)[0] in loop]


def trainer_args(rest: list[str], tp: int, schedule: str, ep: int = 1) -> list[str]:
    """The trainer's flags of the run: ``rest`` at TP ``tp``, EP ``ep`` (DP = ``ep``) and
    ``schedule``, one micro-batch a step per rank and no TP-invariant initialisation unless the
    flags say otherwise (``scripts/sim_vs_standin.py`` simulates the same)."""
    from megatron_oases.train_args import build_parser as trainer_parser

    extra = ["--tensor-model-parallel-size", str(tp), "--schedule", schedule]
    if ep > 1:
        extra += ["--expert-model-parallel-size", str(ep)]
    if "--global-batch-size" not in rest:
        mbs = rest[rest.index("--micro-batch-size") + 1] if "--micro-batch-size" in rest else None
        extra += ["--global-batch-size", str(ep * int(mbs or trainer_parser().get_default("micro_batch_size")))]
    if "--tp-invariant-init" not in rest:
        extra.append("--no-tp-invariant-init")
    return rest + extra


def trainer_config(rest: list[str], tp: int, schedule: str, ep: int = 1):
    """The trainer's ``RunConfig`` of ``trainer_args`` (this bench's entry of the trainer's flags)."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser as trainer_parser

    return run_config(trainer_parser("bench_gpu_overlap.py").parse_args(trainer_args(rest, tp, schedule, ep)))


def _step(tr, batches, optimizer_step: bool, forward_only: bool = False) -> None:
    """One forward + backward over the step's micro-batches, as the trainer runs it (no host
    synchronisation inside: no ``.item()``, no loss reduction); ``forward_only``: its forward
    pass alone."""
    from megatron_oases.train import forward_backward

    forward_backward(tr, batches, forward_only)
    if optimizer_step and not forward_only:
        tr.optimizer.zero_grad()
        tr.optimizer.step()


def _timed(rt, fn, warmup: int, steps: int, before=None) -> list[float]:
    from benchmarks.standin.standins import time_ms

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        if before:
            before()
        out.append(time_ms(rt, fn))
    return out


def _summary(times: list[float]) -> dict:
    return {"ms": statistics.median(times), "steps_ms": [round(t, 3) for t in times]}


def pass_bound(compute_ms: float, compute_forward_ms: float, standins_ms: float,
               standins_forward_ms: float) -> float:
    """The shortest step with each pass's stand-ins overlapped by that pass's compute only:
    max(compute, stand-ins) of the forward plus that of the rest of the step (backward, with
    recompute and the optimizer when timed). Megatron's schedules start a micro-batch's backward
    only after its loss, and its next forward after that backward, so neither stock nor the Oases
    executor overlaps across that boundary; max(compute, stand-ins) of the whole step is reachable
    only when both passes are balanced."""
    return (max(compute_forward_ms, standins_forward_ms)
            + max(compute_ms - compute_forward_ms, standins_ms - standins_forward_ms))


class Bench:
    """One benchmark run: the calibration and the link, shared by every schedule."""

    def __init__(self, a: argparse.Namespace, rest: list[str]):
        from benchmarks.standin.moe import ExpertWorld, is_moe_run

        self.a, self.rest = a, rest
        self.kinds = [k for k in a.kinds.split(",") if k]
        self.link = None if a.link_gbps is None else _link(a.link_gbps, a.latency_us)
        self.cal = self.scratch = None
        self.world = ExpertWorld(a.tp, a.ep) if is_moe_run(rest) else None
        """An MoE model's TP x EP world (``moe``), None for a dense one."""
        self.moe = None

    def schedule(self, schedule: str) -> dict:
        """Build ``schedule``'s model, time it every way, tear it down."""
        from megatron.core import parallel_state as ps

        from megatron_oases import train as T

        tr = T.setup(trainer_config(self.rest, self.a.tp, schedule, self.a.ep))
        if len(tr.model) != 1:
            raise SystemExit("bench_gpu_overlap.py: one process is one pipeline stage; drop the "
                             "virtual pipeline flags")
        if self.world is not None:
            self.moe = self.world.prepare(tr)
        rt = tr.runtime
        try:
            return self._measure(tr)
        finally:
            tr = None
            ps.destroy_model_parallel()
            gc.collect()
            if rt.is_cuda:
                import torch

                torch.cuda.empty_cache()

    def _measure(self, tr) -> dict:
        from benchmarks.standin.standins import (CHANNELS, StandIns, calibrate, calibrate_nccl,
                                                           link_matching, nccl_channels)
        from megatron_oases.parallel.collectives import CommCounter

        a, rt = self.a, tr.runtime
        batches = tr.data.train_batches(1)

        def step():
            _step(tr, batches, a.optimizer_step)

        def forward():
            _step(tr, batches, a.optimizer_step, forward_only=True)

        with self._replaced():
            res = {"recompute": _recompute(tr.cfg), "compute": _summary(_timed(rt, step, a.warmup, a.steps)),
                   "compute_forward": _summary(_timed(rt, forward, min(a.warmup, 1), a.steps))}
        if self.world is not None:  # the layers' groups only: DP's gradient reduction is not priced
            calls, unpriced = self.world.calls(step)
            res["unpriced"] = {"collectives_per_step": len(unpriced), "payload_bytes": sum(b for *_, b in unpriced)}
        else:
            with CommCounter() as counted:
                step()
            calls = [(r.kind, r.group_size, r.payload_bytes) for r in counted.records if r.group_size > 1]
        res["collectives_per_step"] = len(calls)
        if self.cal is None:
            mib = a.scratch_mb if a.scratch_mb is not None else (1024 if rt.is_cuda else 4)
            channels = (a.channels or CHANNELS) if "channels" in self.kinds else None
            self.cal, *self.scratch = calibrate(rt, int(mib * 2**20), channels=channels)
        if self.link is None:
            self.link = link_matching(res["compute"]["ms"], calls, a.latency_us)
        if "nccl" in self.kinds and self.cal.nccl_blocks is None:
            self.cal = calibrate_nccl(rt, self.cal, *self.scratch, a.channels or nccl_channels(self.link.GBps))
        res["comm_disabled"] = self._comm_disabled(rt, step)
        for kind in self.kinds:
            stand = StandIns(rt, kind, self.link, self.cal, tuple(self.scratch), priced=self._priced)
            r = res[kind] = self._with_standins(rt, step, forward, stand, f"{tr.cfg.schedule}-{kind}")
            took = r["with_standins"]["ms"]
            r["max_compute_standins_ms"] = max(res["compute"]["ms"], r["standins_only"]["ms"])
            r["vs_max_compute_standin"] = took / r["max_compute_standins_ms"]
            r["pass_bound_ms"] = pass_bound(res["compute"]["ms"], res["compute_forward"]["ms"],
                                            r["standins_only"]["ms"], r["forward"]["standins_only"]["ms"])
            r["vs_pass_bound"] = took / r["pass_bound_ms"]
        res["peak_mem_mb"] = rt.max_memory_allocated() / 2**20
        return res

    def _comm_disabled(self, rt, step) -> dict:
        """Steps with every collective a stand-in of zero duration: communication switched off,
        the side-stream hand-offs kept."""
        from benchmarks.standin.standins import StandIns

        off = StandIns(rt, "sleep", self.link, self.cal, tuple(self.scratch), comm_disabled=True)
        with self._replaced(off):
            out = _summary(_timed(rt, step, self.a.warmup, self.a.steps, before=off.clear))
        return {**out, "standins_per_step": len(off.issued)}

    def _with_standins(self, rt, step, forward, stand, name: str) -> dict:
        """Steps with ``stand`` in place of the collectives, then its last step's stand-ins alone;
        the same for the ``forward`` pass alone (and, with ``--trace``, one more step recorded;
        ``name`` names its file)."""
        a = self.a
        with self._replaced(stand):
            with_ = _timed(rt, step, a.warmup, a.steps, before=stand.clear)
            issued = list(stand.issued)
            fwd_with = _timed(rt, forward, min(a.warmup, 1), a.steps, before=stand.clear)
            fwd_issued = list(stand.issued)
            trace = _traced(rt, step, a.trace, name) if a.trace else None
        alone = _timed(rt, lambda: stand.replay(issued), 1, a.steps)
        fwd_alone = _timed(rt, lambda: stand.replay(fwd_issued), 1, a.steps)
        out = {"with_standins": _summary(with_), "standins_only": _summary(alone),
               "priced_ms": sum(i.ms for i in issued), "standins_per_step": len(issued),
               "forward": {"with_standins": _summary(fwd_with), "standins_only": _summary(fwd_alone),
                           "standins": len(fwd_issued)},
               "issued": [[i.kind, i.group_size, i.payload_bytes, i.async_op] for i in issued]}
        if trace is not None:
            out["trace"] = trace
        return out

    @property
    def _priced(self):
        return None if self.world is None else self.world.priced

    def _replaced(self, stand=None):
        """The collectives of a measurement: ``stand`` in their place (None: the fake world's
        own); in an MoE world the routing metadata filled first (``moe.ExpertWorld``)."""
        import contextlib

        from megatron_oases.parallel.collectives import replace_watched_collectives

        if self.world is not None:
            return replace_watched_collectives(self.world.replacement(stand))
        return contextlib.nullcontext() if stand is None else replace_watched_collectives(stand)

    def run(self) -> dict:
        import torch

        from megatron_oases.mcore_compat import mcore_version

        out = {"note": NOTE, "tp": self.a.tp, "ep": self.a.ep, "label": self.a.label, "trainer_flags": self.rest, "kinds": self.kinds,
               "steps": self.a.steps, "warmup": self.a.warmup, "optimizer_step": self.a.optimizer_step,
               "torch": torch.__version__, "megatron_core": str(mcore_version()), "schedules": {}}
        for s in self.a.schedules.split(","):
            out["schedules"][s] = self.schedule(s)
        out["device"] = (torch.cuda.get_device_name() if torch.cuda.is_initialized() else "cpu")
        out["link"] = {"GBps": self.link.GBps, "latency_us": self.link.latency_us,
                       "chosen_by": "--link-gbps" if self.a.link_gbps is not None else "--match-compute"}
        out["calibration"] = {"sleep_cycles_per_ms": self.cal.sleep_cycles_per_ms,
                              "copy_GBps": self.cal.copy_GBps, "scratch_bytes": self.cal.scratch_bytes,
                              "channel_GBps": self.cal.channel_GBps, "channels": self.cal.channels,
                              "nccl_blocks": self.cal.nccl_blocks, "nccl_GBps": self.cal.nccl_GBps}
        out["cuda_device_max_connections"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        if self.moe is not None:
            out["moe"] = self.moe
        sch = out["schedules"]
        if "default" in sch and "oases" in sch:
            out["stock_over_oases"] = {k: sch["default"][k]["with_standins"]["ms"] / sch["oases"][k]["with_standins"]["ms"]
                                       for k in self.kinds}
        from benchmarks.standin.summary import records

        out["bounds"] = records(out)
        return out


def _traced(rt, step, trace_dir: str, name: str) -> dict:
    """One ``step`` under ``torch.profiler``: its Chrome trace in ``trace_dir`` (torch gzips a
    ``.gz`` path itself) and the compute stream's idle time in it (``trace_gaps.summarize``)."""
    import torch

    from benchmarks.standin.trace_gaps import load_trace, summarize

    activities = [torch.profiler.ProfilerActivity.CPU]
    if rt.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    rt.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        step()
        rt.synchronize()
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"{name}.json.gz")
    prof.export_chrome_trace(path)
    return {"file": os.path.basename(path), **summarize(load_trace(path))}


def _link(gbps: float, latency_us: float):
    from benchmarks.standin.standins import Link

    return Link(GBps=gbps, latency_us=latency_us)


def _recompute(cfg) -> str:
    if cfg.recompute_granularity is None:
        return "none"
    fine = cfg.schedule == "oases" and cfg.oases_fine_grained_recompute
    return f"{cfg.recompute_granularity} {cfg.recompute_method}" + (" (Oases fine-grained)" if fine else "")


def print_report(out: dict) -> None:
    from benchmarks.harness import print_table

    rows = []
    for s, r in out["schedules"].items():
        rows.append({"schedule": s, "stand-in": "none", "recompute": r["recompute"], "step ms": r["compute"]["ms"],
                     "forward ms": r["compute_forward"]["ms"], "collectives": r["collectives_per_step"]})
        rows.append({"schedule": s, "stand-in": "comm-disabled", "recompute": r["recompute"],
                     "step ms": r["comm_disabled"]["ms"], "collectives": r["comm_disabled"]["standins_per_step"]})
        for k in out["kinds"]:
            rk = r[k]
            rows.append({"schedule": s, "stand-in": k, "recompute": r["recompute"],
                         "step ms": rk["with_standins"]["ms"], "stand-ins only ms": rk["standins_only"]["ms"],
                         "forward ms": rk["forward"]["with_standins"]["ms"],
                         "forward stand-ins ms": rk["forward"]["standins_only"]["ms"],
                         "priced ms": rk["priced_ms"], "collectives": rk["standins_per_step"],
                         "/ max(compute, stand-ins)": rk["vs_max_compute_standin"],
                         "pass bound ms": rk["pass_bound_ms"], "/ pass bound": rk["vs_pass_bound"]})
    link = out["link"]
    ep = f" x EP {out['ep']} (MoE: {out['moe']['routing']}; DP's gradient reduction not priced)" if out.get(
        "moe") else ""
    print(f"device {out['device']}, TP {out['tp']}{ep} (rank 0 of a fake world), link {link['GBps']:.4g} GB/s "
          f"+ {link['latency_us']} us ({link['chosen_by']}); median of {out['steps']} steps after "
          f"{out['warmup']} warm-up; {NOTE}")
    print_table(rows, ["schedule", "stand-in", "recompute", "step ms", "stand-ins only ms", "priced ms",
                       "/ max(compute, stand-ins)", "forward ms", "forward stand-ins ms", "pass bound ms",
                       "/ pass bound", "collectives"])
    print("pass bound: max(compute, stand-ins) of the forward pass plus that of the backward "
          "(no schedule here overlaps across that boundary)")
    for k, v in out.get("stock_over_oases", {}).items():
        print(f"stock / Oases with {k} stand-ins: {v:.3f}x")
    _print_bounds(out)
    from benchmarks.standin.trace_gaps import format_summary

    for s, r in out["schedules"].items():
        for k in out["kinds"]:
            if "trace" in r[k]:
                print(format_summary(f"trace {s} {k}", r[k]["trace"]))


def _print_bounds(out: dict) -> None:
    """The bound table (``summary.records``), and a warning where the nccl stand-in's blocks
    cannot move the link's bytes in time."""
    from benchmarks.harness import print_table
    from benchmarks.standin.summary import TABLE_COLUMNS, table_rows

    if out.get("bounds"):
        print("comm-disabled: stock's step with every collective a stand-in of zero duration; "
              "max(compute, comm): max(Oases comm-disabled, Oases stand-ins only)")
        print_table(table_rows(out["bounds"]), list(TABLE_COLUMNS))
    cal = out["calibration"]
    if cal.get("nccl_GBps") and cal["nccl_GBps"] < out["link"]["GBps"]:
        print(f"warning: the nccl stand-in's {cal['nccl_blocks']} blocks move at most {cal['nccl_GBps']:.4g} GB/s, "
              f"less than the link's {out['link']['GBps']:.4g}: its stand-ins run longer than priced")


def main(argv: list[str] | None = None) -> int:
    # before Megatron is imported: it binds some collectives at import time
    from megatron_oases.parallel.collectives import watch_torch_distributed

    watch_torch_distributed()
    parser = build_parser()
    a, rest = parser.parse_known_args(argv)
    try:
        validate_args(a, rest)
    except ConfigError as e:
        parser.error(str(e))
    from benchmarks.standin.fake_world import init_fake_world
    from megatron_oases.runtime.quiet import quiet_known_warnings

    import torch

    quiet_known_warnings(cpu=not torch.cuda.is_available())
    init_fake_world(a.tp * a.ep)
    out = Bench(a, rest).run()
    print_report(out)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
