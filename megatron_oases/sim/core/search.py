"""Strategy search: simulate every TP x PP x DP split (x TP backend / ATP mesh, Oases on/off,
recompute off / full / selective, virtual stages, and EP for an MoE model) of a fixed global batch on N GPUs and rank them (DistSim §6,
Fig. 12 / Table 2). Infeasible strategies stay in the table with the reason: divisibility (the
same one-line ``SimError`` a single simulation gives), memory, or missing profile events.
Per-block plans are a step after the ranking, in the front end (``sim.frontends.search_plans``):
the core does not import the planner.
"""
from __future__ import annotations

import concurrent.futures
import csv
import dataclasses
import io
import multiprocessing
import os
from typing import Iterable, Sequence

from ...pricing.device_model import DeviceModel, SimError
from ...describe.backends import backend as record
from ...describe.shapes import GPTShape
from ...describe.split import oases_splits
from .strategy import Strategy, check, selective_recompute_applies
from .timeline import SimResult, simulate


RECOMPUTE_MODES = ("off", "full", "selective")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What to enumerate; None means the default for that axis."""

    gpus: int
    global_batch: int
    tp_sizes: Sequence[int] | None = None
    """Default: powers of two dividing ``gpus``, at most the number of heads."""
    pp_sizes: Sequence[int] | None = None
    """Default: powers of two dividing ``gpus / tp``, at most the number of layers."""
    backends: Sequence[str] = ("megatron", "atp")
    schedules: Sequence[str] = ("default", "oases")
    """TP executors to try (the trainer's ``--schedule`` values)."""
    recompute: Sequence[str] = ("off", "full")
    """Recompute modes to try (``RECOMPUTE_MODES``): none, Megatron's full (every layer; Oases' own
    under the Oases schedule), selective (the core attention; Megatron 1-D, stock schedule)."""
    virtual_stages: Sequence[int] = (1,)
    sequence_parallel: Sequence[bool] = (False, True)
    """Sequence parallelism off / on; on is tried at TP > 1 for the backends whose record runs it
    (``describe.backends``: Megatron 1-D)."""
    tp_comm_overlap: bool = False
    """``--tp-comm-overlap`` on every candidate it applies to (SP, stock schedule)."""
    pipeline_schedule: str = "1f1b"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: int = 0
    """The DP overlap flags, as ``Strategy``'s, for every candidate."""
    ep_sizes: Sequence[int] | None = None
    """Expert-parallel sizes to try with an MoE model (``--expert-model-parallel-size``); default:
    the powers of two dividing both the experts and DP (Megatron's rule with the experts' TP equal
    to TP: EP divides DP, ``describe.moe.moe_refusal``). A dense model tries EP 1 only."""

    def __post_init__(self) -> None:
        bad = [r for r in self.recompute if r not in RECOMPUTE_MODES]
        if bad:
            raise SimError(f"recompute modes are {', '.join(RECOMPUTE_MODES)} (got {bad[0]!r})")
        if self.gpus < 1 or self.global_batch < 1:
            raise SimError(f"search needs gpus >= 1 and a global batch >= 1 (got {self.gpus}, {self.global_batch})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    tp: int
    pp: int
    dp: int
    vp: int
    backend: str
    schedule: str
    recompute: str
    """A ``RECOMPUTE_MODES`` value."""
    sequence_parallel: bool = False
    ep: int = 1
    num_microbatches: int | None
    strategy: Strategy | None
    result: SimResult | None = None
    reason: str = ""
    """Empty when feasible; else why not (divisibility, memory, profile)."""

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def label(self) -> str:
        if self.strategy is not None:
            return self.strategy.label
        return f"tp{self.tp}.pp{self.pp}.dp{self.dp}"

    def row(self) -> dict[str, object]:
        r = self.result
        return {"strategy": self.label, "tp": self.tp, "pp": self.pp, "dp": self.dp, "vp": self.vp,
                "backend": self.backend, "schedule": self.schedule, "recompute": self.recompute,
                "sequence_parallel": int(self.sequence_parallel),
                "micro_batches": self.num_microbatches if self.num_microbatches is not None else "",
                "iteration_ms": f"{r.iteration_ms:.3f}" if r else "",
                "tokens_per_s": f"{r.tokens_per_s:.1f}" if r else "",
                "mfu": f"{r.mfu:.4f}" if r else "",
                "memory_GB": f"{r.peak_memory_GB:.2f}" if r else "",
                "feasible": int(self.feasible), "reason": self.reason}


def _pow2_divisors(n: int, cap: int) -> list[int]:
    out, d = [], 1
    while d <= min(n, cap):
        if n % d == 0:
            out.append(d)
        d *= 2
    return out


def candidates(model: GPTShape, space: SearchSpace) -> list[Candidate]:
    """Every point of the space, with Strategy built (or the reason it cannot be)."""
    out: list[Candidate] = []
    tps = space.tp_sizes or _pow2_divisors(space.gpus, model.num_attention_heads)
    for tp in tps:
        pps = space.pp_sizes or _pow2_divisors(space.gpus // tp if space.gpus % tp == 0 else 1, model.num_layers)
        for pp in pps:
            base = dict(tp=tp, pp=pp, vp=1, backend="megatron", schedule="default", recompute="off")
            if space.gpus % (tp * pp):
                out.append(Candidate(dp=0, num_microbatches=None, strategy=None,
                                     reason=f"TP {tp} x PP {pp} does not divide {space.gpus} GPUs", **base))
                continue
            dp = space.gpus // (tp * pp)
            per = model.micro_batch_size * dp
            if space.global_batch % per:
                out.append(Candidate(dp=dp, num_microbatches=None, strategy=None, reason=(
                    f"global batch {space.global_batch} is not divisible by micro-batch {model.micro_batch_size} "
                    f"x DP {dp}"),
                    **base))
                continue
            m = space.global_batch // per
            try:  # the split itself (layers / heads / hidden vs TP and PP): one row, not one per variant
                check(model, Strategy(tp=tp, pp=pp, dp=dp, num_microbatches=m,  # MoE at TP > 1 needs SP
                                      sequence_parallel=model.moe is not None and tp > 1), space.gpus)
            except SimError as e:
                out.append(Candidate(dp=dp, num_microbatches=m, strategy=None, reason=str(e), **base))
                continue
            for backend in space.backends:
                if model.moe is not None and not record(backend).megatron_modules:
                    continue  # Megatron-Core's MoE layer runs on Megatron's own modules only
                for layout in record(backend).layouts(tp):  # ATP's meshes; the cube at TP = p^3 only
                    for schedule in space.schedules:
                        if schedule == "oases" and not record(backend).oases_tape:
                            continue  # the runtime has no Oases tape for the cube
                        for rc in space.recompute:
                            if rc == "selective" and not selective_recompute_applies(backend, schedule):
                                continue
                            for sp in _sequence_parallel(space, tp, backend, moe=model.moe is not None):
                                for vp in space.virtual_stages:
                                    if vp > 1 and pp == 1:
                                        continue
                                    for ep in _ep_sizes(model, space, dp):
                                        if schedule == "oases" and "default" in space.schedules and \
                                                not oases_splits(tp, expert_parallel=ep):
                                            continue  # stock layers (describe.split): the default row
                                        out.append(_candidate(space, tp=tp, pp=pp, dp=dp, vp=vp, backend=backend,
                                                              layout=layout, schedule=schedule, recompute=rc,
                                                              sequence_parallel=sp, num_microbatches=m, ep=ep))
    return out


def _sequence_parallel(space: SearchSpace, tp: int, backend: str, *, moe: bool = False) -> tuple[bool, ...]:
    """The SP settings a candidate takes: on only where it runs (TP > 1, a backend that has it);
    an MoE model at TP > 1 needs it on (Megatron-Core's rule)."""
    runs = tp > 1 and record(backend).sequence_parallel
    return tuple(sp for sp in dict.fromkeys(space.sequence_parallel) if (runs or not sp) and (sp or not (moe and runs)))


def _ep_sizes(model: GPTShape, space: SearchSpace, dp: int) -> list[int]:
    """The expert-parallel sizes a candidate takes (``SearchSpace.ep_sizes``)."""
    if model.moe is None:
        return [1]
    if space.ep_sizes:
        return list(space.ep_sizes)
    return [e for e in _pow2_divisors(dp, dp) if model.moe.num_experts % e == 0]


def _candidate(space: SearchSpace, *, layout, **info) -> Candidate:
    """One point of the space: its ``Strategy``, or the reason it cannot be built."""
    try:
        st = Strategy(tp=info["tp"], pp=info["pp"], dp=info["dp"], num_microbatches=info["num_microbatches"],
                      pipeline_schedule=space.pipeline_schedule, virtual_stages=info["vp"], recompute=info["recompute"] == "full",
                      selective_recompute=info["recompute"] == "selective", schedule=info["schedule"],
                      backend=info["backend"], layout=layout, sequence_parallel=info["sequence_parallel"],
                      tp_comm_overlap=(space.tp_comm_overlap and info["sequence_parallel"]
                                       and info["schedule"] == "default"),
                      distributed_optimizer=space.distributed_optimizer,
                      overlap_grad_reduce=space.overlap_grad_reduce,
                      overlap_param_gather=space.overlap_param_gather, ddp_bucket_size=space.ddp_bucket_size,
                      ep=info["ep"])
    except SimError as e:
        return Candidate(strategy=None, reason=str(e), **info)
    return Candidate(strategy=st, **info)


_WORK: tuple | None = None
"""(model, device, memory limit) of the search in progress: forked workers inherit it."""


def _simulate_one(strategy: Strategy) -> tuple[SimResult | None, str]:
    """One candidate's result without its per-chunk templates (a ranking needs the totals; the
    templates are 80% of a 128-stage result's bytes, which the workers send back)."""
    model, device, limit = _WORK
    try:
        r = simulate(model, strategy, device, memory_limit_GB=limit, timeline=False)
    except SimError as e:
        return None, str(e)
    return dataclasses.replace(r, templates=()), ""


def _simulate_all(strategies: list[Strategy], model: GPTShape, device: DeviceModel, limit: float | None,
                  jobs: int | None) -> list[tuple[SimResult | None, str]]:
    """``(result, error)`` per strategy, in order. Each simulation is pure Python on one core, and
    a 3,072-GPU space has hundreds with up to PP x micro-batches = 65k pipeline ops each, so
    ``jobs`` processes (default: the CPU count; forked, where the platform forks) share them."""
    global _WORK
    jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    fork = "fork" in multiprocessing.get_all_start_methods()
    _WORK = (model, device, limit)
    try:
        if jobs <= 1 or len(strategies) < 16 or not fork:
            return [_simulate_one(st) for st in strategies]
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            return list(pool.map(_simulate_one, strategies, chunksize=max(1, len(strategies) // (8 * jobs))))
    finally:
        _WORK = None


def search(model: GPTShape, space: SearchSpace, device: DeviceModel, *,
           memory_limit_GB: float | None = None, jobs: int | None = None) -> list[Candidate]:
    """Simulate every candidate (in ``jobs`` processes, default the CPU count); feasible ones
    first by iteration time, then memory-infeasible ones (they have a time), then the rest."""
    if device.topology.world_size != space.gpus:
        raise SimError(f"--gpus {space.gpus} but topology {device.topology.name!r} describes "
                       f"{device.topology.world_size} GPUs")
    cands = candidates(model, space)
    outcomes = iter(_simulate_all([c.strategy for c in cands if c.strategy is not None], model, device,
                                  memory_limit_GB, jobs))
    done: list[Candidate] = []
    for c in cands:
        if c.strategy is None:
            done.append(c)
            continue
        r, error = next(outcomes)
        done.append(dataclasses.replace(c, reason=error) if r is None
                    else dataclasses.replace(c, result=r, reason=r.infeasible_reason))

    def order(c: Candidate):
        if c.feasible:
            return (0, c.result.iteration_ms)
        if c.result is not None:
            return (1, c.result.iteration_ms)
        return (2, 0.0)
    return sorted(done, key=order)


COLUMNS = ("strategy", "tp", "pp", "dp", "vp", "backend", "schedule", "recompute", "sequence_parallel",
           "micro_batches",
           "iteration_ms", "tokens_per_s", "mfu", "memory_GB", "feasible", "reason")


def write_csv(cands: Iterable[Candidate], path: str | os.PathLike | None = None) -> str:
    """CSV of every candidate (the ranked order); returns the text, writes it when ``path`` is given."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for c in cands:
        w.writerow(c.row())
    if path is not None:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(buf.getvalue())
    return buf.getvalue()


def search_table(cands: Sequence[Candidate], top: int | None = None, *, show_refused: bool = True) -> str:
    """Ranked plain-text table; infeasible rows show their reason instead of numbers (with
    ``show_refused``; else they are counted by reason in one line)."""
    n_ok = sum(c.feasible for c in cands)
    best = next((c for c in cands if c.feasible), None)
    lines = [f"{len(cands)} strategies, {n_ok} feasible"
             + (f"; best {best.label}: {best.result.iteration_ms:.2f} ms" if best else "")]
    lines.append(f"{'#':>4} {'strategy':<34} {'m':>4} {'iter ms':>10} {'x best':>7} {'tokens/s':>12} "
                 f"{'MFU':>6} {'mem GB':>7}  status")
    refused = [c for c in cands if not c.feasible] if show_refused else []
    shown = cands if top is None and show_refused else [*[c for c in cands if c.feasible][:top], *refused]
    for i, c in enumerate(shown, 1):
        r = c.result
        m = c.num_microbatches if c.num_microbatches is not None else "-"
        if r is None:
            lines.append(f"{i:>4} {c.label:<34} {m:>4} {'-':>10} {'-':>7} {'-':>12} {'-':>6} {'-':>7}  {c.reason}")
            continue
        slow = f"{r.iteration_ms / best.result.iteration_ms:.2f}" if best else "-"
        status = "ok" if c.feasible else c.reason
        lines.append(f"{i:>4} {c.label:<34} {m:>4} {r.iteration_ms:>10.2f} {slow:>7} {r.tokens_per_s:>12,.0f} "
                     f"{100 * r.mfu:>5.1f}% {r.peak_memory_GB:>7.1f}  {status}")
    if top is not None and n_ok > top:
        lines.append(f"     ({n_ok - top} more feasible strategies in the CSV)")
    if not show_refused and n_ok < len(cands):
        lines.append(f"     {refused_summary(cands)}")
    return "\n".join(lines)


def refused_summary(cands: Sequence[Candidate]) -> str:
    """One line counting the infeasible strategies by kind of reason (their first word)."""
    kinds: dict[str, int] = {}
    for c in cands:
        if not c.feasible:
            kind = "memory" if c.reason.startswith("memory") else "split" if c.result is None else "other"
            kinds[kind] = kinds.get(kind, 0) + 1
    named = {"memory": "over the memory limit", "split": "not a valid split", "other": "refused"}
    parts = ", ".join(f"{n} {named[k]}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return f"({sum(kinds.values())} strategies refused: {parts}; --show-refused lists them)"
