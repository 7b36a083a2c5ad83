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
    from megatron_oases.train import run
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)
    _, records = run(args)
    return {"rank": int(os.environ["RANK"]),
            "losses": {r["iteration"]: r["lm_loss"] for r in records}}
