"""MoE parity (issue 51 item 1): Megatron-Core's MoE layers through the trainer, fp32 and dropless,
with the router's aux loss on, give one rank's losses and every gradient (<= 1e-5 relative) at
EP 2 and EP 4 (the allgather and the alltoall dispatcher), TP 2 x EP 2 with sequence parallelism,
PP 2 x EP 2; the distributed optimizer equals Megatron's Adam at EP 2."""
from __future__ import annotations

import pytest

from tests.conftest import assert_same_training
from tests.rank_fns_oases import cached_training, run_training

TOL = 1e-5
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "256", "--micro-batch-size", "2", "--global-batch-size", "8", "--seed", "7",
         "--train-iters", "2", "--lr", "0.05", "--disable-bias-linear",
         "--num-experts", "4", "--moe-aux-loss-coeff", "0.01"]
SGD = ["--optimizer", "sgd"]
EP = "--expert-model-parallel-size"
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]


@pytest.mark.parametrize("n, layout", [
    (2, [EP, "2"]),
    (4, [EP, "4", *ALLTOALL]),
    (4, [EP, "2", "--tensor-model-parallel-size", "2", "--sequence-parallel", *ALLTOALL]),
], ids=["ep2-allgather", "ep4-alltoall", "tp2-sp-ep2"])
def test_expert_parallel_matches_one_rank(n, layout):
    got = run_training(n, MODEL + SGD + layout)
    assert_same_training(got, cached_training(1, MODEL + SGD), tol=TOL, what="one rank", iterations=2)


def test_pp2_ep2_matches_one_rank():
    """A stage per two ranks, MoE and dense layers (``--moe-layer-freq 2``), the tied embedding's
    gradient summed over the first and last stage."""
    freq = ["--moe-layer-freq", "2"]
    got = run_training(4, MODEL + SGD + freq + [EP, "2", "--pipeline-model-parallel-size", "2"])
    assert_same_training(got, run_training(1, MODEL + SGD + freq), tol=TOL, what="one rank", iterations=2)


def test_distributed_optimizer_equals_megatron_adam_at_ep2():
    """The experts' Adam states sharded over their expert-data-parallel group give the losses and
    parameters of Megatron's plain Adam at the same layout (the gathered gradients are shards
    there, so parameters are compared)."""
    from tests.conftest import max_rel_diff
    from tests.rank_fns_moe import losses_and_params

    adam = MODEL + ["--optimizer", "adam", EP, "2"]
    dist, plain = (losses_and_params(2, adam + extra) for extra in (["--use-distributed-optimizer"], []))
    assert dist["losses"] == pytest.approx(plain["losses"], rel=TOL)
    assert dist["params"].keys() == plain["params"].keys()
    for key, value in dist["params"].items():
        assert max_rel_diff(value, plain["params"][key]) <= TOL, key
