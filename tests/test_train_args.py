"""Bad input: one clear error line naming the flag, non-zero exit, no process group created."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from megatron_oases.flops import gpt_flops_per_iteration
from megatron_oases.train import main

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]


@pytest.mark.parametrize("argv, needle", [
    (["--nproc-per-node", "3", "--tensor-model-parallel-size", "2"],
     "world size 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--nproc-per-node", "4", "--tensor-model-parallel-size", "4", "--num-attention-heads", "6",
      "--hidden-size", "48"], "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    (["--nproc-per-node", "4", "--tensor-model-parallel-size", "4", "--hidden-size", "30",
      "--num-attention-heads", "4"], "--hidden-size 30 is not divisible by --tensor-model-parallel-size 4"),
    (["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "3"],
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
      "--num-layers-per-virtual-pipeline-stage", "3"], "--num-layers-per-virtual-pipeline-stage 3"),
    (["--nproc-per-node", "2", "--global-batch-size", "6", "--micro-batch-size", "2"],
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2"),
    (["--nproc-per-node", "1", "--topology", "/nonexistent/cluster.yaml"], "--topology"),
    (["--nproc-per-node", "2", "--use-distributed-optimizer", "--optimizer", "sgd"],
     "--use-distributed-optimizer needs --optimizer adam"),
    (["--nproc-per-node", "1", "--recompute-granularity", "full"], "--recompute-method"),
    (["--nproc-per-node", "4", "--tensor-model-parallel-size", "4", "--tp-backend", "atp",
      "--atp-mesh", "2,3"], "--atp-mesh 2,3: d1 x d2 = 6 must equal --tensor-model-parallel-size 4"),
    (["--nproc-per-node", "4", "--tensor-model-parallel-size", "4", "--tp-backend", "atp"],
     "--tp-backend atp needs --atp-mesh"),
    (["--nproc-per-node", "4", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--seq-length", "6", "--max-position-embeddings", "8"],
     "--sequence-parallel splits --seq-length 6 over --tensor-model-parallel-size 4"),
])
def test_bad_input_one_line_before_any_process_group(argv, needle, capsys):
    assert main(BASE + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert needle in err
    assert not dist.is_initialized()


def test_cli_exit_code_and_single_line():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "megatron_oases.cli", "train", "--nproc-per-node",
                           "3", "--tensor-model-parallel-size", "2"], capture_output=True,
                          text=True, cwd=root, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["megatron-oases train: error: world size 3 is not divisible by "
                     "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 = 2; "
                     "launch a multiple of 2 ranks or change TP/PP"], proc.stderr


def test_flops_formula_matches_narayanan_closed_form():
    # For G = H, f = 4h: 72 B s L h^2 (1 + s/(6h) + V/(12 L h))  (Narayanan et al., SC'21).
    B, s, L, h, V = 8, 1024, 24, 2048, 51200
    got = gpt_flops_per_iteration(global_batch_size=B, seq_length=s, num_layers=L, hidden_size=h,
                                  num_attention_heads=16, ffn_hidden_size=4 * h, padded_vocab_size=V)
    want = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert abs(got - want) / want < 1e-12
