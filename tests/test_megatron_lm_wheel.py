"""Megatron-LM's own ``pretrain`` through ``python -m megatron_oases.pretrain_gpt`` on CPU/gloo
ranks, with a checkout (``MEGATRON_LM_PATH``) or, from megatron-core 0.17, without one (the
wheel's ``megatron.training`` and ``megatron_lm.wheel_gpt``).

With ``--mock-data``, dropout off and CPU initialisation, stock TP 2, ``--schedule oases``,
``--tp-backend atp`` and ``--oases-plan`` log the same losses (rel 1e-5), a ``--load`` resume
logs the uninterrupted run's, and ``--tp-backend 3d`` on 8 ranks logs stock's (one rank). Without a
checkout on 0.16 (its wheel has no ``megatron.training``) the module skips, saying so. Stock TP 2,
the reference of every TP-2 build, is a torchrun launch; the builds run the entry's ``main`` on
forkserver ranks (``entry_on_ranks``: the same rank path, without torchrun's interpreter and
imports per rank), so each is compared with a real torchrun launch too. Every run has a deadline.

The helpers here (TINY, the plan file, ``torchrun_entry``, ``losses_of``, ``train``) are also
what ``tests/test_megatron_lm_checkout.py`` uses.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import signal
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKOUT = os.environ.get("MEGATRON_LM_PATH", "")
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 --train-iters 3 "
        "--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 "
        "--transformer-impl local --use-cpu-initialization --no-bias-gelu-fusion "
        "--no-bias-dropout-fusion --no-masked-softmax-fusion --no-persist-layer-norm "
        "--no-gradient-accumulation-fusion --no-rope-fusion").split()
CPU_TRAIN = TINY + ["--distributed-backend", "gloo", "--distributed-timeout-minutes", "2",
                    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
                    "--hidden-dropout", "0", "--attention-dropout", "0"]
needs_cpu = pytest.mark.skipif(__import__("torch").cuda.is_available(),
                               reason="the CPU training layer is only installed without CUDA")


def _plan_file() -> str:
    """A TP-2 plan for TINY's 2 layers: attention and MLP of layer 1 at degree 1, layer 2 at 2."""
    fd, path = tempfile.mkstemp(prefix="oases-plan-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"format": "megatron-oases-plan/1", "tensor_model_parallel_size": 2,
                   "num_layers": 2, "degrees": [1, 1, 2, 2]}, f)
    atexit.register(os.remove, path)  # made at collection: gone when pytest exits, not left in /tmp
    return path


PLAN = _plan_file()


def entry_source() -> str | None:
    """Where the entry takes pretrain_gpt.py's pieces: "checkout", "wheel" or None (neither)."""
    if CHECKOUT and os.path.isfile(os.path.join(CHECKOUT, "pretrain_gpt.py")):
        return "checkout"
    from megatron_oases import mcore_compat

    return "wheel" if mcore_compat.megatron_training_in_wheel() else None


def torchrun_entry(nproc, argv, timeout_s=300):
    """``torchrun --standalone --nproc-per-node nproc -m megatron_oases.pretrain_gpt argv``
    (with MEGATRON_LM_PATH when a checkout is set); the whole process group is killed at the
    deadline. Returns (returncode, stdout+stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if entry_source() != "checkout":
        env.pop("MEGATRON_LM_PATH", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "megatron_oases.pretrain_gpt", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"pretrain on {nproc} ranks passed its {timeout_s}s deadline:\n{out[-3000:]}")
    return proc.returncode, out


def entry_on_ranks(nproc, argv, timeout_s=300):
    """``megatron_oases.pretrain_gpt``'s ``main(argv)`` on ``nproc`` forkserver ranks
    (``tests/rank_fns_main.py``: the entry's own rank path without an interpreter per rank, 5-10 s
    less a launch, 20-40 s less at 8 ranks on 2 cores): (status, every rank's output)."""
    from tests.rank_fns_main import main_on_ranks

    env = {"MEGATRON_LM_PATH": CHECKOUT if entry_source() == "checkout" else ""}
    return main_on_ranks("megatron_oases.megatron_lm.pretrain_gpt", nproc, argv, timeout_s, env)


def losses_of(log):
    """{iteration: reported lm loss} from Megatron-LM's log lines."""
    import re

    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|", log)}


def train(nproc, extra, iters, timeout_s=300, torchrun=False):
    """Train ``iters`` iterations of CPU_TRAIN + ``extra``: (losses, log); asserts success. On
    forkserver ranks (``entry_on_ranks``) unless ``torchrun``."""
    launch = torchrun_entry if torchrun else entry_on_ranks
    rc, log = launch(nproc, CPU_TRAIN + ["--train-iters", str(iters)] + extra, timeout_s)
    assert rc == 0, log[-4000:]
    losses = losses_of(log)
    assert losses and max(losses) == iters, log[-3000:]
    assert all(math.isfinite(v) for v in losses.values())
    return losses, log


def _skip_without_entry():
    if entry_source() is None:
        pytest.skip("megatron-core 0.16's wheel has no megatron.training: set MEGATRON_LM_PATH "
                    "to a Megatron-LM checkout (tag core_v0.16.1) to run pretrain")


# TP 2 runs: 4 samples a step, so plan replicas (2) split every micro-batch.
TP2 = ["--tensor-model-parallel-size", "2", "--micro-batch-size", "4", "--global-batch-size", "4"]
ITERS = 6


@pytest.fixture(scope="module")
def stock_tp2():
    """Stock TP 2's losses (the reference of every TP-2 build), launched by torchrun."""
    _skip_without_entry()
    if __import__("torch").cuda.is_available():
        pytest.skip("the CPU training layer is only installed without CUDA")
    return train(2, TP2, ITERS, torchrun=True)[0]


def _same(losses, ref, what):
    assert losses.keys() == ref.keys(), (what, losses, ref)
    for k, v in losses.items():
        assert v == pytest.approx(ref[k], rel=1e-5), (what, k, losses, ref)


@needs_cpu
@pytest.mark.parametrize("extra", [["--schedule", "oases"], ["--sequence-parallel"]], ids=["oases", "sp"])
def test_pretrain_tp2_matches_stock(stock_tp2, extra):
    """Each build from the same weights: under the CPU layer the JIT warm-up, whose draws' shapes
    follow --sequence-parallel, does not run and so cannot move the CPU initialisation
    (``_no_jit_warmup``). ``--oases-plan PLAN`` against the same stock losses is
    test_pretrain_plan_with_distributed_optimizer_saves_and_resumes's saving run (and plans with
    the plain optimizer at TP 2, tests/test_megatron_lm_plans.py)."""
    _same(train(2, TP2 + extra, ITERS)[0], stock_tp2, extra)


@needs_cpu
def test_pretrain_atp_matches_stock_and_resumes(stock_tp2, tmp_path):
    """ATP (1,2) logs stock's losses and saves at 3; a resume from 3 logs them again.

    Megatron-LM logs a run's first iteration without resetting its loss sum, so the second line
    after a (re)start reports the mean of both iterations (upstream behaviour).
    """
    ckpt = str(tmp_path / "ckpt")
    atp = TP2 + ["--tp-backend", "atp", "--atp-mesh", "1,2"]
    saved, log = train(2, atp + ["--save", ckpt, "--save-interval", "3"], ITERS)
    assert "successfully saved checkpoint from iteration       3" in log
    _same(saved, stock_tp2, "atp")
    _resumes_as(train(2, atp + ["--load", ckpt, "--ckpt-step", "3"], ITERS), stock_tp2)


def _resumes_as(run, ref):
    """A resume from iteration 3 logs ``ref``'s losses (the second line: the mean of two)."""
    resumed, log = run
    assert "successfully loaded checkpoint" in log and sorted(resumed) == [4, 5, 6]
    assert resumed[4] == pytest.approx(ref[4], rel=1e-5)
    assert resumed[5] == pytest.approx((ref[4] + ref[5]) / 2, rel=1e-5)
    assert resumed[6] == pytest.approx(ref[6], rel=1e-5)


@needs_cpu
def test_pretrain_plan_with_distributed_optimizer_saves_and_resumes(stock_tp2, tmp_path):
    """``--oases-plan`` saves per-layer keys (its layers' shards differ in shape: one stacked key
    cannot hold them; the save failed before), and ``--use-distributed-optimizer`` resumes into
    torch's Adam (no Apex or TE; the load failed at ``assert len(steps) == 1`` before)."""
    ckpt = str(tmp_path / "ckpt")
    plan = TP2 + ["--oases-plan", PLAN, "--use-distributed-optimizer"]
    saved, log = train(2, plan + ["--save", ckpt, "--save-interval", "3"], ITERS)
    assert "successfully saved checkpoint from iteration       3" in log
    _same(saved, stock_tp2, "plan + distributed optimizer")
    _resumes_as(train(2, plan + ["--load", ckpt, "--ckpt-step", "3"], ITERS), stock_tp2)


@needs_cpu
def test_pretrain_3d_eight_ranks():
    """The cube through Megatron-LM's ``pretrain`` logs stock's losses (same CPU init): stock on
    one rank, whose CPU initialisation draws the same full weights stock TP 8 splits (a second
    8-rank launch for stock TP 8 cost about 40 s on 2 cores and checked the same numbers)."""
    _skip_without_entry()
    model = ["--num-attention-heads", "8", "--micro-batch-size", "4", "--global-batch-size", "4"]
    cube, _ = train(8, model + ["--tensor-model-parallel-size", "8", "--tp-backend", "3d"], 2,
                    timeout_s=540)
    stock, _ = train(1, model, 2)
    assert cube == pytest.approx(stock, rel=1e-5)


@needs_cpu
def test_pretrain_3d_bf16_saves_and_resumes(tmp_path):
    """The cube in bf16 with the plain optimizer saves at 2 and a resume from 2 logs the saving
    run's losses (its first line after the restart one iteration's, its second the mean of two).
    The save failed on the ranks off the cube diagonal (``KeyError``: the optimizer found no
    sharded tensor for their empty vectors), then the load (``Cannot merge two lists``)."""
    _skip_without_entry()
    ckpt = str(tmp_path / "ckpt")
    cube = ["--tensor-model-parallel-size", "8", "--num-attention-heads", "8", "--micro-batch-size",
            "4", "--global-batch-size", "4", "--tp-backend", "3d", "--bf16"]
    saved, log = train(8, cube + ["--save", ckpt, "--save-interval", "2"], 4, timeout_s=540)
    assert "successfully saved checkpoint from iteration       2" in log
    resumed, log = train(8, cube + ["--load", ckpt, "--ckpt-step", "2"], 4, timeout_s=540)
    assert "successfully loaded checkpoint" in log and sorted(resumed) == [3, 4]
    assert resumed[3] == pytest.approx(saved[3], rel=1e-6)
    assert resumed[4] == pytest.approx((saved[3] + saved[4]) / 2, rel=1e-6)


def test_entry_refuses_what_the_wheel_path_does_not_build(capsys, monkeypatch):
    """Without a checkout: options our megatron spec cannot honour on a stock run stop Megatron's
    ``parse_args`` with one line (exit 2), as for our other builds; flags of pretrain_gpt.py's
    other paths (SFT, FIM, ...) are named by ``wheel_gpt.refusal``."""
    if entry_source() != "wheel":
        pytest.skip("the no-checkout path needs megatron-core >= 0.17 and MEGATRON_LM_PATH unset")
    import megatron.training.arguments as margs

    from megatron_oases.megatron_lm import wheel_gpt
    from megatron_oases.megatron_lm.pretrain_gpt import entry_objects

    provider, extra = entry_objects(wheel_gpt)
    assert provider.stock is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")

    def parse(argv):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *CPU_TRAIN, *argv])
        return margs.parse_args(extra)

    args = parse([])
    assert not provider.uses_stock(args) and wheel_gpt.refusal(args) is None
    for argv, needle in ((["--num-experts", "2", "--moe-permute-fusion"], "does not support --moe-permute-fusion"),
                         (["--transformer-impl", "transformer_engine"], "--transformer-impl local")):
        with pytest.raises(SystemExit) as exc:
            parse(argv)
        errors = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
        assert exc.value.code == 2 and len(errors) == 1 and needle in errors[0], errors
        assert "without a Megatron-LM checkout" in errors[0]
    assert "--sft (packed SFT sequences) needs Megatron-LM's pretrain_gpt.py" in \
        wheel_gpt.refusal(parse(["--sft"]))
