"""Rank functions for the trainer checkpoint tests (``--save/--load``; importable by the forkserver)."""
from __future__ import annotations

import os

# Tiny GPT shared by every layout (the vocabulary pads to 256 at TP 1..8 with divisible-by 32, so
# any layout can load any other's checkpoint). Adam, so the optimizer state matters on resume.
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
         "--seq-length", "16", "--vocab-size", "256", "--make-vocab-size-divisible-by", "32",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--optimizer", "adam",
         "--lr", "1e-2", "--seed", "7", "--device", "cpu", "--dist-timeout", "60"]

# name: (ranks, flags). Stock trains with dropout, so its resume also needs the RNG states.
LAYOUTS = {
    "stock_tp2_pp2": (4, ["--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2", "--hidden-dropout", "0.1"]),
    "oases_tp2_dp2": (4, ["--tensor-model-parallel-size", "2", "--schedule", "oases"]),
    "distopt_oases_tp2_dp2": (4, ["--tensor-model-parallel-size", "2", "--schedule", "oases",
                                  "--use-distributed-optimizer"]),
    "atp_2x2": (4, ["--tensor-model-parallel-size", "4", "--tp-backend", "atp",
                    "--atp-mesh", "2,2"]),
    "3d_tp8": (8, ["--tensor-model-parallel-size", "8", "--tp-backend", "3d"]),
    "plan_tp4": (4, ["--tensor-model-parallel-size", "4"]),  # + --oases-plan FILE (test writes it)
}


def train(argv: list[str]) -> dict:
    """``megatron-oases train`` on this rank (``train.run``); per-iteration losses (last rank)."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train import run
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)
    _, records = run(run_config(args))
    return {"rank": int(os.environ["RANK"]),
            "losses": {r["iteration"]: r["lm_loss"] for r in records}}


def megatron_save_load(path: str) -> list:
    """Megatron's own ``dist_checkpointing.save`` / ``load`` on a CPU rank, with the CPU layer
    installed and nothing of ``runtime.dist_ckpt`` but its daemon-flag context: the layer alone
    must reach the torch_dist writer, including the modules Megatron imports only at the first
    save (0.19: ``state_dict_saver``, whose ``torch.cuda.current_device()`` would fail here)."""
    import torch
    import torch.distributed as dist

    from megatron_oases.runtime.cpu_compat import install_cpu_compat
    from megatron_oases.runtime.dist_ckpt import writer_in_this_rank

    os.makedirs(path)
    dist.init_process_group("gloo")
    install_cpu_compat()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    def state(weight):
        return {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0),
                "obj": ShardedObject("obj", {"step": 3}, (1,), (0,), replica_id=0),
                "iteration": 3}

    with writer_in_this_rank():
        dist_checkpointing.save(state(torch.arange(4.0)), path)
    loaded = dist_checkpointing.load(state(torch.zeros(4)), path)
    return [loaded["w"].tolist(), loaded["obj"], loaded["iteration"]]
