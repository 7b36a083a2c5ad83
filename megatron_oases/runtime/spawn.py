"""Run a Python function on N local ranks (gloo on CPU, NCCL on GPU) and collect per-rank results.

Used by the tests (multi-rank parity on a 2-core machine), by ``megatron-oases train
--nproc-per-node`` and by benchmarks. Ranks start from a forkserver that has imported torch and
Megatron once, so N ranks do not pay N imports. A deadline covers every rank: a hang fails in
seconds with the ranks' tracebacks, and the first failing rank takes the others down with it.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Sequence

_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
            "megatron.core.pipeline_parallel", "megatron.core.optimizer", "megatron.core.distributed"]


class RankFailure(RuntimeError):
    """One or more ranks raised, or the run passed its deadline; carries per-rank tracebacks."""


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class _RankEnv:
    rank: int
    world_size: int
    master_port: int
    threads: int
    extra_env: dict


def _rank_main(fn, args, kwargs, env: _RankEnv, results):
    os.environ.update({
        "RANK": str(env.rank), "LOCAL_RANK": str(env.rank), "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(env.master_port), **env.extra_env,
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


def run_on_ranks(fn: Callable[..., Any], world_size: int, args: Sequence = (), kwargs=None,
                 timeout_s: float = 120.0, env: dict | None = None) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the list of per-rank results.

    Each rank sees the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK) and
    must itself call ``init_process_group`` (e.g. through ``megatron_oases.runtime.init_distributed``).
    ``fn`` must be importable (module level). Raises ``RankFailure`` with every rank's traceback.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = []
    for rank in range(world_size):
        renv = _RankEnv(rank, world_size, port, threads, dict(env or {}))
        p = ctx.Process(target=_rank_main, args=(fn, tuple(args), dict(kwargs or {}), renv, results),
                        daemon=True, name=f"rank{rank}")
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout_s
    got: dict[int, tuple[str, Any]] = {}
    try:
        while len(got) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(got))
                raise RankFailure(_report(f"ranks {missing} did not finish within {timeout_s:.0f} s "
                                          "(a hang: mismatched collectives?)", got))
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
                got[rank] = (status, payload)
                if status == "error":
                    break
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)
                        and int(p.name[4:]) not in got]
                if dead:
                    time.sleep(0.5)  # let a dying rank's traceback arrive
                    while not results.empty():
                        rank, status, payload = results.get_nowait()
                        got[rank] = (status, payload)
                    raise RankFailure(_report(f"{dead} exited without a result", got))
        errors = {r: p for r, (s, p) in got.items() if s == "error"}
        if errors:
            raise RankFailure(_report("rank(s) failed", got))
        return [pickle.loads(got[r][1]) for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=2.0 if got and len(got) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


def _report(headline: str, got: dict) -> str:
    lines = [headline]
    for rank in sorted(got):
        status, payload = got[rank]
        if status == "error":
            lines.append(f"--- rank {rank} traceback ---\n{payload}")
    return "\n".join(lines)
