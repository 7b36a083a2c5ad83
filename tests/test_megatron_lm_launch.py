"""Start-up of the two launch paths (issue 48): what is refused before torch and Megatron load,
what Megatron-LM's loop is refused before it hangs, the CPU layer the patched checkout gets, and
the one line naming what was built.

* a bad flag of the trainer, and one our flags decide alone through the Megatron-LM entry, is
  refused in one line with neither torch nor Megatron imported (``sys.modules`` of a fresh
  interpreter; no timing);
* a small ``--data-path`` corpus whose default 969,30,1 split leaves the test split no
  documents is refused by the entry at parse time (Megatron-LM would hang building it);
* ``hooks.wrap_entry`` (what the patched checkout calls) installs the CPU training layer, so
  Megatron-LM's own ``parse_and_validate_args`` at TP 2 passes on CPU (it died on "Found no
  NVIDIA driver") and the CUDA-only default ``--distributed-backend nccl`` is refused in one line;
  the layer skips ``set_jit_fusion_options``' warm-up;
* with a checkout (``MEGATRON_LM_PATH``), the patched ``pretrain_gpt.py`` trains at TP 2 on CPU
  and prints the build line.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.test_megatron_lm_wheel import CPU_TRAIN, ROOT, entry_source, losses_of, needs_cpu

HEAVY = ("torch", "megatron")
CHECKOUT = os.environ.get("MEGATRON_LM_PATH", "")


def _python(code: str, env: dict | None = None, timeout: float = 300):
    """``code`` in a fresh interpreter at the repository root, without the launcher's variables
    unless ``env`` sets them; (exit status, stdout, stderr)."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGATRON_LM_PATH")}
    full["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    full.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, env=full, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def _light_main(module: str, argv: list[str]):
    """``module.main(argv)`` in a fresh interpreter: (its status, stderr, heavy modules loaded)."""
    code = f"""
        import sys
        from {module} import main
        try:
            rc = main({argv!r})
        except SystemExit as exc:  # argparse's own errors exit
            rc = exc.code
        print(rc, ','.join(m for m in {HEAVY!r} if m in sys.modules))
    """
    rc, stdout, stderr = _python(code)
    assert rc == 0, stderr
    status, _, heavy = stdout.strip().splitlines()[-1].partition(" ")
    return int(status), stderr, [m for m in heavy.split(",") if m]


@pytest.mark.parametrize("argv, needle", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--nproc-per-node", "4", "--tensor-model-parallel-size", "3"],
     "world size 4 is not divisible by --tensor-model-parallel-size 3"),
    (["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--tp-backend", "atp",
      "--atp-mesh", "2,2"], "--atp-mesh 2,2: d1 x d2 = 4"),
    (["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--schedule", "oases",  # at TP 1 nothing splits
      "--micro-batch-size", "3", "--global-batch-size", "6"], "splits each micro-batch into 2"),
], ids=["unknown", "world", "mesh", "split"])
def test_trainer_refuses_bad_flags_before_torch(argv, needle):
    status, err, heavy = _light_main("megatron_oases.cli", ["train", *argv])
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and needle in lines[0], err
    assert heavy == []


@pytest.mark.parametrize("argv, needle", [
    (["--tensor-model-parallel-size", "2", "--tp-backend", "atp", "--atp-mesh", "2,2"],
     "--atp-mesh 2,2: d1 x d2 = 4 must equal --tensor-model-parallel-size 2"),
    (["--tp-backend", "2d"], "argument --tp-backend: invalid choice: '2d'"),
    (["--atp-mesh", "1,2"], "--atp-mesh needs --tp-backend atp"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--micro-batch-size", "3"],
     "splits each micro-batch into 2"),  # at TP 1 nothing splits (describe.split.oases_splits)
], ids=["mesh", "choice", "stray", "split"])
def test_entry_refuses_our_flags_before_torch_and_megatron(argv, needle):
    status, err, heavy = _light_main("megatron_oases.megatron_lm.pretrain_gpt",
                                     CPU_TRAIN + argv)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert "megatron_oases.pretrain_gpt: error: " in lines[0] and needle in lines[0]
    assert heavy == []


def test_early_refusal_passes_what_megatron_must_decide():
    """Only what our flags decide alone: a run it cannot judge goes on to Megatron-LM's parse."""
    from megatron_oases.megatron_lm.flags import early_refusal

    assert early_refusal(CPU_TRAIN + ["--tp-backend", "atp", "--atp-mesh", "1,2",
                                      "--tensor-model-parallel-size", "2"]) is None
    assert early_refusal(CPU_TRAIN + ["--tp-backend", "atp", "--atp-mesh", "2,2"]) is None  # TP not given
    assert early_refusal(["--data-path", "1", "a", "--schedule", "oases"]) is None


# ---- --data-path: a split with no documents --------------------------------------------------
def test_entry_refuses_a_split_without_documents(tmp_path):
    """300 documents: 969,30,1 gives the test split round(0.3) = 0 of them, which Megatron-LM's
    loop builds even with --eval-iters 0 and never finishes indexing: refused at parse, one line,
    naming the split; 969,30,0 builds no test split and passes the check."""
    if entry_source() is None:
        pytest.skip("no megatron.training: megatron-core 0.16 without MEGATRON_LM_PATH")
    from megatron_oases.datasets import check_split_documents
    from megatron_oases.errors import ConfigError
    from tests.rank_fns_data import make_token_dataset

    prefix = str(tmp_path / "docs")
    make_token_dataset(prefix, num_docs=300, vocab_size=256)
    with pytest.raises(ConfigError, match="leaves the test split"):
        check_split_documents([prefix], None)
    check_split_documents([prefix], "969,30,0")
    argv = [a for a in CPU_TRAIN if a != "--mock-data"] + ["--data-path", prefix]
    code = f"""
        import sys
        from megatron_oases.megatron_lm.pretrain_gpt import main
        try:
            rc = main({argv!r})
        except SystemExit as exc:
            rc = exc.code
        import torch.distributed as dist
        print(rc, dist.is_initialized())
    """
    rc, stdout, stderr = _python(code, env={"WORLD_SIZE": "1", "RANK": "0"})
    assert rc == 0, stderr
    assert stdout.strip().splitlines()[-1] == "2 False", stdout[-2000:]
    errors = [ln for ln in stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and f"--split 969,30,1 leaves the test split of --data-path {prefix} " \
        "no documents (it has 300)" in errors[0], stderr[-2000:]


# ---- the CPU layer: the patched checkout's path ------------------------------------------------
@needs_cpu
def test_wrap_entry_lets_megatron_validate_tp2_on_cpu():
    """What the patched checkout (core_v0.18+) runs before ``pretrain``: ``wrap_entry``, then
    Megatron-LM's ``parse_and_validate_args``. At TP 2 its ``validate_args`` asked the GPU for its
    architecture ("Found no NVIDIA driver"); with the CPU layer it passes, the CUDA-only default
    ``--distributed-backend nccl`` is refused in one line, and the JIT warm-up is skipped."""
    if entry_source() is None:
        pytest.skip("no megatron.training: megatron-core 0.16 without MEGATRON_LM_PATH")
    argv = [a for a in CPU_TRAIN] + ["--tensor-model-parallel-size", "2"]
    nccl = [a for a in argv if a not in ("--distributed-backend", "gloo")]
    # one interpreter for both argv (a second one cost another import of megatron.training): the
    # gloo one validates, then the nccl one must stop Megatron's parse with one line, status 2
    code = f"""
        import sys
        from megatron_oases import mcore_compat
        from megatron_oases.megatron_lm.hooks import wrap_entry
        from megatron_oases.megatron_lm import wheel_gpt
        provider, extra = wrap_entry(None, None)
        import megatron.training.arguments as arguments
        import megatron.training.initialize as initialize
        import megatron.training.training as training
        initialize._warmup_jit_function = lambda *a, **k: 1 / 0  # the warm-up must not run
        assert training.set_jit_fusion_options(tp_size=2) is None
        def validate(argv):
            sys.argv = ['pretrain_gpt.py', *argv]
            if hasattr(arguments, 'parse_and_validate_args'):
                return arguments.parse_and_validate_args(extra_args_provider=extra,
                    args_defaults={{'tokenizer_type': 'GPT2BPETokenizer'}})
            args = arguments.parse_args(extra)  # 0.17: pretrain parses and validates
            arguments.validate_args(args, {{'tokenizer_type': 'GPT2BPETokenizer'}})
            return args
        args = validate({argv!r})
        print('validated', args.tensor_model_parallel_size, provider.uses_stock(args), flush=True)
        print('--- nccl', file=sys.stderr, flush=True)
        validate({nccl!r})
        print('nccl validated')
    """
    rc, stdout, stderr = _python(code, env={"WORLD_SIZE": "2", "RANK": "0"})
    assert "validated 2 False" in stdout, stderr[-3000:]
    before, _, after = stderr.partition("--- nccl\n")
    assert not [ln for ln in before.splitlines() if "error:" in ln], before[-3000:]
    errors = [ln for ln in after.splitlines() if "error:" in ln]
    assert rc == 2 and "nccl validated" not in stdout, stdout[-2000:] + stderr[-3000:]
    assert len(errors) == 1 and "--distributed-backend gloo" in errors[0], stderr[-3000:]


@needs_cpu
@pytest.mark.skipif(not CHECKOUT or not os.path.isfile(os.path.join(CHECKOUT, "pretrain_gpt.py")),
                    reason="needs a Megatron-LM checkout: set MEGATRON_LM_PATH")
def test_patched_checkout_trains_tp2_on_cpu(tmp_path):
    """The checkout's own ``pretrain_gpt.py``, patched, at TP 2 with --schedule oases on CPU
    ranks: it trains (Megatron's loss lines) and names what it built. The patched script sits in
    a folder of links to the checkout, which stays untouched."""
    mlm = tmp_path / "mlm"
    mlm.mkdir()
    for name in os.listdir(CHECKOUT):
        if name != "pretrain_gpt.py":
            os.symlink(os.path.join(CHECKOUT, name), mlm / name)
    (mlm / "pretrain_gpt.py").write_text(open(os.path.join(CHECKOUT, "pretrain_gpt.py")).read())
    patch = subprocess.run(["bash", os.path.join(ROOT, "scripts/apply_patches.sh"), str(mlm)],
                           capture_output=True, text=True, timeout=60)
    assert patch.returncode == 0, patch.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MEGATRON_LM_PATH")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(mlm / "pretrain_gpt.py"), *CPU_TRAIN, "--train-iters", "2",
           "--tensor-model-parallel-size", "2", "--schedule", "oases"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(mlm), env=env, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert sorted(losses_of(log)) == [1, 2], log[-3000:]
    assert "megatron_oases: model --tp-backend megatron (1-D TP) | --schedule oases | no plan | " \
           "TP 2 x PP 1 x DP 1 on 2 ranks | cpu, gloo" in log


# ---- the build line --------------------------------------------------------------------------
def test_build_line_names_backend_layout_executor_and_plan():
    from megatron_oases.run_config import RunConfig
    from megatron_oases.specs import build_line

    line = build_line(RunConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                tp_backend="atp", atp_mesh=(1, 2), schedule="oases"),
                      world=8, device="cpu", dist_backend="gloo")
    assert line == ("megatron_oases: model --tp-backend atp (mesh 1x2, --atp-chunks 1) | "
                    "--schedule oases | no plan | TP 2 x PP 2 x DP 2 on 8 ranks | cpu, gloo")
    cube = build_line(RunConfig(tensor_model_parallel_size=8, tp_backend="3d"), world=8,
                      device="cuda", dist_backend="nccl")
    assert "--tp-backend 3d (cube 2x2x2) | --schedule default |" in cube
    plan = build_line(RunConfig(tensor_model_parallel_size=2, oases_plan="p.json",
                                oases_layer_degrees=((1, 1), (2, 2))), world=2, device="cpu",
                      dist_backend="gloo")
    assert "--oases-plan p.json (attention/MLP degree per layer: 1/1 2/2)" in plan
    tp1 = build_line(RunConfig(schedule="oases"), world=1, device="cpu", dist_backend="gloo")
    assert "--schedule oases (stock layers at TP 1: nothing to overlap)" in tp1
    stock = build_line(RunConfig(tensor_model_parallel_size=2), world=2, device="cuda",
                       dist_backend="nccl", stock=True)
    assert "model from Megatron-LM's own provider (stock, 1-D TP)" in stock
