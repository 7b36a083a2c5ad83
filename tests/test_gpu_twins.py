"""Every backend and schedule under CPU twins of GPU behaviour (tests/gpu_twins.py): async
collectives that publish only at wait(), a guard against host syncs while one is in flight, and a
fake gradient-accumulation-fusion extension. Each run must train like one unfused rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_oases.runtime.spawn import run_on_ranks
from tests import gpu_twins
from tests.conftest import assert_same_training
from tests.rank_fns_twins import train_under_twins

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "8",
         "--seq-length", "8", "--vocab-size", "256", "--make-vocab-size-divisible-by", "32",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--seed", "11",
         "--optimizer", "sgd", "--lr", "0.05", "--train-iters", "2", "--device", "cpu",
         "--dist-timeout", "120"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
CONFIGS = {
    "stock-tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "stock-tp2-dp2-overlap": (4, ["--tensor-model-parallel-size", "2", "--overlap-grad-reduce"]),
    "oases-tp2": (2, ["--tensor-model-parallel-size", "2", "--schedule", "oases"] + RECOMPUTE),
    "oases-atp-1x2": (2, ["--tensor-model-parallel-size", "2", "--schedule", "oases",
                          "--tp-backend", "atp", "--atp-mesh", "1,2"]),
    "3d-tp8": (8, ["--tensor-model-parallel-size", "8", "--tp-backend", "3d"]),
}
TOL = 1e-5


def _summary(outs):
    return {"losses": outs[-1]["losses"], "grads": outs[0]["grads"],
            "fused_calls": outs[0]["fused_calls"]}


@pytest.fixture(scope="module")
def unfused_one_rank():
    return _summary(run_on_ranks(train_under_twins, 1, args=(MODEL,), timeout_s=120))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_trains_like_one_rank_under_the_gpu_twins(name, unfused_one_rank):
    n, extra = CONFIGS[name]
    got = _summary(run_on_ranks(train_under_twins, n, args=(MODEL + extra, ("nan", "guard", "fusion")),
                                timeout_s=240))
    assert got["fused_calls"] > 0  # Megatron's fused wgrad path really ran
    assert_same_training(got, unfused_one_rank, tol=TOL, what="one unfused rank", iterations=2)


def _one_rank_group():
    import datetime
    import os

    from megatron_oases.runtime.spawn import free_port

    # A group of its own: not the launcher's store (runtime/spawn.py hosts that one for the run).
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))


def _twin_checks():
    _one_rank_group()
    try:
        x = torch.ones(4)
        with gpu_twins.nan_until_wait(), gpu_twins.sync_guard():
            work = dist.all_reduce(x, async_op=True)
            assert bool(x.isnan().all())  # a read before the wait sees NaN
            with pytest.raises(AssertionError, match="in flight"):
                x.sum().item()
            work.wait()
            assert x.tolist() == [1.0] * 4
            src, out = torch.arange(4.0), torch.empty(4)
            work = dist.all_gather_into_tensor(out, src, async_op=True)
            src.add_(1)  # the input must stay untouched until the wait
            with pytest.raises(AssertionError, match="changed before its wait"):
                work.wait()
        return True
    finally:
        dist.destroy_process_group()


def test_the_twins_catch_what_they_are_for():
    assert run_on_ranks(_twin_checks_rank, 1, timeout_s=60) == [True]


def _twin_checks_rank():
    return _twin_checks()
