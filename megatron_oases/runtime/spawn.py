"""Run a Python function on N local ranks (gloo on CPU, NCCL on GPU) and collect per-rank results.

Used by the tests (multi-rank parity on a 2-core machine), by ``megatron-oases train
--nproc-per-node`` and by benchmarks. Without CUDA, ranks start from a forkserver that has imported
torch and Megatron once, so N ranks do not pay N imports; with CUDA each rank is a fresh
interpreter (``start_method``). The first failing rank takes the others down
with it. The launcher hosts the rendezvous store itself (``_rendezvous_store``), so no other
process can take its port before the ranks connect. Two kinds of deadline: ``timeout_s`` bounds the whole run (tests: a hang fails in
seconds), ``stall_timeout_s`` bounds the time since a rank last called ``report_progress()``
(training: a healthy run may last days, a rank that stops making progress is named).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable, Sequence

_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
            "megatron.core.pipeline_parallel", "megatron.core.optimizer", "megatron.core.distributed",
            # the trainer's rank path, imported once here, not in every rank (~0.07 s CPU a rank)
            "megatron_oases.train", "megatron_oases.specs", "megatron_oases.checkpoint"]


_START_S = 120.0
"""Grace for a rank to start (the forkserver's first start imports torch and Megatron)."""


class RankFailure(RuntimeError):
    """One or more ranks raised, or the run passed its deadline; carries per-rank tracebacks.

    ``tracebacks``: whether any rank reported one (it raised, rather than being killed);
    ``signals``: the signals the launcher forwarded to the ranks (``forward_signals``), in order;
    ``killed_by``: the signals that ended the ranks which had died when the run failed."""

    def __init__(self, message: str, *, tracebacks: bool = False, signals: tuple[int, ...] = (),
                 killed_by: frozenset[int] = frozenset()):
        super().__init__(message)
        self.tracebacks = tracebacks
        self.signals = signals
        self.killed_by = killed_by


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1.

    Only right now: the probe socket is closed on return, and another process may bind the port
    before the caller does (EADDRINUSE). ``run_on_ranks`` therefore does not use it; it binds
    its rendezvous port once and holds it (``_rendezvous_store``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous_store():
    """The run's rendezvous ``TCPStore``, hosted by the launcher, as torchrun's agent hosts it.

    Rank 0 used to start the store on a port ``free_port()`` had probed and released, and on a
    busy machine another process sometimes took the port in between (EADDRINUSE, about once in
    200 launches), or worse, ranks 1.. joined a foreign store on it. Here the kernel picks the
    port (port 0) and the bind happens before any rank exists; the launcher holds it until the
    run ends. The ranks connect as clients: with ``TORCHELASTIC_USE_AGENT_STORE=True`` torch's
    ``env://`` rendezvous starts no server, on rank 0 either. The store outlives a rank's process
    group, so a rank must not destroy its default group and create another over ``env://``."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                         wait_for_workers=False)


@dataclasses.dataclass(frozen=True)
class _RankEnv:
    rank: int
    world_size: int
    master_port: int
    threads: int
    extra_env: dict


_PROGRESS = None
"""In a spawned rank: (shared array of last-progress times, this rank); None elsewhere."""


def report_progress() -> None:
    """Tell the launcher this rank is making progress (e.g. once per iteration).

    A no-op outside ``run_on_ranks`` (torchrun, srun): there, collectives time out after
    ``--dist-timeout`` on every process group instead.
    """
    if _PROGRESS is not None:
        times, rank = _PROGRESS
        times[rank] = time.monotonic()


def _rank_main(fn, args, kwargs, env: _RankEnv, results, progress):
    global _PROGRESS
    # The forkserver's heap (torch and Megatron, ~4 x 10^5 objects) is inherited by every rank, and
    # each full collection walked all of it, writing its headers (copy-on-write page faults):
    # Megatron's distributed-optimizer save calls gc.collect(): ~1 s a rank a save (4 ranks, 2 cores).
    # Frozen objects are never walked (as CPython's docs advise for fork without exec).
    gc.freeze()
    _PROGRESS = (progress, env.rank)
    report_progress()  # the rank has started
    os.environ.update({
        "RANK": str(env.rank), "LOCAL_RANK": str(env.rank), "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(env.master_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the launcher hosts the store (_rendezvous_store)
        **env.extra_env,
    })
    try:
        import torch

        torch.set_num_threads(env.threads)
        value = fn(*args, **kwargs)
        payload = ("ok", pickle.dumps(value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        payload = ("error", traceback.format_exc())
    results.put((env.rank, *payload))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown is best effort
        pass


def start_method() -> str:
    """``forkserver`` where torch sees no CUDA device, ``spawn`` where it does.

    Seen on an H200 (torch 2.11, Megatron-Core 0.16.1): every rank forked from the forkserver
    failed at its first CUDA call ("Cannot re-initialize CUDA in forked subprocess"), CPU ranks
    too (torch's Adam asks CUDA whether a graph is being captured): the preloaded imports query
    CUDA, and torch marks a process that did unsafe to fork. A fresh interpreter per rank has
    nothing to inherit."""
    import torch

    return "spawn" if torch.cuda.is_available() else "forkserver"


def run_on_ranks(fn: Callable[..., Any], world_size: int, args: Sequence = (), kwargs=None,
                 timeout_s: float | None = 120.0, env: dict | None = None,
                 stall_timeout_s: float | None = None,
                 forward_signals: Sequence[int] = ()) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the list of per-rank results.

    Each rank sees the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK) and
    must itself call ``init_process_group`` (e.g. through ``megatron_oases.runtime.init_distributed``),
    once: MASTER_PORT is the launcher's own store (``_rendezvous_store``), bound before any rank
    starts, as under torchrun.
    ``fn`` must be importable (module level). ``timeout_s`` (None: none) bounds the whole run;
    ``stall_timeout_s`` (None: none) fails the run when a rank has not called
    ``report_progress()`` for that long (its start counts as progress; starting may take
    ``_START_S`` more). Raises ``RankFailure``
    with every rank's traceback and the state of the ranks that had not finished.

    ``forward_signals``: signals the launcher passes on to every live rank instead of acting on
    them (from the main thread only), as torchrun's agent does: a scheduler's SIGTERM reaches the
    ranks, whose ``--exit-signal-handler`` saves and exits cleanly, and a launcher killed by it
    cannot leave its ranks running. Handlers are restored when the run ends.
    """
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    # Until a rank starts (forkserver start-up, imports) it gets _START_S on top of the stall.
    progress = ctx.Array("d", [time.monotonic() + _START_S] * world_size, lock=False)
    store = _rendezvous_store()  # held until the ranks are gone (the finally below)
    port = store.port
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = []
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in forward_signals}
    for rank in range(world_size):
        renv = _RankEnv(rank, world_size, port, threads, dict(env or {}))
        p = ctx.Process(target=_rank_main, daemon=True, name=f"rank{rank}",
                        args=(fn, tuple(args), dict(kwargs or {}), renv, results, progress))
        p.start()
        procs.append(p)
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
    got: dict[int, tuple[str, Any]] = {}

    def fail(headline: str) -> RankFailure:
        return RankFailure(_report(headline, got) + _states(procs, progress, got),
                           tracebacks=any(s == "error" for s, _ in got.values()),
                           signals=tuple(forwarded),
                           killed_by=frozenset(-p.exitcode for p in procs
                                               if p.exitcode is not None and p.exitcode < 0))

    try:
        while len(got) < world_size:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(world_size)) - set(got))
                raise fail(f"ranks {missing} did not finish within {timeout_s:.0f} s "
                           "(a hang: mismatched collectives?)")
            stalled = [r for r in range(world_size) if r not in got
                       and stall_timeout_s is not None and now - progress[r] > stall_timeout_s]
            if stalled:
                raise fail(f"rank(s) {stalled} made no progress for {stall_timeout_s:.0f} s "
                           "(stopped, or blocked in a collective a peer never joined)")
            try:
                rank, status, payload = results.get(timeout=min(deadline - now, 0.5))
                got[rank] = (status, payload)
                if status == "error":
                    break
            except queue.Empty:
                dead = [int(p.name[4:]) for p in procs if p.exitcode not in (None, 0)
                        and int(p.name[4:]) not in got]
                if dead:
                    time.sleep(0.5)  # let a dying rank's traceback arrive
                    while not results.empty():
                        rank, status, payload = results.get_nowait()
                        got[rank] = (status, payload)
                    raise fail(f"rank(s) {dead} exited without a result")
        errors = {r: p for r, (s, p) in got.items() if s == "error"}
        if errors:
            raise fail(f"rank(s) {sorted(errors)} failed")
        return [pickle.loads(got[r][1]) for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=2.0 if got and len(got) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        del store  # the ranks are gone: release the port
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R, S, T for stopped, ...), or "?"."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _states(procs, progress, got: dict) -> str:
    """One line per rank that has not finished: alive / stopped / exit code, and how long ago it
    last reported progress; a stopped (SIGSTOP) rank is named as such."""
    now = time.monotonic()
    lines = []
    for p in procs:
        rank = int(p.name[4:])
        if rank in got:
            continue
        if p.exitcode is not None:
            state = (f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                     else f"exited with code {p.exitcode}")
        else:
            state = "stopped (SIGSTOP)" if _process_state(p.pid) == "T" else "running"
        age = now - progress[rank]
        seen = f"last progress {age:.0f} s ago" if age >= 0 else "not started yet"
        lines.append(f"rank {rank}: {state}, {seen}")
    return ("\n" + "\n".join(lines)) if lines else ""


def _report(headline: str, got: dict) -> str:
    lines = [headline]
    for rank in sorted(got):
        status, payload = got[rank]
        if status == "error":
            lines.append(f"--- rank {rank} traceback ---\n{payload}")
    return "\n".join(lines)
