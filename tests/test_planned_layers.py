"""Per-layer and per-block TP degrees from a plan (``--oases-plan``): groups, reshard, memory, parity.

Issue acceptance: a mixed plan [2, 2, 4, 4] on T = 4 trains 5 iterations with the same losses as
uniform TP = 4 and as TP = 1 (fp32, relative difference <= 1e-5), with the Oases schedule and with
the stock schedule. Gradients are compared too (SGD; dropout off: replicas draw masks for their
own samples, as stock TP sizes do)."""
from __future__ import annotations

import json

import pytest

from megatron_oases.parallel.degree_groups import reshard_group_ranks, sub_group_ranks
from megatron_oases.errors import ConfigError
from tests.conftest import assert_same_training
from tests.rank_fns_plan import train_with_plan

TOL = 1e-5
MODEL = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "512", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--seed", "5", "--train-iters", "5", "--optimizer", "sgd", "--lr", "0.05",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--device", "cpu"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
OASES = ["--schedule", "oases"] + RECOMPUTE


def _plan(tmp_path, tp, degrees, name="plan.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"format": "megatron-oases-plan/1", "tensor_model_parallel_size": tp,
                                "num_layers": len(degrees) // 2, "degrees": list(degrees)}))
    return str(path)


def test_group_ranks():
    assert sub_group_ranks([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    # degree 1 <-> 4: the whole TP group; 2 <-> 4: same position in the pair.
    assert reshard_group_ranks([0, 1, 2, 3], 1, 4) == [[0, 1, 2, 3]]
    assert reshard_group_ranks([0, 1, 2, 3], 2, 4) == [[0, 2], [1, 3]]
    assert reshard_group_ranks([4, 5, 6, 7], 1, 2) == [[4, 5], [6, 7]]
    assert reshard_group_ranks(list(range(8)), 2, 4) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError):
        reshard_group_ranks([0, 1, 2, 3], 4, 2)


def test_batch_masks_follow_the_replica():
    import torch

    from megatron_oases.parallel.degree_groups import DegreeGroups, narrow_batch_mask

    g = DegreeGroups(tp_size=4, tp_index=3, sub={}, reshard={})
    mask = torch.arange(8).view(8, 1, 1, 1)
    assert narrow_batch_mask(mask, g, 2, 8).flatten().tolist() == [4, 5, 6, 7]
    assert narrow_batch_mask(mask, g, 1, 8).flatten().tolist() == [6, 7]
    assert narrow_batch_mask(mask, g, 4, 8) is mask  # degree T: the whole batch
    shared = torch.ones(1, 1, 4, 4)
    assert narrow_batch_mask(shared, g, 2, 8) is shared and narrow_batch_mask(None, g, 2, 8) is None


def _runs(n, argv):
    from megatron_oases.runtime.spawn import run_on_ranks

    return run_on_ranks(train_with_plan, n, args=(argv,), timeout_s=240)


def _assert_same(got, ref, what):
    assert_same_training(got, ref, tol=TOL, what=what)


def _summary(outs):
    return {"losses": outs[-1]["losses"], "norms": outs[-1]["norms"], "grads": outs[0]["grads"]}


@pytest.fixture(scope="module")
def references():
    two = ["--num-layers", "2"] + MODEL
    return {"tp1": _summary(_runs(1, two + RECOMPUTE)),
            "tp4": _summary(_runs(4, two + RECOMPUTE + ["--tensor-model-parallel-size", "4"]))}


def _plan_matches_references(tmp_path, references, degrees, schedule):
    """Train 2 layers on T = 4 with ``degrees``; same as uniform TP 4 and TP 1. Returns each rank's output."""
    plan = _plan(tmp_path, 4, degrees)
    outs = _runs(4, ["--num-layers", "2"] + MODEL + schedule +
                 ["--tensor-model-parallel-size", "4", "--oases-plan", plan])
    got = _summary(outs)
    _assert_same(got, references["tp4"], "vs uniform TP=4")
    _assert_same(got, references["tp1"], "vs TP=1")
    return outs


@pytest.mark.parametrize("schedule", [RECOMPUTE, OASES], ids=["stock", "oases"])
def test_mixed_plan_matches_uniform_tp4_and_tp1(tmp_path, references, schedule):
    outs = _plan_matches_references(tmp_path, references, [2, 2, 4, 4], schedule)
    # Memory: the degree-2 layer holds 1/2 of its weight matrices per rank, the degree-4 one 1/4.
    for out in outs:
        (d1, n1), (d2, n2) = out["held"][1], out["held"][2]
        assert (d1, d2) == (2, 4) and n1 == 2 * n2


@pytest.mark.parametrize("schedule", [RECOMPUTE, OASES], ids=["stock", "oases"])
def test_per_block_plan_matches_uniform_tp4_and_tp1(tmp_path, references, schedule):
    """Attention and MLP at different degrees inside a layer ([2, 4 | 4, 1]: reshard inside
    layer 0, between the layers, and inside layer 1). Under Oases each block is its own stage
    segment, resharded between segments."""
    outs = _plan_matches_references(tmp_path, references, [2, 4, 4, 1], schedule)
    for out in outs:  # the MLP of layer 1 (degree 1) holds 4x the weights of layer 0's (degree 4)
        assert out["held"]["mlp1"][0] == 4 and out["held"]["mlp2"][0] == 1
        assert out["held"]["mlp2"][1] == 4 * out["held"]["mlp1"][1]


@pytest.mark.parametrize("schedule", [[], OASES], ids=["stock", "oases"])
def test_plan_with_pipeline_and_degree_one(tmp_path, schedule):
    """PP=2 x TP=2 (1F1B, 4 micro-batches) with degrees [1, 2 | 2, 1] equals uniform PP=2 x TP=2."""
    base = ["--num-layers", "4"] + MODEL + schedule + [
        "--global-batch-size", "16", "--train-iters", "3", "--pipeline-model-parallel-size", "2",
        "--tensor-model-parallel-size", "2"]
    ref = _summary(_runs(4, base))
    got = _summary(_runs(4, base + ["--oases-plan", _plan(tmp_path, 2, [1, 1, 2, 2, 2, 2, 1, 1])]))
    _assert_same(got, ref, "vs uniform PP=2 x TP=2")


def test_plan_with_oases_and_degree_one(tmp_path):
    """Degree-1 layers run without the sub-batch split under Oases: micro-batch 4 on T = 4."""
    base = ["--num-layers", "2"] + MODEL + OASES + ["--train-iters", "3",
                                                   "--tensor-model-parallel-size", "4"]
    ref = _summary(_runs(4, base))
    got = _summary(_runs(4, base + ["--oases-plan", _plan(tmp_path, 4, [1, 1, 4, 4])]))
    _assert_same(got, ref, "vs uniform TP=4 (Oases)")


def _validate(argv):
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    return validate_config(run_config(build_parser().parse_args(argv)), 4, cuda=False)


@pytest.mark.parametrize("degrees,extra,match", [
    ([2, 2, 3, 3], [], "not a power of two dividing --tensor-model-parallel-size 4"),
    ([2, 2, 4, 4, 4, 4], [], "made for --num-layers 3 but the launch uses 2"),
    ([2, 4, 4, 4], ["--micro-batch-size", "2", "--global-batch-size", "8", "--schedule", "oases"],
     "degree-2 blocks split each micro-batch over 2 replicas and then into 2 Oases sub-batches"),
    ([1, 1, 4, 4], ["--micro-batch-size", "2", "--global-batch-size", "8"],
     "split each micro-batch over 4 replicas: --micro-batch-size must be a multiple of 4"),
    ([2, 2, 4, 4], ["--micro-batch-size", "2", "--global-batch-size", "8", "--schedule", "oases"],
     "2 replicas and then into 2 Oases sub-batches: --micro-batch-size must be a multiple of 4"),
    ([1, 1, 2, 2], ["--micro-batch-size", "2", "--global-batch-size", "8", "--schedule", "oases"],
     "degree-1 blocks split each micro-batch over 4 replicas: --micro-batch-size must be a multiple of 4"),
    ([2, 2, 4, 4], ["--tp-backend", "atp", "--atp-mesh", "2,2"], "cannot be combined with --tp-backend atp"),
])
def test_bad_plans_are_one_line_errors(tmp_path, degrees, extra, match):
    plan = _plan(tmp_path, 4, degrees)
    with pytest.raises(ConfigError, match=match) as e:
        _validate(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                   "--micro-batch-size", "4", "--global-batch-size", "8",
                   "--tensor-model-parallel-size", "4", "--oases-plan", plan] + extra)
    assert "\n" not in str(e.value) and "--oases-plan" in str(e.value)


def test_good_plan_sets_layer_degrees(tmp_path):
    cfg = _validate(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                    "--micro-batch-size", "4", "--global-batch-size", "8",
                    "--tensor-model-parallel-size", "4", "--oases-plan",
                    _plan(tmp_path, 4, [2, 2, 4, 4])])
    assert cfg.oases_layer_degrees == ((2, 2), (4, 4))
    cfg = _validate(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                    "--micro-batch-size", "4", "--global-batch-size", "8",
                    "--tensor-model-parallel-size", "4", "--oases-plan",
                    _plan(tmp_path, 4, [2, 4, 4, 1])])
    assert cfg.oases_layer_degrees == ((2, 4), (4, 1))  # per block with the stock schedule
    cfg = _validate(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                    "--micro-batch-size", "4", "--global-batch-size", "8",
                    "--tensor-model-parallel-size", "4"])
    assert cfg.oases_layer_degrees is None


@pytest.mark.parametrize("schedule", [RECOMPUTE, OASES], ids=["stock", "oases"])
def test_replicas_draw_the_whole_batch_hidden_dropout_mask(tmp_path, schedule):
    """Hidden dropout on: each replica of a planned block keeps its slice of the mask of the whole
    micro-batch, so the plan trains like uniform TP = 4 (before, replicas drew one mask for their
    different samples)."""
    base = ["--num-layers", "2"] + MODEL + schedule + [
        "--hidden-dropout", "0.1", "--train-iters", "3", "--tensor-model-parallel-size", "4"]
    ref = _summary(_runs(4, base))
    got = _summary(_runs(4, base + ["--oases-plan", _plan(tmp_path, 4, [2, 4, 4, 1])]))
    _assert_same(got, ref, "vs uniform TP=4 with hidden dropout")
