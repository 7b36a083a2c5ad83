"""Parity of the baseline itself: every parallel layout trains exactly like one rank (fp32)."""
from __future__ import annotations

import pytest

from tests.conftest import max_rel_diff
from tests.rank_fns import init_only, train_and_gather

LR = 3e-3
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "512", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--seed", "7", "--lr", str(LR)]
TOL = 1e-5
# Parameters after Adam: an element whose gradient is ~0 moves by ~lr whatever float noise its
# gradient carries, so parameters are compared in units of one Adam step: within 1% of lr.
PARAM_ATOL = 0.01 * LR


@pytest.fixture(scope="module")
def reference(on_ranks_module):
    return on_ranks_module(train_and_gather, 1, MODEL + ["--train-iters", "10"])[0]


@pytest.fixture(scope="module")
def on_ranks_module():
    from megatron_oases.runtime.spawn import run_on_ranks

    return lambda fn, n, *a: run_on_ranks(fn, n, args=a, timeout_s=180)


def _compare(result, reference):
    losses = result["losses"]
    assert len(losses) == len(reference["losses"])
    for it, (got, want) in enumerate(zip(losses, reference["losses"]), 1):
        assert abs(got - want) / abs(want) <= TOL, f"iteration {it}: loss {got} vs {want}"
    params = result["params"]
    assert params.keys() == reference["params"].keys()
    for key in params:
        diff = float((params[key] - reference["params"][key]).abs().max())
        assert diff <= PARAM_ATOL, f"{key}: max |param diff| {diff:.3g} > {PARAM_ATOL:.3g}"


def test_tp2_pp2_full_recompute_matches_single_rank(reference, on_ranks_module):
    """Issue acceptance: TP=2 x PP=2 (4 ranks), full recompute, 10 iterations, losses and params."""
    out = on_ranks_module(train_and_gather, 4, MODEL + [
        "--train-iters", "10", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    _compare({"losses": out[-1]["losses"], "params": out[0]["params"]}, reference)


def test_selective_recompute_trains_as_without_recompute(on_ranks_module):
    """``--recompute-granularity selective`` at TP 2 with attention dropout: the rerun core
    attention redraws the same dropout mask (Megatron's checkpoint restores the RNG states), so
    losses and parameters equal those of the run that keeps everything."""
    model = [*MODEL, "--train-iters", "5", "--tensor-model-parallel-size", "2", "--attention-dropout", "0.1",
             "--hidden-dropout", "0.1"]
    plain = on_ranks_module(train_and_gather, 2, model)
    sel = on_ranks_module(train_and_gather, 2, model + ["--recompute-granularity", "selective"])
    _compare({"losses": sel[-1]["losses"], "params": sel[0]["params"]},
             {"losses": plain[-1]["losses"], "params": plain[0]["params"]})


def test_interleaved_pp2_dp2_matches_single_rank(on_ranks_module):
    """Interleaved 1F1B (2 virtual stages) with data parallelism 2 and the optimizer across DP.

    Global batch 16: 4 micro-batches per DP rank, more than the 2 stages, so each virtual stage
    runs two micro-batch groups and the steady state has exchanges in which a rank sends an
    activation and a gradient to its single peer at once (with only 2 micro-batches, one per
    stage, those exchanges never happen and a swap of the two goes unnoticed)."""
    model = [*MODEL, "--global-batch-size", "16", "--train-iters", "5"]  # the later flag wins
    reference = on_ranks_module(train_and_gather, 1, model)[0]
    out = on_ranks_module(train_and_gather, 4, model + [
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"])
    _compare({"losses": out[-1]["losses"], "params": out[0]["params"]}, reference)


def test_tp_invariant_init_gives_identical_global_model(on_ranks_module):
    one = on_ranks_module(init_only, 1, MODEL)[0]
    four = on_ranks_module(init_only, 4, MODEL + ["--tensor-model-parallel-size", "4"])[0]
    assert one.keys() == four.keys()
    for key in one:
        assert max_rel_diff(four[key], one[key]) == 0.0, key


@pytest.mark.parametrize("extra", [
    ["--tensor-model-parallel-size", "4", "--atp-mesh", "2,2", "--atp-chunks", "2"],
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--atp-mesh", "1,2",
     "--recompute-granularity", "full", "--recompute-method", "uniform"],
], ids=["atp-2x2-chunks2", "pp2-atp-1x2-recompute"])
def test_trainer_with_atp_backend_matches_single_rank(reference, on_ranks_module, extra):
    out = on_ranks_module(train_and_gather, 4, MODEL + ["--train-iters", "10", "--tp-backend", "atp"]
                          + extra)
    _compare({"losses": out[-1]["losses"], "params": out[0]["params"]}, reference)
