"""Megatron-Core datasets in the reference trainer: --data-path, --mock-data, --eval-interval.

A small .bin/.idx is written with Megatron-Core's own IndexedDatasetBuilder; runs on it must
learn, report Megatron's validation loss, and give the same losses for every layout (the global
batch of iteration t is samples (t-1)*B .. t*B-1 whatever TP/PP/DP is)."""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist

from megatron_oases.run_config import run_config
from megatron_oases.train import main
from megatron_oases.train_args import build_parser
from tests.rank_fns_data import make_token_dataset, train_records

VOCAB = 256  # padded to 256 for TP 1 and TP 2 alike, so both layouts have the same logits
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", str(VOCAB), "--micro-batch-size", "2",
         "--global-batch-size", "8", "--seed", "7"]
TOL = 1e-5
VALIDATION = re.compile(r"^ validation loss at iteration \d+( on validation set)? \| "
                        r"lm loss value: \d\.\d{6}E[+-]\d\d \| lm loss PPL: \d\.\d{6}E[+-]\d\d \| $")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Prefixes of a 300-document file and a 40-document one (vocab 256, eod 255)."""
    root = tmp_path_factory.mktemp("tokens")
    make_token_dataset(str(root / "big"), num_docs=300, vocab_size=VOCAB, seed=0)
    make_token_dataset(str(root / "small"), num_docs=40, vocab_size=VOCAB, seed=1)
    make_token_dataset(str(root / "tiny"), num_docs=3, vocab_size=VOCAB, seed=2)
    (root / "bad.bin").write_bytes(b"\0" * 16)
    (root / "bad.idx").write_bytes(b"not an index")
    return {name: str(root / name) for name in ("big", "small", "tiny", "bad")}


@pytest.fixture(scope="module")
def spawn():
    from megatron_oases.runtime.spawn import run_on_ranks

    return lambda fn, n, *a: run_on_ranks(fn, n, args=a, timeout_s=120)


def _bad_inputs(d):
    return [
        (["--data-path", d["big"] + "_missing"], "--data-path " + d["big"] + "_missing: "),
        (["--data-path", d["bad"]], "is not a Megatron index file"),
        (["--data-path", "0.5", d["big"], d["small"], d["big"]], "--data-path must be PREFIX"),
        (["--data-path", "0", d["big"], "1", d["small"]], "--data-path weights must be > 0"),
        (["--mock-data", "--data-path", d["big"]], "--mock-data and --data-path are exclusive"),
        (["--data-path", d["big"], "--split", "90,x,10"], "--split must be"),
        (["--data-path", d["big"], "--split", "1,1,1,1"], "--split must be"),
        (["--data-path", d["big"], "--split", "0,1,0"], "gives the training split no documents"),
        (["--data-path", d["tiny"], "--eval-interval", "2"],
         "leaves the validation split of --data-path"),
        (["--data-path", d["big"], "--split", "1,0,0", "--eval-interval", "2"],
         "--eval-interval needs a validation split"),
        (["--split", "969,30,1"], "--split needs --data-path"),
        (["--mock-data", "--split", "1,1,1"], "--split needs --data-path: --mock-data"),
        (["--data-cache-path", "/tmp/x"], "--data-cache-path needs --data-path"),
        (["--mock-data", "--eod-token-id", str(VOCAB)], "--eod-token-id 256 must be a token id"),
        (["--eval-iters", "5"], "--eval-iters 5 needs --eval-interval"),
        (["--eval-interval", "5", "--eval-iters", "-1"], "--eval-iters must be >= 0"),
        (["--eval-interval", "0"], "--eval-interval must be >= 1"),
    ]


def test_bad_input_one_line_before_any_process_group(data, capsys):
    for argv, needle in _bad_inputs(data):
        assert main(MODEL + ["--nproc-per-node", "1"] + argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert needle in err, (argv, err)
        assert not dist.is_initialized()


def test_same_global_batch_for_every_data_parallel_split(data):
    """Each DP rank's micro-batches are its contiguous block of the global batch, and the
    global batch of iteration t is dataset samples (t-1)*B .. t*B-1."""
    from megatron_oases.datasets import MegatronData, build_datasets, validate_data_config

    cfg = validate_data_config(run_config(build_parser().parse_args(
        MODEL + ["--data-path", data["big"], "--train-iters", "3"])))
    train, _, _ = build_datasets(cfg, 8)
    for it in (1, 3):
        want = torch.stack([train[(it - 1) * 8 + i]["tokens"] for i in range(8)])
        for dp in (1, 2, 4):
            parts = [b["tokens"] for r in range(dp)
                     for b in MegatronData(cfg, r, dp, "cpu").train_batches(it)]
            assert torch.equal(torch.cat(parts), want), (it, dp)


def test_weighted_blend_and_synthetic_validation_stream(data):
    from megatron_oases.datasets import MegatronData, SyntheticData, validate_data_config

    cfg = validate_data_config(run_config(build_parser().parse_args(MODEL + [
        "--data-path", "0.7", data["big"], "0.3", data["small"], "--train-iters", "40",
        "--eval-interval", "20", "--eval-iters", "2"])))
    blend = MegatronData(cfg, 0, 1, "cpu")
    assert len(blend.train) >= 40 * 8 and len(blend.valid) >= 3 * 2 * 8
    # both files contribute to the training samples (BlendedDataset's dataset_id)
    assert {int(blend.train[i]["dataset_id"]) for i in range(64)} == {0, 1}
    # Synthetic validation batch n is the generator's iteration -(n + 1): a stream of draws that
    # training (iterations 1..T) never makes, the same for every layout and every call.
    from megatron_oases.data import synthetic_sample

    syn = SyntheticData(run_config(build_parser().parse_args(MODEL + ["--train-iters", "10"])), 0, 2, "cpu")
    got = torch.cat([b["tokens"] for b in syn.valid_batches(3)])
    want = torch.stack([synthetic_sample(7, -4, i, 16, VOCAB)[:-1] for i in range(4)])
    assert torch.equal(got, want)
    assert torch.equal(got, torch.cat([b["tokens"] for b in syn.valid_batches(3)]))
    for it in range(1, 11):
        assert not torch.equal(got, torch.cat([b["tokens"] for b in syn.train_batches(it)]))


def _check_learns_and_validates(records, iters, interval):
    losses = [r["lm_loss"] for r in records]
    assert len(losses) == iters and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
    valid = [(r["iteration"], r["valid_lm_loss"]) for r in records if "valid_lm_loss" in r]
    assert [it for it, _ in valid] == list(range(interval, iters + 1, interval))
    end = records[-1]["end_valid_lm_loss"]
    assert math.isfinite(end) and records[-1]["end_valid_lm_ppl"] == pytest.approx(math.exp(end))
    assert valid[-1][1] < valid[0][1]  # validation loss falls too
    # the step's phases: forward-backward, its host part (issued, not waited for), the optimizer
    assert all(0 <= r["forward_backward_host_ms"] <= r["forward_backward_ms"] < r["step_ms"]
               and r["optimizer_ms"] >= 0 for r in records)
    return losses[0], losses[-1], valid, end


def test_data_path_run_learns_and_reports_validation_loss(data, spawn):
    records = spawn(train_records, 1, MODEL + [
        "--data-path", data["big"], "--train-iters", "20", "--lr", "1e-2",
        "--eval-interval", "10", "--eval-iters", "2"])[0]
    print("data-path:", _check_learns_and_validates(records, 20, 10))


def test_mock_data_run_learns_and_reports_validation_loss(spawn):
    records = spawn(train_records, 1, MODEL + [
        "--mock-data", "--train-iters", "20", "--lr", "1e-2", "--eval-interval", "10",
        "--eval-iters", "2"])[0]
    print("mock-data:", _check_learns_and_validates(records, 20, 10))


def test_validation_line_is_megatrons_format():
    from megatron_oases.evaluate import validation_line

    assert validation_line("iteration 10", 6.123456) == (
        " validation loss at iteration 10 | lm loss value: 6.123456E+00 | "
        "lm loss PPL: 4.564394E+02 | ")
    assert VALIDATION.match(validation_line("iteration 7 on validation set", 25.0))
    assert "PPL: 4.851652E+08" in validation_line("iteration 1", 25.0)  # exp(min(20, loss))


PARITY = MODEL + ["--train-iters", "6", "--optimizer", "sgd", "--lr", "0.05",
                  "--eval-interval", "3", "--eval-iters", "2"]


@pytest.fixture(scope="module")
def reference(data, spawn):
    return spawn(train_records, 1, PARITY + ["--data-path", data["big"]])[0]


@pytest.mark.parametrize("extra", [
    ["--tensor-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2"],
    [],  # data parallel 2
], ids=["tp2", "pp2", "dp2"])
def test_layouts_see_the_same_data(data, spawn, reference, extra):
    got = spawn(train_records, 2, PARITY + ["--data-path", data["big"]] + extra)[-1]
    for key in ("lm_loss", "valid_lm_loss", "end_valid_lm_loss"):
        pairs = [(r[key], w[key]) for r, w in zip(got, reference) if key in w]
        assert pairs and len(got) == len(reference)
        for it, (a, b) in enumerate(pairs, 1):
            assert abs(a - b) / abs(b) <= TOL, f"{key} #{it}: {a} vs one rank {b}"
