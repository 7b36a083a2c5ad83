"""MoE checkpoints across expert-parallel sizes (issue 51 item 1): our torch_dist checkpoints hold
the experts under Megatron's sharded keys (a global expert axis, ``SequentialMLP``'s
``sharded_state_dict``), so a run saved at EP 2 resumes at EP 4 and trains on as EP 4's
uninterrupted run does: the weights, Adam's states and the data position carry over; under
``--schedule oases`` too (saved and resumed by the Oases executor over the MoE layers, whose
per-micro-batch routing state lives only within a step)."""
from __future__ import annotations

import pytest

from megatron_oases.runtime.spawn import run_on_ranks
from tests.rank_fns_ckpt import train

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "256", "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--optimizer", "adam", "--lr", "3e-3", "--seed", "7",
         "--device", "cpu", "--dist-timeout", "60", "--disable-bias-linear",
         "--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall"]
EP = "--expert-model-parallel-size"
SAVED, ITERS = 2, 4
TOL = 1e-5  # another layout: the same model, another reduction order


OASES = ["--schedule", "oases", "--recompute-granularity", "full", "--recompute-method", "uniform"]


@pytest.mark.parametrize("dist_opt", [[], ["--use-distributed-optimizer"], OASES + ["--use-distributed-optimizer"]],
                         ids=["adam", "distopt", "oases-distopt"])
def test_ep2_checkpoint_resumes_at_ep4(tmp_path, dist_opt):
    ckpt = str(tmp_path / "ckpt")
    run_on_ranks(train, 2, args=(MODEL + dist_opt + [EP, "2", "--train-iters", str(SAVED), "--save", ckpt,
                                                     "--save-interval", str(SAVED)],), timeout_s=150)
    ep4 = MODEL + dist_opt + [EP, "4", "--train-iters", str(ITERS)]
    whole = run_on_ranks(train, 4, args=(ep4,), timeout_s=150)[-1]["losses"]
    resumed = run_on_ranks(train, 4, args=(ep4 + ["--load", ckpt],), timeout_s=150)[-1]["losses"]
    assert sorted(resumed) == list(range(SAVED + 1, ITERS + 1)), resumed
    for it, loss in resumed.items():
        assert abs(loss - whole[it]) / abs(whole[it]) <= TOL, (it, loss, whole[it])


def test_dense_checkpoint_is_not_loaded_into_moe(tmp_path):
    """The experts are part of the model a checkpoint must match: one line naming the flag."""
    from megatron_oases.checkpoint import CheckpointError, check_same_model
    from megatron_oases.run_config import RunConfig

    dense = RunConfig(ffn_hidden_size=256).as_dict()
    with pytest.raises(CheckpointError, match="was saved with --num-experts None, this run has 4"):
        check_same_model(dense, RunConfig(ffn_hidden_size=256, num_experts=4), str(tmp_path))
