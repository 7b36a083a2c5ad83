"""Rank functions for the launcher's fault tests (importable by the forkserver children)."""
from __future__ import annotations

import os
import signal
import time

# A tiny trainer model for the timeout tests (TP 2 on 2 ranks).
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--device", "cpu", "--tensor-model-parallel-size", "2"]


def progress_for(seconds: float, every: float) -> int:
    """Report progress every ``every`` s for ``seconds`` s (a healthy, long run)."""
    from megatron_oases.runtime.spawn import report_progress

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(every)
        report_progress()
    return int(os.environ["RANK"])


def stall_on_rank_one(seconds: float) -> int:
    """Rank 1 stops reporting progress (sleeps), rank 0 keeps reporting."""
    if os.environ["RANK"] == "1":
        time.sleep(seconds)
        return 1
    return progress_for(seconds, 0.2)


def stop_rank_one(seconds: float) -> int:
    """Rank 1 stops itself (SIGSTOP); rank 0 keeps reporting progress."""
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    return progress_for(seconds, 0.2)


def group_timeouts(argv: list[str]) -> dict:
    """The collective timeout (s) of the world, Megatron's groups and ours after ``train.setup``."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_oases.run_config import run_config

    from megatron_oases.train import setup
    from megatron_oases.train_args import build_parser

    tr = setup(run_config(build_parser().parse_args(argv)))

    def seconds(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    out = {"world": seconds(torch.distributed.group.WORLD),
           "tp": seconds(ps.get_tensor_model_parallel_group()),
           "pp": seconds(ps.get_pipeline_model_parallel_group()),
           "dp": seconds(ps.get_data_parallel_group()),
           "dp_gloo": seconds(ps.get_data_parallel_group_gloo())}
    for name, module in tr.model[0].named_modules():
        groups = getattr(module, "mesh_groups", None)
        if groups is not None:
            out["atp_axis1"], out["atp_axis2"] = seconds(groups.group(1)), seconds(groups.group(2))
            break
    return out


def stop_rank_one_mid_training(argv: list[str]) -> float:
    """Train; rank 1 stops itself (SIGSTOP) after iteration 1, so rank 0's next TP collective
    has a peer that never joins. Returns how long rank 0 waited (it is expected to raise)."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser

    tr = setup(run_config(build_parser().parse_args(argv)))
    train_step(tr, 1)
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    train_step(tr, 2)
    return time.monotonic() - start


def rendezvous_port() -> dict:
    """The rendezvous as the trainer does it (``init_distributed``): whether MASTER_PORT was
    already bound when this rank started (another bind of it is refused), and a sum over ranks."""
    import errno
    import socket

    import torch
    import torch.distributed as dist

    from megatron_oases.runtime import init_distributed, init_runtime

    port = int(os.environ["MASTER_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            held = False
        except OSError as exc:
            held = exc.errno == errno.EADDRINUSE
    init_distributed(init_runtime("cpu"), timeout_s=60)
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    return {"port": port, "held": held, "sum": float(total)}
