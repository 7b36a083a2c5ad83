"""Bugs a longer, wider use of the trainer hit (issue 20), each pinned by a run that failed
before its fix."""
from __future__ import annotations

import argparse

import pytest

from megatron_oases.runtime.spawn import run_on_ranks
from megatron_oases.vocab import padded_vocab_size, vocab_padding_note
from tests.rank_fns import train_and_gather

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "256", "--make-vocab-size-divisible-by", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--seed", "3",
         "--optimizer", "sgd", "--lr", "1e-2", "--train-iters", "3", "--device", "cpu"]
TOL = 1e-5


def _losses(n: int, argv: list[str]) -> list[float]:
    return run_on_ranks(train_and_gather, n, args=(argv,), timeout_s=180)[-1]["losses"]


def _assert_close(got, want):
    assert len(got) == len(want)
    for it, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) / abs(b) <= TOL, f"iteration {it}: {a} vs {b}"


@pytest.fixture(scope="module")
def single_rank():
    return _losses(1, MODEL)


@pytest.mark.parametrize("extra", [
    ["--atp-chunks", "2"],
    ["--num-layers-per-virtual-pipeline-stage", "1"],
], ids=["1f1b-chunks2", "interleaved"])
def test_atp_mesh_d1_by_1_with_pp_and_no_recompute(single_rank, extra):
    """ATP DeviceMesh(2, 1) x PP 2 without recompute crashed at iteration 1 in Megatron's
    ``deallocate_output_tensor`` (the size-1 axis-2 gather handed back a view)."""
    got = _losses(4, MODEL + ["--tp-backend", "atp", "--tensor-model-parallel-size", "2",
                              "--atp-mesh", "2,1", "--pipeline-model-parallel-size", "2"] + extra)
    _assert_close(got, single_rank)


def _ns(vocab, tp, divisor=128, invariant=True):
    from megatron_oases.run_config import run_config

    return run_config(argparse.Namespace(vocab_size=vocab, tensor_model_parallel_size=tp,
                                         make_vocab_size_divisible_by=divisor, tp_invariant_init=invariant))


def test_padded_vocab_does_not_grow_with_tp():
    assert [padded_vocab_size(_ns(1100, tp)) for tp in (1, 2, 4, 8)] == [1152] * 4
    assert padded_vocab_size(_ns(1000, 3)) == 1152  # a multiple of 3 as well (lcm)
    # Megatron's own rule without the TP-invariant init.
    assert [padded_vocab_size(_ns(1100, tp, invariant=False)) for tp in (1, 2, 4)] == [1152, 1280, 1536]
    assert vocab_padding_note(_ns(1100, 2)) is None
    note = vocab_padding_note(_ns(1000, 3))
    assert "pads to 1152 at --tensor-model-parallel-size 3 but to 1024 at TP 1" in note


def test_tp2_with_a_vocabulary_megatron_pads_differently_matches_one_rank():
    """Vocabulary 1100: Megatron pads it to 1152 at TP 1 and 1280 at TP 2 (softmax over other
    logits); with the TP-invariant padding both build 1152 and train alike."""
    model = MODEL + ["--vocab-size", "1100", "--make-vocab-size-divisible-by", "128",
                     "--train-iters", "2"]
    _assert_close(_losses(2, model + ["--tensor-model-parallel-size", "2"]), _losses(1, model))


def test_a_nan_loss_stops_every_rank_in_one_line_and_saves_nothing_after_it(tmp_path, capsys):
    """Issue 48: ``--lr 1e30`` logged ``lm loss: NAN`` from iteration 2 and exited 0. As Megatron-LM
    (``--check-for-nan-in-loss-and-grad``, on by default) training stops there: one line naming
    the iteration, exit 1, the checkpoint of iteration 1 the last one. PP 2: the first stage has
    no loss of its own and must stop with the last."""
    import os

    from megatron_oases.train import main

    d = tmp_path / "ck"
    argv = MODEL + ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--lr", "1e30",
                    "--train-iters", "4", "--save", str(d), "--save-interval", "1"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("megatron-oases train: error: iteration 2: the loss is NaN"), err
    assert "--check-for-nan-in-loss-and-grad): try a lower --lr (now 1e+30)" in err[0], err
    assert (d / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert sorted(os.listdir(d)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_no_check_for_nan_trains_on():
    losses = _losses(1, MODEL + ["--lr", "1e30", "--no-check-for-nan-in-loss-and-grad"])
    assert len(losses) == 3 and losses[2] != losses[2]  # NaN, and all 3 iterations ran
