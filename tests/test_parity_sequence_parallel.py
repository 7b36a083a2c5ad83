"""Stock ``--sequence-parallel`` on CPU (torch norms marked for Megatron's TP gradient sum,
``layers/torch_norm.py``) trains like one rank: losses and every gradient, fp32, 1e-5.

Dropout is off here: with sequence parallelism each TP rank draws the hidden-dropout mask of its
own sequence chunk from its TP-rank-seeded RNG-tracker stream (Megatron forks the tracker around
the whole block), so the masks differ from one rank's, and from TP without SP, by construction.
Dropout under SP is compared Oases against stock SP instead (test_oases_sequence_parallel.py).
"""
from __future__ import annotations

import pytest

from tests.conftest import assert_same_training
from tests.rank_fns_oases import cached_training, run_training

TOL = 1e-5
ITERS = 3
# SGD: Adam turns float noise in near-zero gradients into lr-sized steps (test_parity_baseline).
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "512", "--micro-batch-size", "4",
         "--global-batch-size", "8", "--seed", "7", "--train-iters", str(ITERS),
         "--optimizer", "sgd", "--lr", "0.05", "--hidden-dropout", "0", "--attention-dropout", "0"]
SP = ["--sequence-parallel"]


@pytest.mark.parametrize("n,layout", [
    (2, ["--tensor-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "4"]),
], ids=["tp2", "tp2-pp2", "tp4"])
def test_stock_sequence_parallel_matches_one_rank(n, layout):
    got = run_training(n, MODEL + SP + layout)
    assert_same_training(got, cached_training(1, MODEL), tol=TOL, what="one rank",
                         iterations=ITERS)


def test_sequence_parallel_rmsnorm_and_recompute_match_one_rank():
    """RMSNorm (the other torch norm) and Megatron's full recompute under SP."""
    model = MODEL + ["--normalization", "RMSNorm"]
    got = run_training(2, model + SP + ["--tensor-model-parallel-size", "2",
                                        "--recompute-granularity", "full",
                                        "--recompute-method", "uniform"])
    assert_same_training(got, cached_training(1, model), tol=TOL, what="one rank",
                         iterations=ITERS)
