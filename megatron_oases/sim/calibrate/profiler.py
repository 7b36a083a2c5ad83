"""Measure the simulator's events on this machine into a ``ProfileDB`` (DistSim §4.2).

* **Compute** events run their torch ops (``sim.calibrate.workloads``) on the local device: CUDA events
  on GPU, wall clock on CPU; ``warmup`` runs first, then the median of ``reps``.
* **Collectives** run on the ranks at hand (``nproc`` gloo/NCCL ranks from
  ``runtime.spawn.run_on_ranks``), taken to be ranks ``0..nproc-1`` of ``topology``. An event's
  group class (size n, link levels crossed) is measured on a group of the ranks at hand crossing
  the same levels; if fewer than n ranks can form one, the largest such group (m ranks) is timed
  and scaled by the ring formula, 2(n-1)/n over 2(m-1)/m for all-reduce, (n-1)/n over (m-1)/m for
  all-gather / reduce-scatter. The time is the slowest rank's median.
* **P2P** events time ``send`` on one rank and ``recv`` on the other and keep the smaller
  (the later caller's time is the transfer; the earlier one also queued).
* Payloads above ``max_comm_bytes`` are timed at that size and scaled linearly.

Every entry's provenance goes into ``ProfileDB.sources``.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from typing import Any, Iterable

from ...topology import Topology
from ...pricing.device_model import ProfileDB, SimError
from ...pricing.event import Event, group_tag
from ...describe.ops import is_loop_event, ring_factor
from ...describe.shapes import GPTShape
from ..core.events import build_stage_events, unique_events
from ..core.strategy import Strategy


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    """How events are measured."""

    nproc: int = 2
    """Ranks at hand for collectives and P2P (ranks 0..nproc-1 of the topology)."""
    device: str | None = None
    """cuda | cpu; default: cuda when available."""
    warmup: int = 2
    reps: int = 5
    threads: int | None = None
    """torch threads for compute events (default: torch's)."""
    max_comm_bytes: int = 256 << 20
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.warmup < 0 or self.reps < 1 or self.max_comm_bytes < 4:
            raise SimError(f"profile settings need nproc >= 1, warmup >= 0, reps >= 1 (got {self})")


@dataclasses.dataclass(frozen=True)
class CommJob:
    """One measurement on the ranks at hand: a collective over ``ranks``, or p2p ranks[0] -> ranks[1]."""

    kind: str
    ranks: tuple[int, ...]
    nbytes: int


def _torch_device(device: str | None):
    import torch

    want = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda" and not torch.cuda.is_available():
        raise SimError("--device cuda was asked for but torch.cuda.is_available() is False")
    if want != "cuda":
        return torch.device("cpu")
    from ...runtime.device import local_cuda_index

    # the GPU ``init_runtime`` makes current when a Megatron layer workload is built (LOCAL_RANK,
    # SLURM_LOCALID): a fixed cuda:0 put the layer's inputs on another GPU than its buffers
    return torch.device("cuda", local_cuda_index(os.environ, torch.cuda.device_count())[0])


def time_ms(fn, *, warmup: int, reps: int, device) -> float:
    """Median milliseconds of ``fn()``: CUDA events on GPU, wall clock on CPU."""
    return time_ms_and_host(fn, warmup=warmup, reps=reps, device=device)[0]


def time_ms_and_host(fn, *, warmup: int, reps: int, device) -> tuple[float, float]:
    """Median milliseconds of ``fn()`` (CUDA events on GPU, wall clock on CPU) and of the host's
    part of it: until ``fn`` returned, before waiting for the GPU (on CPU the same time). A GPU
    event whose two are close is host-bound."""
    import torch

    for _ in range(warmup):
        fn()
    times, host = [], []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        stream = torch.cuda.current_stream(device)  # the device's, whichever GPU is current
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record(stream)
            fn()
            b.record(stream)
            host.append((time.perf_counter() - t0) * 1e3)
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        host = times
    return statistics.median(times), statistics.median(host)


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.machine()}"


def profile_compute(events: Iterable[Event], settings: ProfileSettings,
                    host_ms: dict[str, float] | None = None) -> dict[str, float]:
    """Time each compute event's workload on the local device; ``host_ms``, when given, receives
    the host's part of each (``time_ms_and_host``)."""
    import torch

    from .layer_workloads import single_rank_world
    from .workloads import compute_workload

    dev = _torch_device(settings.device)
    old = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        out = {}
        with single_rank_world(str(dev)):  # Megatron layer workloads need a process group
            for ev in events:
                fn = compute_workload(ev.name, dict(ev.dims), dev)
                out[ev.key], host = time_ms_and_host(fn, warmup=settings.warmup, reps=settings.reps, device=dev)
                if host_ms is not None:
                    host_ms[ev.key] = host
                del fn
        return out
    finally:
        torch.set_num_threads(old)


# ---- communication -----------------------------------------------------------------------------
def _levels(tag: str) -> str:
    return tag.split(":", 1)[1]


def plan_comm(events: Iterable[Event], topo: Topology, nproc: int, max_bytes: int
              ) -> tuple[list[CommJob], dict[str, tuple[int, float, str]]]:
    """Jobs to run on ranks 0..nproc-1 and, per event key, (job index, scale, provenance)."""
    if nproc > topo.world_size:
        raise SimError(f"{nproc} ranks at hand exceed the {topo.world_size} ranks of topology {topo.name!r}")
    jobs: list[CommJob] = []
    index: dict[CommJob, int] = {}
    plan: dict[str, tuple[int, float, str]] = {}
    unmeasurable: dict[str, list[str]] = {}
    groups: dict[str, list[tuple[int, ...]]] = {}  # levels -> candidate groups, largest first
    for d in range(1, max(nproc, 2)):
        for m in range(2, (nproc - 1) // d + 2):
            g = tuple(range(0, m * d, d))
            groups.setdefault(_levels(group_tag(topo, g)), []).append(g)
    for lv in groups:
        groups[lv].sort(key=lambda g: (-len(g), g[1]))
    for ev in events:
        want = _levels(group_tag(topo, ev.ranks))
        n = len(ev.ranks)
        kind = "p2p" if ev.kind == "p2p" else ev.op.kind
        cands = [g for g in groups.get(want, []) if (len(g) == 2 if kind == "p2p" else len(g) <= n)]
        if not cands:
            unmeasurable.setdefault(want, []).append(ev.key)
            continue
        g = cands[0]
        nbytes = int(ev.nbytes)
        scale, why = 1.0, []
        if nbytes > max_bytes:
            scale, why = nbytes / max_bytes, [f"scaled from {max_bytes} bytes"]
            nbytes = max_bytes
        if kind != "p2p" and len(g) < n:
            scale *= ring_factor(kind, n) / ring_factor(kind, len(g))
            why.append(f"extrapolated from {len(g)} ranks")
        job = CommJob(kind, g, max(nbytes, 4))
        if job not in index:
            index[job] = len(jobs)
            jobs.append(job)
        plan[ev.key] = (index[job], scale, "; ".join(why) or "measured")
    if unmeasurable:
        lv, keys = next(iter(unmeasurable.items()))
        n_all = sum(len(v) for v in unmeasurable.values())
        raise SimError(f"the {nproc} rank(s) at hand (ranks 0-{nproc - 1} of topology {topo.name!r}) form no group "
                       f"crossing {' and '.join(sorted(unmeasurable))}, needed by {n_all} event(s): "
                       f"{', '.join(keys[:3])}{' ...' if n_all > 3 else ''}; profile on ranks spanning those links")
    return jobs, plan


def comm_rank_main(jobs: list[CommJob], warmup: int, reps: int, device: str | None) -> list[Any]:
    """On every rank: run each job (others wait at a barrier); per job this rank's median ms, or None."""
    import torch
    import torch.distributed as dist

    from ...runtime import init_distributed, init_runtime

    rt = init_runtime(device)
    init_distributed(rt)
    me = dist.get_rank()
    groups = {}
    for job in jobs:  # every rank creates every group, in the same order
        if job.ranks not in groups:
            groups[job.ranks] = dist.new_group(list(job.ranks))
    out: list[Any] = []
    for job in jobs:
        dist.barrier()
        if me not in job.ranks:
            out.append(None)
            continue
        grp, n = groups[job.ranks], len(job.ranks)
        numel = max(1, job.nbytes // 4)
        if job.kind == "all_gather":
            numel = max(1, numel // n)
        x = torch.ones(numel, dtype=torch.float32, device=rt.device)
        big = torch.empty(numel * n, dtype=torch.float32, device=rt.device)
        if job.kind == "all_reduce":
            op = lambda: dist.all_reduce(x, group=grp)  # noqa: E731
        elif job.kind == "all_gather":
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            op = lambda: gather(big, x, group=grp)  # noqa: E731
        elif job.kind == "reduce_scatter":
            y = torch.empty(max(1, numel // n), dtype=torch.float32, device=rt.device)
            x = torch.ones(y.numel() * n, dtype=torch.float32, device=rt.device)
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            op = lambda: scatter(y, x, group=grp)  # noqa: E731
        elif me == job.ranks[0]:
            op = lambda: dist.send(x, job.ranks[1], group=grp)  # noqa: E731
        else:
            op = lambda: dist.recv(x, job.ranks[0], group=grp)  # noqa: E731
        times = []
        for i in range(warmup + reps):
            dist.barrier(group=grp)
            rt.synchronize()
            t0 = time.perf_counter()
            op()
            rt.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        out.append(statistics.median(times))
    dist.barrier()
    return out


def profile_comm(events: Iterable[Event], topo: Topology, settings: ProfileSettings
                 ) -> tuple[dict[str, float], dict[str, str]]:
    from ...runtime.spawn import run_on_ranks

    jobs, plan = plan_comm(events, topo, settings.nproc, settings.max_comm_bytes)
    if not jobs:
        return {}, {}
    if _torch_device(settings.device).type == "cuda":  # one GPU per rank, before any rank starts
        import torch

        from ...runtime.device import local_ranks_refusal

        refusal = local_ranks_refusal(settings.nproc, torch.cuda.device_count())
        if refusal:
            raise SimError(f"--nproc {settings.nproc}: the collectives' {refusal}; lower --nproc "
                           f"or time them with --device cpu")
    per_rank = run_on_ranks(comm_rank_main, settings.nproc, args=(jobs, settings.warmup, settings.reps,
                                                                  settings.device), timeout_s=settings.timeout_s)
    measured = []
    for j, job in enumerate(jobs):
        vals = [r[j] for r in per_rank if r[j] is not None]
        measured.append(min(vals) if job.kind == "p2p" else max(vals))
    times = {k: measured[j] * scale for k, (j, scale, _) in plan.items()}
    return times, {k: why for k, (_, _, why) in plan.items()}


def profile_events(events: dict[str, Event], topo: Topology, settings: ProfileSettings) -> ProfileDB:
    """Measure ``events`` (key -> Event, as ``unique_events`` returns) into a ProfileDB."""
    import torch

    # loop events are not workloads: a trainer-flags profile measures them (loop_overhead)
    comp = [e for e in events.values() if e.kind == "compute" and not is_loop_event(e.name)]
    comm = [e for e in events.values() if e.kind != "compute"]
    if comm and settings.nproc < 2:
        raise SimError(f"{len(comm)} communication event(s) need at least 2 ranks at hand (nproc={settings.nproc})")
    comm_ms, sources = profile_comm(comm, topo, settings) if comm else ({}, {})  # plan errors come first
    host_ms: dict[str, float] = {}
    comp_ms = profile_compute(comp, settings, host_ms)
    dev = _torch_device(settings.device)
    meta = {"torch": torch.__version__, "topology": topo.name, "nproc": settings.nproc,
            "warmup": settings.warmup, "reps": settings.reps,
            "threads": settings.threads or torch.get_num_threads(), "host_cpus": os.cpu_count(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if dev.type == "cuda":  # recorded, not priced yet: which events are host-bound on this GPU
        meta["host_issue_ms"] = {k: round(v, 4) for k, v in host_ms.items()}
    return ProfileDB(device=device_name(dev), events_ms={**comp_ms, **comm_ms},
                     sources={**{k: "measured" for k in comp_ms}, **sources}, meta=meta)


def needed_events(model: GPTShape, strategies: Iterable[Strategy], topo: Topology) -> dict[str, Event]:
    """The union of the unique events of several strategies (what a search needs measured)."""
    out: dict[str, Event] = {}
    for s in strategies:
        for k, e in unique_events(build_stage_events(model, s, topo)).items():
            out.setdefault(k, e)
    return out


def profile_missing(events: dict[str, Event], topo: Topology, settings: ProfileSettings,
                    existing: ProfileDB | None = None) -> ProfileDB:
    """Measure the events ``existing`` lacks and merge them into it (``profile --merge``)."""
    if existing is not None:
        events = {k: e for k, e in events.items() if k not in existing.events_ms}
    db = profile_events(events, topo, settings)
    return existing.merged(db) if existing is not None else db


def local_topology(nproc: int, name: str = "local") -> Topology:
    """The ranks of this machine as one flat level (what ``megatron-oases profile`` assumes by default).

    Its numbers only matter for analytical fallbacks; measured events are keyed by its level name.
    """
    from ...topology import Level

    return Topology(name=name, device=None, levels=(Level(name=name, size=nproc, scope="intra_node",
                                                          p2p_bandwidth_GBps=10.0, group_bandwidth_GBps=10.0,
                                                          latency_us=10.0),))


def resolve_topology(name: str | None, world: int):
    """A shipped example / YAML path, or ``local`` (what ``profile`` measures by default): one flat
    level of ``world`` ranks."""
    if name in (None, "local"):
        return local_topology(world)
    from ...topology import load_topology

    return load_topology(name)
