"""Profile a trainer run's events on the emulated interconnect, under the run's own CPU contention.

``megatron-oases profile --emulate -- <train flags>`` (or :func:`profile_emulated`) launches one
profiling process per rank of the run inside an ``EmulatedCluster`` of the run's topology, with
the thread settings the trainer's ranks get there (``OMP_NUM_THREADS = cpus // ranks``), so

* **collectives and P2P** cross the same rate-limited links, with every group that runs the same
  collective at the same time in the trainer running it concurrently (the event's group shifted
  along the TP and DP axes on which it is constant: the TP groups of all DP replicas of a stage,
  the DP groups of all TP ranks, each (tp, dp) pair's P2P / tied-embedding pair) -- they share
  links (a node's ``lo``, its NIC) as in the run. Time: per repetition the slowest rank, then
  the median (:func:`lockstep_ms`); for P2P that is the receiver's (gloo's ``send`` returns once
  the bytes are in the socket buffer).
* **compute** events are timed with ``k`` ranks running the same event at once, for every ``k`` in
  :func:`busy_levels` (the ranks of 1, 2, ..., PP stages: the numbers of ranks that compute at
  once in the trainer). When ranks outnumber cores they time-share them; the time is per
  repetition the slowest busy rank, then the median (TP peers and DP replicas proceed in
  lockstep). The events run in turn within each repetition (:func:`interleaved_ms`), so a burst of
  outside load spreads over all of them instead of skewing one. ``events_ms`` holds the
  all-ranks-busy time; ``ProfileDB.contention[key] = {k: ms}`` holds every level, which the
  simulator uses for pipelines whose stages are not always busy together (``sim.core.contention``).

The profiling ranks are started with ``python -m megatron_oases.sim.calibrate.emulated_profile PLAN OUTDIR``;
each writes ``OUTDIR/rank<r>.json``.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from ...topology import Topology
from ...pricing.device_model import ProfileDB, SimError
from ...pricing.event import Event
from ..core.strategy import Strategy


# ---- planning (pure) --------------------------------------------------------------------------
def coords(rank: int, s: Strategy) -> tuple[int, int, int]:
    """(tp, dp, pp) of a rank in Megatron's order (TP fastest, then DP, then PP)."""
    return rank % s.tp, (rank // s.tp) % s.dp, rank // (s.tp * s.dp)


def sibling_groups(ranks: tuple[int, ...], s: Strategy) -> tuple[tuple[int, ...], ...]:
    """The groups that run the same collective as ``ranks`` at the same time in the trainer: the
    group shifted along the TP and DP axes on which its ranks agree, and for a group inside the TP
    group (the 3-D cube's lines, the ATP mesh's rows or columns) the other lines of its partition
    (never along PP: other stages run other events). ``ranks`` itself comes first."""
    cs = [coords(r, s) for r in ranks]
    tp_const = len({c[0] for c in cs}) == 1
    dp_const = len({c[1] for c in cs}) == 1
    out, used = [tuple(ranks)], set(ranks)
    for dt in range(s.tp):
        for dd in range(s.dp if dp_const else 1):
            if dt == dd == 0:
                continue
            if tp_const:
                g = tuple(s.rank(tp=(c[0] + dt) % s.tp, dp=(c[1] + dd) % s.dp, pp=c[2]) for c in cs)
            else:  # a line inside the TP group (a cube axis, an ATP mesh row / column): the other
                # lines of the same partition are its translates that stay inside the group and
                # share no rank with the lines already taken
                if any(c[0] + dt >= s.tp for c in cs):
                    continue
                g = tuple(s.rank(tp=c[0] + dt, dp=(c[1] + dd) % s.dp, pp=c[2]) for c in cs)
                if used & set(g):
                    continue
            if g not in out:
                out.append(g)
                used |= set(g)
    return tuple(out)


def busy_levels(s: Strategy) -> list[int]:
    """Numbers of ranks computing at once that a trainer run of ``s`` goes through: the ranks of
    1..PP stages (TP peers and DP replicas compute together)."""
    per_stage = s.tp * s.dp
    return [per_stage * j for j in range(1, s.pp + 1)]


def build_plan(events: dict[str, Event], s: Strategy, *, warmup: int, reps: int,
               levels: list[int] | None = None, overlap: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """JSON-able work for the profiling ranks: comm jobs (concurrent groups) and compute jobs;
    those whose keys are in ``overlap`` are also measured overlapped (``_measure_overlap``)."""
    comm, compute, keys = [], [], {}
    stages = [[r for r in range(s.world_size) if coords(r, s)[2] == p] for p in range(s.pp)]
    for k, e in events.items():
        if e.kind == "compute":
            compute.append({"key": k, "name": e.name, "dims": [[a, b] for a, b in e.dims], "overlap": k in overlap})
            continue
        kind = "p2p" if e.kind == "p2p" else e.op.kind
        groups = sibling_groups(tuple(e.ranks), s)
        on = {coords(r, s)[2] for g in groups for r in g}
        job = {"kind": kind, "groups": [list(g) for g in groups], "nbytes": max(4, int(e.nbytes)),
               "stage": on.pop() if len(on) == 1 and kind != "p2p" else None}
        sig = json.dumps(job, sort_keys=True)
        if sig not in keys:
            keys[sig] = len(comm)
            comm.append({**job, "keys": []})
        comm[keys[sig]]["keys"].append(k)
        if k in overlap and kind != "p2p":  # measured overlapped once, for the keys that overlap
            comm[keys[sig]]["overlap"] = True
            comm[keys[sig]].setdefault("overlap_keys", []).append(k)
    return {"world": s.world_size, "levels": sorted(set(levels or busy_levels(s))), "warmup": warmup,
            "reps": reps, "comm": comm, "compute": compute, "stages": stages}


def merge_rank_results(plan: dict[str, Any], per_rank: list[dict[str, Any]]
                       ) -> tuple[dict[str, float], dict[str, dict[int, float]], dict[str, str], dict[str, float]]:
    """(events_ms, contention, sources, overlapped) from every rank's medians: the slowest rank of a job."""
    events, contention, sources, overlapped = {}, {}, {}, {}
    for j, job in enumerate(plan["comm"]):
        vals = [r["comm"][j] for r in per_rank if r["comm"][j] is not None]
        if not vals:
            raise SimError(f"no rank measured comm job {j} ({job['kind']} over {job['groups']})")
        # the slowest rank; for p2p the receiver (both start after a barrier, and gloo's send
        # returns once the bytes are in the socket buffer, long before they arrive)
        ms = lockstep_ms(vals)
        conc = f"; {len(job['groups'])} groups at once" if len(job["groups"]) > 1 else ""
        for k in job["keys"]:
            events[k] = ms
            sources[k] = "measured on the emulated links" + conc
    for j, job in enumerate(plan["comm"]):  # a stage's collective while other stages compute
        loaded = [r["comm_loaded"][j] for r in per_rank if r.get("comm_loaded") and r["comm_loaded"][j]]
        if not loaded:
            continue
        by = {plan["levels"][0]: events[job["keys"][0]]}
        for lv_i, lv in enumerate(plan["levels"][1:], start=1):
            vals = [x[lv_i] for x in loaded if x[lv_i]]
            if vals:
                by[lv] = lockstep_ms(vals)
        for k in job["keys"]:
            contention[k] = dict(by)
    top = max(plan["levels"])
    for i, job in enumerate(plan["compute"]):
        by = {}
        for lv_i, lv in enumerate(plan["levels"]):
            by[lv] = lockstep_ms([r["compute"][i][lv_i] for r in per_rank if r["compute"][i][lv_i] is not None])
        events[job["key"]] = by[top]
        contention[job["key"]] = by
        sources[job["key"]] = f"measured with {top} ranks computing at once"
    for name, jobs in (("overlap_comm", plan["comm"]), ("overlap_compute", plan["compute"])):
        for j, job in enumerate(jobs):
            vals = [r[name][j] for r in per_rank if r.get(name) and r[name][j] is not None]
            if not vals:
                continue
            keys = job.get("overlap_keys") or job.get("keys", [job.get("key")])
            if name == "overlap_comm" and all(isinstance(v, list) and v and isinstance(v[0], list) for v in vals):
                ms = beside_lockstep_ms(vals, events[job["keys"][0]])
            else:  # compute, or a rank file of the older format (one time per repetition)
                ms = lockstep_ms(vals)
            for k in keys:
                overlapped[k] = ms
    return events, contention, sources, overlapped


MAX_OVERLAP_SLOWDOWN = 50.0
"""``overlapped_from_beside`` caps the in-flight time at this many plain times (a collective that
made no measurable progress beside the compute)."""


def overlapped_from_beside(total: float, compute: float, plain: float) -> float:
    """The time a collective takes while the rank computes (``ProfileDB.overlapped``, the rate the
    simulator's fluid model uses) from one run of the executor's pattern: launched async, one
    compute event beside it (``compute`` ms), then waited for; it ended ``total`` ms after its
    launch, and takes ``plain`` ms alone. Ended during the compute: ``total``. Otherwise it did
    ``1 - (total - compute) / plain`` of its work in ``compute`` ms."""
    if total <= compute or plain <= 0:
        return total
    done = 1.0 - (total - compute) / plain
    return compute / max(done, compute / (MAX_OVERLAP_SLOWDOWN * plain))


def beside_lockstep_ms(per_rank: list, plain: float) -> float:
    """``overlapped_from_beside`` over repetitions of [total, compute] pairs: per repetition the
    rank whose collective ended last (the group waits for it), then the median."""
    n = min(len(v) for v in per_rank)
    if not n:
        raise SimError("no repetitions of an overlapped collective")
    return statistics.median(overlapped_from_beside(*max((v[i] for v in per_rank), key=lambda p: p[0]), plain)
                             for i in range(n))


def lockstep_ms(per_rank: list) -> float:
    """One event's time from the ranks that ran it together: per repetition the slowest rank
    (they start each repetition at a barrier and, as TP peers in the trainer, wait for each
    other at the next collective), then the median over repetitions. A rank's entry is its list
    of repetitions, or one number (its median: older rank files), then the slowest rank's."""
    if all(isinstance(v, list) for v in per_rank):
        n = min(len(v) for v in per_rank)
        if n:
            return statistics.median(max(v[i] for v in per_rank) for i in range(n))
    return max(statistics.median(v) if isinstance(v, list) else v for v in per_rank)


# ---- the profiling rank -----------------------------------------------------------------------
def _my_group(job: dict[str, Any], me: int) -> tuple[int, ...] | None:
    """The group of ``job`` this rank belongs to (None if it is in none of them)."""
    return next((tuple(g) for g in job["groups"] if me in g), None)


def _comm_op(job: dict[str, Any], me: int, mine: tuple[int, ...] | None, grp: Any, async_op: bool = False):
    """The collective of ``job`` on this rank's group (None if the rank is in none of its groups);
    with ``async_op`` the callable returns the work handle."""
    import torch
    import torch.distributed as dist

    if not mine:
        return None
    n, numel, kind = len(mine), max(1, job["nbytes"] // 4), job["kind"]
    if kind == "all_reduce":
        x = torch.ones(numel)
        return lambda: dist.all_reduce(x, group=grp, async_op=async_op)
    if kind == "all_gather":
        x, big = torch.ones(max(1, numel // n)), torch.empty(max(1, numel // n) * n)
        return lambda: dist.all_gather_into_tensor(big, x, group=grp, async_op=async_op)
    if kind == "reduce_scatter":
        y = torch.empty(max(1, numel // n))
        x = torch.ones(y.numel() * n)
        return lambda: dist.reduce_scatter_tensor(y, x, group=grp, async_op=async_op)
    if kind in ("broadcast", "reduce"):  # the 3-D cube's diagonal vectors, rooted at the line's first rank
        x = torch.ones(numel)
        if kind == "broadcast":
            return lambda: dist.broadcast(x, src=mine[0], group=grp, async_op=async_op)
        return lambda: dist.reduce(x, dst=mine[0], group=grp, async_op=async_op)
    if kind == "p2p" and not async_op:
        x = torch.ones(numel)
        return (lambda: dist.send(x, mine[1])) if me == mine[0] else (lambda: dist.recv(x, mine[0]))
    return None


def _measure_overlap(plan: dict[str, Any], me: int, group, dev) -> tuple[list, list]:
    """Overlap as the Oases executor runs it, both directions:

    * each overlapped collective launched async, then one overlapped compute event (the other
      sub-batch's next segment; they take turns over the repetitions), then a wait, as the
      executor does: per repetition [time from the launch to the collective's end, the compute's
      time] (``overlapped_from_beside`` turns them into the in-flight time the simulator's fluid
      model uses); ranks outside its groups (other pipeline stages) run their own stage's
      collective of the same kind and size meanwhile, as they do in the trainer. (Keeping the
      compute running until the collective ends instead starves gloo's thread where ranks
      outnumber cores: a 512 KB all-reduce of 10.7 ms then took 160-250 ms, while beside one
      segment it ends 1.5-6 ms after the segment);
    * the overlapped compute events timed (interleaved, every call started at a barrier of all
      ranks, as the all-busy plain times) while a collective is always in flight on every rank
      (a thread repeats the rank's most common overlapped collective until the ranks agree to stop).

    Returns this rank's repetition times per comm job and per compute job (None where not measured)."""
    import threading

    import torch
    import torch.distributed as dist

    from .workloads import compute_workload

    comm_jobs = [j for j, job in enumerate(plan["comm"]) if job.get("overlap")]
    comm_out: list = [None] * len(plan["comm"])
    comp_out: list = [None] * len(plan["compute"])
    if not comm_jobs:
        return comm_out, comp_out
    fns = [(i, compute_workload(job["name"], dict(job["dims"]), dev))
           for i, job in enumerate(plan["compute"]) if job.get("overlap")]
    if not fns:
        raise SimError("overlapped collectives but no overlapped compute events to run beside them")
    side = dist.new_group(list(range(plan["world"])))  # used only by the helper threads
    # the main thread's start barriers while a helper's collective is in flight (a TP group of the
    # whole world is WORLD itself: two threads must never share a group)
    starts = dist.new_group(list(range(plan["world"])))
    reps, warmup = plan["reps"], plan["warmup"]

    nxt = 0
    for j in comm_jobs:
        job = plan["comm"][j]
        mine = _my_group(job, me)
        if mine is None:  # another stage: its own collective of the same kind and size runs meanwhile
            twin = next((plan["comm"][q] for q in comm_jobs if _my_group(plan["comm"][q], me)
                         and (plan["comm"][q]["kind"], plan["comm"][q]["nbytes"]) == (job["kind"], job["nbytes"])),
                        None)
            tmine = _my_group(twin, me) if twin else None
            op = _comm_op(twin, me, tmine, group(tmine), async_op=True) if twin else None
        else:
            op = _comm_op(job, me, mine, group(mine), async_op=True)
        ms = []
        for rep in range(warmup + reps):
            dist.barrier()
            end = [None]
            t0 = time.perf_counter()
            work = op() if op is not None else None

            def waiter(work=work, end=end):
                if work is not None:
                    work.wait()
                    end[0] = time.perf_counter()
            th = threading.Thread(target=waiter, daemon=True)
            th.start()
            fns[nxt % len(fns)][1]()
            nxt += 1
            t1 = time.perf_counter()
            th.join()
            if rep >= warmup and end[0] is not None and mine is not None:
                ms.append([(end[0] - t0) * 1e3, (t1 - t0) * 1e3])
        comm_out[j] = ms or None

    # every rank keeps the most common overlapped collective of its own groups in flight (both
    # stages' TP all-reduces with PP), while the compute events run interleaved and started
    # together, exactly as for the all-busy plain times they are compared with
    own = [j for j in comm_jobs if _my_group(plan["comm"][j], me)]
    loop_op = None
    if own:
        busy_job = plan["comm"][max(own, key=lambda j: len(plan["comm"][j]["keys"]))]
        mine = _my_group(busy_job, me)
        loop_op = _comm_op(busy_job, me, mine, group(mine))
    dist.barrier()
    done = threading.Event()

    def background():
        flag = torch.zeros(1)
        while True:
            flag.fill_(1.0 if done.is_set() else 0.0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=side)  # stop together
            if flag.item() > 0:
                return
            if loop_op is not None:
                loop_op()
    th = threading.Thread(target=background, daemon=True)
    th.start()
    times = interleaved_ms([fn for _, fn in fns], warmup, reps, before=lambda: dist.barrier(group=starts))
    done.set()
    th.join()
    for (i, _), ms in zip(fns, times):
        comp_out[i] = ms
    return comm_out, comp_out


TAIL_EVENTS = ("optimizer", "grad_norm")
"""Compute events of the step's tail: not what another stage runs beside a collective."""


def _measure_comm_under_load(plan: dict[str, Any], me: int, group, work: list) -> list:
    """With a pipeline, a stage's collectives (stock TP all-reduces included) run while other
    stages compute on the same cores, and slow down (gloo's worker thread and the kernel's TCP /
    tbf work wait for a core). For each collective of one stage and n = 1 .. PP-1, time it while
    the ranks of n other stages cycle through ``work`` (the layer compute) until it is done.
    Returns, per comm job, None or a list over ``plan["levels"]`` (index n: n + 1 stages busy,
    index 0 None: the plain time) of this rank's repetition times."""
    import threading

    import torch.distributed as dist

    stages = plan.get("stages") or []
    out: list = [None] * len(plan["comm"])
    jobs = [j for j, job in enumerate(plan["comm"]) if job.get("stage") is not None]
    if len(stages) < 2 or not jobs or not work:
        return out
    side = dist.new_group(list(range(plan["world"])))  # "the collective is done", helper threads only
    reps, warmup = plan["reps"], plan["warmup"]
    nxt = 0
    for j in jobs:
        job = plan["comm"][j]
        mine = _my_group(job, me)
        op = _comm_op(job, me, mine, group(mine)) if mine else None
        others = [p for p in range(len(stages)) if p != job["stage"]]
        row: list = [None] * len(plan["levels"])
        for n in range(1, len(stages)):
            busy = {r for p in others[:n] for r in stages[p]}
            ms = []
            for rep in range(warmup + reps):
                dist.barrier()
                if op is not None:
                    t0 = time.perf_counter()
                    op()
                    if rep >= warmup:
                        ms.append((time.perf_counter() - t0) * 1e3)
                    dist.barrier(group=side)
                elif me in busy:
                    stop = threading.Event()
                    th = threading.Thread(target=lambda stop=stop: (dist.barrier(group=side), stop.set()), daemon=True)
                    th.start()
                    while not stop.is_set():
                        work[nxt % len(work)]()
                        nxt += 1
                    th.join()
                else:
                    dist.barrier(group=side)
            row[n] = ms or None
        out[j] = row
    return out


def interleaved_ms(fns: list, warmup: int, reps: int, before=None) -> list:
    """Each callable's wall times (ms), the callables run in turn within every repetition, as a
    training step runs its events, instead of one event's repetitions back to back: a burst of
    outside load or a frequency change then spreads over all events instead of skewing one.
    ``before`` runs before every call (a barrier: the ranks start each call together); ``None``
    entries are skipped (this rank has no part in them) but still get their ``before``.
    Returns one list per callable (``None`` for the skipped ones)."""
    out: list = [None if fn is None else [] for fn in fns]
    for rep in range(warmup + reps):
        for i, fn in enumerate(fns):
            if before:
                before()
            if fn is None:
                continue
            t0 = time.perf_counter()
            fn()
            if rep >= warmup:
                out[i].append((time.perf_counter() - t0) * 1e3)
    return out


def rank_main(plan_path: str, out_dir: str) -> None:
    """One profiling rank (launched per rank by the emulator with the torchrun variables)."""
    import torch
    import torch.distributed as dist

    from .workloads import compute_workload

    plan = json.load(open(plan_path, encoding="utf-8"))
    dist.init_process_group("gloo")
    me, world = dist.get_rank(), dist.get_world_size()
    if world != plan["world"]:
        raise SimError(f"profiling plan is for {plan['world']} ranks, launched on {world}")
    warmup, reps = plan["warmup"], plan["reps"]
    groups: dict[tuple[int, ...], Any] = {}

    def group(ranks) -> Any:
        ranks = tuple(ranks)
        if ranks not in groups:  # every rank creates every group in the same order
            groups[ranks] = dist.new_group(list(ranks)) if len(ranks) < world else dist.group.WORLD
        return groups[ranks]
    for job in plan["comm"]:
        for g in job["groups"]:
            group(g)
    for lv in plan["levels"]:
        group(range(lv))
    out: dict[str, Any] = {"rank": me, "threads": torch.get_num_threads()}
    # every group starts each collective together, as in the trainer
    mine = [_my_group(job, me) for job in plan["comm"]]
    out["comm"] = interleaved_ms([_comm_op(job, me, g, group(g) if g else None) for job, g in zip(plan["comm"], mine)],
                                 warmup, reps, before=dist.barrier)
    dev = torch.device("cpu")
    fns = [compute_workload(job["name"], dict(job["dims"]), dev) for job in plan["compute"]]
    out["compute"] = [[None] * len(plan["levels"]) for _ in fns]
    for lv_i, lv in enumerate(plan["levels"]):
        dist.barrier()
        if me < lv:  # the first lv ranks compute at once, each call started together
            busy = group(range(lv))
            for i, ms in enumerate(interleaved_ms(fns, warmup, reps, before=lambda: dist.barrier(group=busy))):
                out["compute"][i][lv_i] = ms
    out["comm_loaded"] = _measure_comm_under_load(plan, me, group, [f for f, job in zip(fns, plan["compute"])
                                                                   if job["name"] not in TAIL_EVENTS])
    del fns
    out["overlap_comm"], out["overlap_compute"] = _measure_overlap(plan, me, group, dev)
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{me}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)
    dist.destroy_process_group()


# ---- the controller ---------------------------------------------------------------------------
def profile_emulated(events: dict[str, Event], topo: Topology, strategy: Strategy, *, warmup: int = 2,
                     reps: int = 5, timeout_s: float = 900.0, burst_ms: float | None = None,
                     nice: int = 0, overlap: set[str] | frozenset[str] = frozenset()) -> ProfileDB:
    """Measure ``events`` with ``strategy.world_size`` ranks in an emulated cluster of ``topo``;
    the keys in ``overlap`` (``events.overlapped_keys``) also while the other stream is busy;
    ``nice`` != 0 runs the ranks under ``nice -n`` (as the measured run should be)."""
    import torch

    from ...topology.emulate import EmulatedCluster, available_cpus, thread_env

    if topo.world_size != strategy.world_size:
        raise SimError(f"topology {topo.name!r} has {topo.world_size} ranks, the run {strategy.world_size}")
    plan = build_plan(events, strategy, warmup=warmup, reps=reps, overlap=set(overlap))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="oases_prof") as work:
        plan_path = os.path.join(work, "plan.json")
        with open(plan_path, "w", encoding="utf-8") as f:
            json.dump(plan, f)
        kw = {} if burst_ms is None else {"burst_ms": burst_ms}
        env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        from ...topology.netns import EmulationError

        pre = ["nice", "-n", str(nice)] if nice else []
        try:
            with EmulatedCluster(topo, **kw) as cluster:
                res = cluster.launch(pre + [sys.executable, "-m", "megatron_oases.sim.calibrate.emulated_profile", plan_path,
                                            work], env=env, timeout=timeout_s, cwd=root)
        except EmulationError as e:
            raise SimError(f"cannot emulate {topo.name!r} for profiling: {e}") from None
        if not res.ok:
            tail = "\n".join(f"rank {r}: {o[-1500:]}" for r, o in enumerate(res.outputs) if o.strip())
            raise SimError(f"emulated profiling failed (exit codes {res.returncodes}):\n{tail}")
        per_rank = [json.load(open(os.path.join(work, f"rank{r}.json"), encoding="utf-8"))
                    for r in range(strategy.world_size)]
    ev, contention, sources, overlapped = merge_rank_results(plan, per_rank)
    threads = thread_env(dict(os.environ), strategy.world_size).get("OMP_NUM_THREADS",
                                                                      os.environ.get("OMP_NUM_THREADS"))
    meta = {"torch": torch.__version__, "topology": topo.name, "nproc": strategy.world_size, "emulated": True,
            "warmup": warmup, "reps": reps, "threads": int(threads) if threads else per_rank[0]["threads"],
            "host_cpus": available_cpus(), "busy_levels": plan["levels"], "nice": nice,
            "loadavg": _loadavg(), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return ProfileDB(device="cpu:" + os.uname().machine, events_ms=ev, sources=sources, meta=meta,
                     contention=contention, overlapped=overlapped)


def _loadavg() -> str:
    try:
        return open("/proc/loadavg", encoding="utf-8").read().strip()
    except OSError:
        return ""


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
