"""Table of invalid launches: each exits 2 with one line naming the flag, before any process
group exists, and leaves nothing behind (issue 20's list and more; issue 37: loss scales, data
files that do not match their index or --vocab-size, messages that named another flag)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from megatron_oases.train import main
from tests.rank_fns_data import make_token_dataset, truncate, write_documents

BASE = ["--nproc-per-node", "1", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4"]
TP2 = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"]
TP4 = ["--nproc-per-node", "4", "--tensor-model-parallel-size", "4"]
ATP4 = TP4 + ["--tp-backend", "atp"]
PP2 = ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"]

CASES = [
    # (id, extra argv, text the one line must contain)
    ("gbs-0", ["--global-batch-size", "0"], "--global-batch-size must be >= 1 (got 0)"),
    ("gbs-neg", ["--global-batch-size", "-8"], "--global-batch-size must be >= 1"),
    ("mbs-0", ["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    ("vocab-div-0", ["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be >= 1"),
    ("vocab-div-neg", ["--make-vocab-size-divisible-by", "-1"], "--make-vocab-size-divisible-by must be >= 1"),
    ("ffn-0", ["--ffn-hidden-size", "0"], "--ffn-hidden-size must be >= 1 (got 0)"),
    ("timeout-0", ["--dist-timeout", "0"], "--dist-timeout must be > 0.0"),
    ("timeout-neg", ["--dist-timeout", "-5"], "--dist-timeout must be > 0.0"),
    ("lr-neg", ["--lr", "-1"], "--lr must be >= 0.0 (got -1.0)"),
    ("init-std-neg", ["--init-method-std", "-0.1"], "--init-method-std must be >= 0.0"),
    ("beta1-2", ["--adam-beta1", "2"], "--adam-beta1 must be [0.0, 1.0) (got 2.0)"),
    ("beta2-1", ["--adam-beta2", "1"], "--adam-beta2 must be [0.0, 1.0)"),
    ("adam-eps-0", ["--adam-eps", "0"], "--adam-eps must be > 0.0 (got 0.0)"),
    ("wd-neg", ["--weight-decay", "-1"], "--weight-decay must be >= 0.0"),
    ("clip-neg", ["--clip-grad", "-1"], "--clip-grad must be >= 0.0"),
    ("momentum-1", ["--optimizer", "sgd", "--sgd-momentum", "1.5"], "--sgd-momentum must be [0.0, 1.0)"),
    ("hidden-dropout-1", ["--hidden-dropout", "1.0"], "--hidden-dropout must be [0.0, 1.0)"),
    ("attn-dropout-neg", ["--attention-dropout", "-0.1"], "--attention-dropout must be [0.0, 1.0)"),
    ("iters-0", ["--train-iters", "0"], "--train-iters must be >= 1"),
    ("seq-0", ["--seq-length", "0"], "--seq-length must be >= 1"),
    ("vocab-0", ["--vocab-size", "0"], "--vocab-size must be >= 1"),
    ("log-interval-0", ["--log-interval", "0"], "--log-interval must be >= 1"),
    ("log-json-missing-dir", ["--log-json", "/nonexistent/dir/log.jsonl"], "--log-json /nonexistent/dir/log.jsonl: directory"),
    ("log-json-is-dir", ["--log-json", "/tmp"], "--log-json /tmp is a directory"),
    ("log-json-read-only", ["--log-json", "/proc/log.jsonl"], "--log-json /proc/log.jsonl: /proc is not a writable directory"),
    ("save-read-only", ["--save", "/proc/ckpt"], "--save /proc/ckpt: /proc is not a writable directory"),
    ("nproc-0", ["--nproc-per-node", "0"], "--nproc-per-node must be >= 1"),
    ("tp-0", ["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1"),
    ("layers-0", ["--num-layers", "0"], "--num-layers must be >= 1"),
    ("world-not-divisible", ["--nproc-per-node", "3", "--tensor-model-parallel-size", "2"], "world size 3 is not divisible"),
    ("heads-tp", TP4 + ["--num-attention-heads", "6", "--hidden-size", "48"], "--num-attention-heads 6 is not divisible"),
    ("hidden-heads", ["--hidden-size", "30", "--num-attention-heads", "4"], "--hidden-size 30 is not divisible by --num-attention-heads 4"),
    ("ffn-tp", TP2 + ["--ffn-hidden-size", "33"], "--ffn-hidden-size 33 is not divisible"),
    ("layers-pp", PP2 + ["--num-layers", "3"], "--num-layers 3 is not divisible"),
    ("vp-not-divisor", PP2 + ["--num-layers-per-virtual-pipeline-stage", "3"], "--num-layers-per-virtual-pipeline-stage 3 must divide"),
    ("vp-equals-stage", PP2 + ["--num-layers-per-virtual-pipeline-stage", "2"],
     "--num-layers-per-virtual-pipeline-stage 2 equals the layers of each pipeline stage (one virtual stage: no interleaving); use 1 (2 virtual stages) or drop the flag"),
    ("vp-equals-one-layer-stage", PP2 + ["--num-layers", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     "a stage of 1 layer cannot be split into virtual stages, so drop the flag"),
    ("vp-0", PP2 + ["--num-layers-per-virtual-pipeline-stage", "0"], "error: --num-layers-per-virtual-pipeline-stage must be >= 1 (got 0)"),
    ("vp-without-pp", ["--num-layers-per-virtual-pipeline-stage", "2"], "needs --pipeline-model-parallel-size >= 2"),
    ("gbs-split", ["--nproc-per-node", "2", "--global-batch-size", "6"], "--global-batch-size 6 is not divisible"),
    ("interleaved-microbatches", PP2 + ["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6"], "multiple of --pipeline-model-parallel-size 2"),
    ("max-pos", ["--max-position-embeddings", "8", "--seq-length", "16"], "--max-position-embeddings 8 is smaller"),
    ("bf16-fp16", ["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    # loss scales: Megatron's grad scalers assert them on every rank (issue 37)
    ("fp16-loss-scale-neg", ["--fp16", "--loss-scale", "-1"], "--loss-scale must be a finite number > 0 (got -1.0)"),
    ("fp16-loss-scale-0", ["--fp16", "--loss-scale", "0"], "--loss-scale must be a finite number > 0 (got 0.0)"),
    ("bf16-loss-scale-inf", ["--bf16", "--loss-scale", "inf"], "--loss-scale must be a finite number > 0 (got inf)"),
    ("loss-scale-fp32", ["--loss-scale", "8"], "--loss-scale 8.0 has no effect in fp32 training"),
    ("fp16-initial-loss-scale-0", ["--fp16", "--initial-loss-scale", "0"], "--initial-loss-scale must be a finite number >= 1.0, Megatron's minimum loss scale (got 0.0)"),
    ("fp16-initial-loss-scale-below-min", ["--fp16", "--initial-loss-scale", "0.5"], "--initial-loss-scale must be a finite number >= 1.0"),
    ("initial-loss-scale-bf16", ["--bf16", "--initial-loss-scale", "1024"], "--initial-loss-scale 1024.0 starts --fp16's dynamic loss scaling and has no effect without it"),
    ("initial-and-constant-loss-scale", ["--fp16", "--loss-scale", "8", "--initial-loss-scale", "1024"], "--initial-loss-scale 1024.0 has no effect with --loss-scale 8.0"),
    ("recompute-method", ["--recompute-granularity", "full"], "--recompute-method"),
    ("recompute-method-alone", ["--recompute-method", "uniform"], "need --recompute-granularity full"),
    ("recompute-layers-0", ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"], "--recompute-num-layers must be >= 1"),
    ("topology-missing", ["--topology", "/nonexistent/cluster.yaml"], "--topology"),
    ("atp-no-mesh", ATP4, "--tp-backend atp needs --atp-mesh"),
    # flags that would be accepted and ignored (issue 34's review: a flag takes effect or is refused)
    ("atp-chunks-without-atp", ["--atp-chunks", "2"], "--atp-chunks 2 splits ATP's layers and has no effect without --tp-backend atp"),
    ("cross-pass-without-oases", ["--no-oases-cross-pass"], "--no-oases-cross-pass switches part of the Oases executor and has no effect with the default schedule"),
    ("fine-grained-without-oases", ["--no-oases-fine-grained-recompute"], "--no-oases-fine-grained-recompute switches part of the Oases executor"),
    ("fine-grained-without-recompute", TP2 + ["--schedule", "oases", "--no-oases-fine-grained-recompute"],
     "--no-oases-fine-grained-recompute chooses how Oases recomputes and has no effect without --recompute-granularity full"),
    ("oases-ablation-tp1", ["--schedule", "oases", "--no-oases-cross-pass"],
     "--no-oases-cross-pass has no effect at --tensor-model-parallel-size 1"),
    ("skip-tp-collectives-tp1", ["--oases-skip-tp-collectives"],
     "--oases-skip-tp-collectives has no effect at --tensor-model-parallel-size 1"),
    ("sgd-momentum-with-adam", ["--sgd-momentum", "0.5"], "--sgd-momentum 0.5 has no effect with --optimizer adam"),
    ("adam-beta-with-sgd", ["--optimizer", "sgd", "--adam-beta1", "0.8"], "--adam-beta1 0.8 has no effect with --optimizer sgd"),
    ("no-load-optim-without-load", ["--no-load-optim"], "--no-load-optim chooses what --load restores and has no effect without it"),
    ("no-load-rng-without-load", ["--no-load-rng"], "--no-load-rng chooses what --load restores"),
    ("no-verify-integrity-alone", ["--no-verify-integrity"], "--no-verify-integrity skips the checksums of --save and --load"),
    ("atp-mesh-product", ATP4 + ["--atp-mesh", "2,3"], "--atp-mesh 2,3: d1 x d2 = 6 must equal"),
    ("atp-mesh-negative", ATP4 + ["--atp-mesh=-1,-2"], "--atp-mesh -1,-2: both mesh axes must be >= 1"),
    ("atp-mesh-garbage", ATP4 + ["--atp-mesh", "two"], "--atp-mesh must be D1,D2"),
    ("atp-mesh-stray", ["--atp-mesh", "1,1"], "--atp-mesh needs --tp-backend atp"),
    ("atp-auto-no-topology", ATP4 + ["--atp-mesh", "auto"], "--atp-mesh auto needs --topology"),
    ("3d-not-cube", TP4 + ["--tp-backend", "3d"], "--tp-backend 3d"),
    ("oases-mbs-1", TP2 + ["--schedule", "oases", "--micro-batch-size", "1", "--global-batch-size", "2"], "--micro-batch-size >= 2"),
    ("oases-recompute-num-layers", TP2 + ["--schedule", "oases", "--recompute-granularity", "full",
                                          "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     "--recompute-num-layers 2 has no effect with --schedule oases"),
    ("oases-selective", TP2 + ["--schedule", "oases", "--recompute-granularity", "selective"], "--recompute-granularity selective cannot be combined"),
    ("atp-selective", ATP4 + ["--atp-mesh", "2,2", "--recompute-granularity", "selective"],
     "--recompute-granularity selective has no effect with --tp-backend atp"),
    ("3d-selective", ["--nproc-per-node", "8", "--tensor-model-parallel-size", "8", "--tp-backend", "3d",
                      "--num-attention-heads", "8", "--micro-batch-size", "4", "--global-batch-size", "4",
                      "--recompute-granularity", "selective"],
     "--recompute-granularity selective has no effect with --tp-backend 3d"),
    ("skip-tp-collectives-stock-sp", TP2 + ["--sequence-parallel", "--oases-skip-tp-collectives"], "--oases-skip-tp-collectives with the default schedule needs --tp-backend megatron without --sequence-parallel"),
    ("plan-missing", TP2 + ["--oases-plan", "/nonexistent/plan.json"], "--oases-plan"),
    ("sp-tp1", ["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    # Llama-family flags (issue 19)
    ("gqa-groups-without-gqa", ["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    # the flag the user gave, not one derived from it (issue 37)
    ("hidden-neg", ["--hidden-size", "-64"], "error: --hidden-size must be >= 1 (got -64)"),
    ("swiglu-small-hidden", ["--swiglu", "--hidden-size", "16"], "error: --swiglu with --hidden-size 16 gives Megatron-LM's default FFN size int(4h x 2/3 / 64) x 64 = 0"),
    ("heads-0", ["--num-attention-heads", "0"], "error: --num-attention-heads must be >= 1 (got 0)"),
    ("gqa-groups-neg", ["--group-query-attention", "--num-query-groups", "-2"], "error: --num-query-groups must be >= 1 (got -2)"),
    ("gqa-groups-0", ["--group-query-attention", "--num-query-groups", "0"], "error: --num-query-groups must be >= 1 (got 0)"),
    ("gqa-groups-not-dividing-heads", ["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3 must divide --num-attention-heads 4"),
    ("gqa-groups-tp", TP4 + ["--group-query-attention", "--num-query-groups", "2"], "--num-query-groups 2 must be divisible by the --tensor-model-parallel-size 4"),
    ("rotary-percent-0", ["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent must be in (0, 1]"),
    ("rotary-percent-big", ["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "--rotary-percent must be in (0, 1]"),
    ("rotary-without-rope", ["--rotary-base", "500"], "--rotary-base applies to --position-embedding-type rope only"),
    ("atp-gqa-groups", ATP4 + ["--atp-mesh", "2,2", "--group-query-attention", "--num-query-groups", "2"],
     "--tp-backend atp gives each of its 4 ranks whole key/value groups: --num-query-groups 2 must be divisible"),
    ("3d-swiglu-bias", ["--nproc-per-node", "8", "--tensor-model-parallel-size", "8", "--tp-backend", "3d",
                        "--num-attention-heads", "8", "--micro-batch-size", "4", "--global-batch-size", "4",
                        "--swiglu"],
     "--tp-backend 3d runs --swiglu without linear biases only"),
    # checkpoint steps: iteration_dir would name iter_-000001 (issue 48)
    ("ckpt-step-neg", ["--load", "ck", "--ckpt-step", "-1"],
     "--ckpt-step must be >= 0 (got -1): give an iteration saved in ck (none)"),
    # argparse's own errors: one line too, without the usage block.
    ("backend-unknown", ["--tp-backend", "bogus"], "argument --tp-backend: invalid choice: 'bogus'"),
    ("schedule-unknown", ["--schedule", "fast"], "argument --schedule: invalid choice"),
    ("int-not-int", ["--num-layers", "four"], "argument --num-layers: invalid int value"),
    ("flag-unknown", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # Megatron-LM's FSDP wrappers: the trainer has no such flag (its DDP shards nothing)
    ("fsdp2", ["--use-torch-fsdp2"], "unrecognized arguments: --use-torch-fsdp2"),
]
if not torch.cuda.is_available():
    CASES.append(("device-cuda-absent", ["--device", "cuda"], "--device cuda: no CUDA device is visible"))


def _run(argv):
    """main(argv) -> exit code, argparse's SystemExit included."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("extra, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_launch_one_line_exit_2_no_process_group(extra, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _run(BASE + extra) == 2
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1, out.err
    assert needle in lines[0], lines[0]
    assert lines[0].startswith("megatron-oases train: error: ")
    assert not dist.is_initialized()
    assert os.listdir(tmp_path) == []  # nothing written


def test_nproc_per_node_under_an_srun_step_of_several_tasks(capsys, tmp_path, monkeypatch):
    """``srun -n 2 megatron-oases train --nproc-per-node N``: srun sets no RANK, so each task
    would spawn a world of its own (two separate runs, each exiting 0): refused in one line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    assert _run(BASE) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "this srun step has 2 tasks" in lines[0], lines
    assert not dist.is_initialized() and os.listdir(tmp_path) == []


def test_table_has_at_least_40_launches():
    assert len(CASES) + len(DATA_CASES) >= 40


def test_min_loss_scale_is_megatrons():
    from megatron.core.optimizer import OptimizerConfig

    from megatron_oases.train_args import MIN_LOSS_SCALE

    assert MIN_LOSS_SCALE == OptimizerConfig.min_loss_scale


# --data-path files that start every rank today and fail there, after Megatron has written its
# index cache beside them (issue 37). Vocabulary 256, eod 255; "wide" was written for 512 ids.
DATA_CASES = [
    ("bin-truncated", "cut_bin", [], "cut_bin.bin is 31290 bytes but {d}/cut_bin.idx indexes 31300 (300 sequences of uint16 tokens): the .bin is truncated"),
    ("idx-truncated", "cut_idx", [], "cut_idx.idx is 6034 bytes but its header (300 sequences, 301 documents) needs 6042"),
    ("idx-header-only", "stub", [], "stub.idx is 20 bytes, shorter than Megatron's 34-byte index header"),
    ("ids-over-vocab", "wide", [], "wide.bin holds token id 261 (token 0) outside [0, --vocab-size 256)"),
    ("ids-over-vocab-blend", "0.5 good 0.5 wide", [], "wide.bin holds token id 261"),
    # a .bin past the scan bound is read in evenly spread windows; the last one ends the file
    ("ids-over-vocab-windowed", "last_bad", ["SCAN_BYTES=1024"], "last_bad.bin holds token id 300 (token 15299) outside [0, --vocab-size 256)"),
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_data")
    good = str(d / "good")
    make_token_dataset(good, num_docs=300, vocab_size=256, seed=0)
    make_token_dataset(str(d / "wide"), num_docs=300, vocab_size=512, seed=0)
    for name in ("cut_bin", "cut_idx", "stub"):
        for ext in (".bin", ".idx"):
            shutil.copy(good + ext, str(d / name) + ext)
    truncate(str(d / "cut_bin.bin"), 10)
    truncate(str(d / "cut_idx.idx"), 8)
    truncate(str(d / "stub.idx"), os.path.getsize(str(d / "stub.idx")) - 20)
    write_documents(str(d / "last_bad"), [[1] * 99 + [255]] * 152 + [[1] * 99 + [300]],
                    vocab_size=512)
    return d


@pytest.mark.parametrize("path, patch, needle", [c[1:] for c in DATA_CASES],
                         ids=[c[0] for c in DATA_CASES])
def test_bad_data_one_line_exit_2_nothing_written(path, patch, needle, data_dir, capsys, tmp_path,
                                                  monkeypatch):
    from megatron_oases import datasets

    for assignment in patch:
        name, value = assignment.split("=")
        monkeypatch.setattr(datasets, name, int(value))
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(data_dir))
    paths = [w if w[0].isdigit() else str(data_dir / w) for w in path.split()]
    assert _run(BASE + ["--vocab-size", "256", "--data-path", *paths]) == 2
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1, out.err
    assert needle.format(d=data_dir) in lines[0], lines[0]
    assert lines[0].startswith(f"megatron-oases train: error: --data-path {data_dir}/")
    assert not dist.is_initialized()
    assert sorted(os.listdir(data_dir)) == before  # no index cache beside the data
    assert os.listdir(tmp_path) == []


def test_good_data_passes_the_checks(data_dir):
    """The checks refuse only what is wrong: the intact file at its vocabulary, and the wide one
    at 512, pass (here without starting a run)."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    for prefix, vocab in (("good", "256"), ("wide", "512")):
        args = build_parser().parse_args(BASE + ["--vocab-size", vocab, "--data-path",
                                                 str(data_dir / prefix)])
        validate_config(run_config(args), 1, cuda=False)
