"""``--atp-mesh auto``: the trainer picks the mesh with `megatron-oases mesh`'s search before any
process group exists, prints it once, and fails with one line when it cannot."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from megatron_oases.errors import ConfigError
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.plan.atp_mesh import search_mesh
from megatron_oases.train import main
from megatron_oases.run_config import run_config
from megatron_oases.train_args import build_parser, validate_config

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--tp-backend", "atp", "--atp-mesh", "auto"]
BIG = ["--num-layers", "24", "--hidden-size", "4096", "--num-attention-heads", "32",
       "--seq-length", "2048", "--micro-batch-size", "4", "--global-batch-size", "4",
       "--tp-backend", "atp", "--atp-mesh", "auto"]


def _validate(argv, world):
    return validate_config(run_config(build_parser().parse_args(argv)), world, cuda=False)


@pytest.mark.parametrize("argv, needle", [
    (["--nproc-per-node", "4", "--tensor-model-parallel-size", "4"],
     "--atp-mesh auto needs --topology FILE"),
    (["--nproc-per-node", "4", "--tensor-model-parallel-size", "4", "--topology",
      "/nonexistent/cluster.yaml"], "--topology"),
    # a TP group of 3 cannot fill whole units of dgx-a100's 8-GPU level
    (["--nproc-per-node", "3", "--tensor-model-parallel-size", "3", "--topology", "dgx-a100",
      "--num-attention-heads", "3", "--hidden-size", "48"],
     "--atp-mesh auto on --topology dgx-a100: tp=3 does not match the levels"),
])
def test_auto_bad_input_one_line_before_any_process_group(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(BASE + argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert needle in err
    assert captured.out == ""
    assert not dist.is_initialized()


# ATP's Machine B (A100 NVLink pairs, 300 GB/s each way, on 32 GB/s PCIe): (2, 2) saves 20%; on
# nvlink-pairs' RTX 3090 bridges (56.25 GB/s each way over 12 GB/s PCIe) it saves 8%, under the margin.
MACHINE_B = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "validation",
                         "topologies", "atp-machine-b.yaml")


@pytest.mark.parametrize("topology, tp, want", [("fig7a", 16, (4, 4)), ("dgx-a100", 8, (8, 1)),
                                                (MACHINE_B, 4, (2, 2)), ("nvlink-pairs", 4, (4, 1))])
def test_auto_picks_what_mesh_search_picks(topology, tp, want, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    args = _validate(BIG + ["--tensor-model-parallel-size", str(tp), "--topology", topology], tp)
    shape = GPTShape(hidden_size=4096, num_layers=24, num_attention_heads=32, micro_batch_size=4, seq_length=2048,
                     dtype="fp32")
    choice = search_mesh(topology, tp, shape)
    assert args.atp_mesh == (choice.pick.d1, choice.pick.d2) == want
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    assert out[0].startswith(f"--atp-mesh auto: DeviceMesh({want[0]},{want[1]})"), out
    assert f"predicted T_comm {choice.pick.t_comm_s * 1e3:.3f} ms" in out[0], out
    assert f"topology {choice.topology}" in out[0], out


def test_auto_uses_pipeline_stage_layers_and_dtype(capsys):
    """Eq. 2 is per pipeline stage (L / PP layers), with 4-byte fp32 activations on CPU."""
    args = _validate(BIG + ["--tensor-model-parallel-size", "16", "--topology", "fig7a",
                            "--pipeline-model-parallel-size", "2"], 32)
    shape = GPTShape(hidden_size=4096, num_layers=12, num_attention_heads=32, micro_batch_size=4, seq_length=2048,
                     dtype="fp32")
    pick = search_mesh("fig7a", 16, shape).pick
    assert args.atp_mesh == (pick.d1, pick.d2)
    assert f"predicted T_comm {pick.t_comm_s * 1e3:.3f} ms" in capsys.readouterr().out


@pytest.mark.parametrize("ffn, want", [(16384, (2, 4)), (32768, (8, 1))])
def test_auto_prices_the_runs_ffn(ffn, want, capsys, monkeypatch):
    """The search prices the layer the run builds: on longhorn-v100 at TP 8, doubling
    --ffn-hidden-size moves the pick from DeviceMesh(2, 4) to Megatron's (8, 1), whose all-reduces
    do not grow with the FFN. (Was: (2, 4) for both, priced at 4h.)"""
    monkeypatch.delenv("RANK", raising=False)
    cfg = _validate(BIG + ["--tensor-model-parallel-size", "8", "--topology", "longhorn-v100",
                           "--ffn-hidden-size", str(ffn)], 8)
    assert cfg.atp_mesh == want
    assert f"h=4096 ffn={ffn} heads=32 L=24" in capsys.readouterr().out


def test_auto_prints_once_on_rank_zero_only(capsys, monkeypatch):
    argv = BIG + ["--tensor-model-parallel-size", "8", "--topology", "dgx-a100"]
    monkeypatch.setenv("RANK", "3")
    args = _validate(argv, 8)
    assert args.atp_mesh == (8, 1)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    args = build_parser().parse_args(argv)
    cfg = validate_config(run_config(args), 8, cuda=False)
    again = validate_config(cfg, 8, cuda=False)  # train.setup validates again: already resolved, silent
    assert cfg.atp_mesh == again.atp_mesh == (8, 1) and args.atp_mesh == "auto"  # args untouched
    assert len(capsys.readouterr().out.strip().splitlines()) == 1


def test_auto_keeps_explicit_mesh_checks():
    with pytest.raises(ConfigError, match="--atp-mesh needs --tp-backend atp"):
        _validate(["--atp-mesh", "auto", "--topology", "dgx-a100"], 1)


def test_auto_trains_with_the_picked_mesh():
    """End to end in a fresh process (so the spawned ranks' output is captured too): 4 ranks on
    ATP's Machine B train with the picked DeviceMesh(2, 2), and the pick is printed once (by the
    launcher, not again by every rank)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = ["--nproc-per-node", "4", "--tensor-model-parallel-size", "4", "--topology",
            MACHINE_B, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
            "4", "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1", "--device", "cpu", "--dist-timeout", "60",
            "--tp-backend", "atp", "--atp-mesh", "auto"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "megatron_oases.cli", "train", *argv],
                          capture_output=True, text=True, cwd=root, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    picks = [ln for ln in proc.stdout.splitlines() if ln.startswith("--atp-mesh auto:")]
    assert len(picks) == 1 and "DeviceMesh(2,2) (ATP-2)" in picks[0], proc.stdout
    assert "iteration        1/       1 | lm loss:" in proc.stdout, proc.stdout
