"""scripts/slurm: syntax, DRY_RUN command lines, a full run with stand-in srun/torchrun, and
(with MEGATRON_LM_PATH) every printed command parsed and validated by Megatron-LM itself."""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = os.path.join(ROOT, "scripts", "slurm")
SBATCH = sorted(glob.glob(os.path.join(SLURM, "*.sbatch")))
FAMILIES = {"oases_models", "atp_models", "tp3d_scaling", "single_node", "multi_node"}

# (script, environment) -> one cluster shape per family, and the world size it has
CASES = [
    ("oases_models", {"NNODES": "8", "GPUS_PER_NODE": "4"}),
    ("oases_models", {"NNODES": "1", "GPUS_PER_NODE": "8", "MODELS": "1024 8192"}),
    ("atp_models", {"GPUS_PER_NODE": "8"}),
    ("atp_models", {"NNODES": "2", "GPUS_PER_NODE": "8", "ATP_CHUNKS": "2", "MODELS": "M4"}),
    ("tp3d_scaling", {"NNODES": "2", "GPUS_PER_NODE": "4"}),
    ("tp3d_scaling", {"NNODES": "16", "GPUS_PER_NODE": "4"}),
    ("single_node", {"GPUS_PER_NODE": "4", "VARIANTS": "stock oases atp-2x2-c2"}),
    ("multi_node", {"NNODES": "4", "GPUS_PER_NODE": "8"}),
]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "NNODES", "GPUS_PER_NODE", "RESULTS_DIR",
                                "VARIANTS", "MODELS", "TOPOLOGY", "OASES_ROOT", "DRY_RUN"))}
    return {**env, **extra}


def dry_run(script: str, env: dict, cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.path.join(SLURM, f"{script}.sbatch")], cwd=cwd,
                          env=clean_env(DRY_RUN="1", MEGATRON_LM_PATH="/opt/Megatron-LM", **env),
                          capture_output=True, text=True, timeout=60)


def commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line.split(" > ")[0]) for line in stdout.splitlines()
            if line and not line.startswith("#")]


def training_args(words: list[str]) -> tuple[str, list[str]]:
    """("stock" | "ours", the Megatron-LM argument list) of one printed command."""
    if "-m" in words:
        i = words.index("-m")
        assert words[i + 1] == "megatron_oases.pretrain_gpt"
        return "ours", words[i + 2:]
    i = next(k for k, w in enumerate(words) if w.endswith("/pretrain_gpt.py"))
    return "stock", words[i + 1:]


def test_every_script_parses_with_bash_n():
    scripts = SBATCH + [os.path.join(SLURM, "common.sh"), os.path.join(ROOT, "scripts", "apply_patches.sh")]
    assert {os.path.basename(s)[:-7] for s in SBATCH} == FAMILIES
    for s in scripts:
        proc = subprocess.run(["bash", "-n", s], capture_output=True, text=True)
        assert proc.returncode == 0, (s, proc.stderr)


def test_no_personal_paths_or_sites():
    for s in SBATCH + [os.path.join(SLURM, "common.sh")]:
        text = open(s).read()
        assert not re.search(r"/home/|/Users/|~/|/scratch/|/lustre/|#SBATCH\s+(-A|--account|-p|--partition)", text), s


@pytest.mark.parametrize("script, env", CASES, ids=[f"{s}-{e.get('NNODES', '1')}x{e.get('GPUS_PER_NODE')}" for s, e in CASES])
def test_dry_run_prints_exact_launch_lines(script, env, tmp_path):
    env = {**env, "RESULTS_DIR": str(tmp_path / "res")}
    proc = dry_run(script, env)
    assert proc.returncode == 0, proc.stderr
    header = [ln for ln in proc.stdout.splitlines() if ln.startswith("#")]
    assert any("CUDA_DEVICE_MAX_CONNECTIONS=1" in ln for ln in header)
    cmds = commands(proc.stdout)
    assert cmds and not (tmp_path / "res").exists()  # a dry run touches nothing
    nnodes, gpus = int(env.get("NNODES", "1")), env["GPUS_PER_NODE"]
    cases = {}
    for words, line in zip(cmds, [ln for ln in proc.stdout.splitlines() if not ln.startswith("#")]):
        assert words[:2] == ["srun", f"--nodes={nnodes}"] and "--ntasks-per-node=1" in words
        assert "torchrun" in words and f"--nproc-per-node={gpus}" in words
        if nnodes == 1:
            assert "--standalone" in words
        else:
            assert f"--nnodes={nnodes}" in words and "--rdzv-backend=c10d" in words
            assert any(w.startswith("--rdzv-endpoint=") for w in words)
        kind, args = training_args(words)
        assert "--mock-data" in args and "--train-iters" in args
        log = shlex.split(line.split(" > ")[1])[0]
        assert log.startswith(str(tmp_path / "res")) and log.endswith(".log")
        case, variant = log.split("/")[-2:]
        cases.setdefault(case, []).append((variant[:-4], kind, args))
    for case, runs in cases.items():
        assert runs[0][0] == "stock" and runs[0][1] == "stock", case  # baseline first
        assert all(kind == "ours" for _, kind, _ in runs[1:]) and len(runs) > 1
        model = [a for a in runs[0][2]]
        for _, _, args in runs[1:]:
            assert args[:len(model)] == model  # same Megatron-LM arguments, our flags appended


def test_dry_run_family_contents():
    out = dry_run("oases_models", {"NNODES": "8", "GPUS_PER_NODE": "4"}).stdout
    assert len(commands(out)) == 7 * 4 and "--hidden-size 12288" in out and "--no-oases-cross-pass" in out
    out = dry_run("atp_models", {"GPUS_PER_NODE": "8", "MODELS": "M2"}).stdout
    meshes = set(re.findall(r"--atp-mesh (\d+,\d+) --atp-chunks (\d)", out))
    assert meshes == {(m, c) for m in ("8,1", "4,2", "2,4", "1,8") for c in "124"}
    out = dry_run("atp_models", {"GPUS_PER_NODE": "8", "MODELS": "M1", "TOPOLOGY": "dgx-a100"}).stdout
    assert "--atp-mesh auto --topology dgx-a100" in out
    out = dry_run("tp3d_scaling", {"NNODES": "2", "GPUS_PER_NODE": "4"}).stdout
    assert "weak-8gpu/3d.log" in out and "strong-8gpu/stock.log" in out and "--tp-backend 3d" in out
    proc = dry_run("tp3d_scaling", {"NNODES": "4", "GPUS_PER_NODE": "4", "MODES": "weak",
                                    "VARIANTS": "stock"})
    assert proc.returncode == 0 and "skip weak: no weak-scaling point for 16 GPUs" in proc.stderr
    # 16 GPUs is no cube: the stock runs alone are a scaling point, with no 3-D run beside them
    out = dry_run("tp3d_scaling", {"NNODES": "4", "GPUS_PER_NODE": "4", "VARIANTS": "stock"}).stdout
    assert "strong-16gpu/stock.log" in out and "--tp-backend 3d" not in out


def test_env_line_names_every_exported_variable(tmp_path):
    """The dry run's ``# env:`` line lists every variable common.sh exports (found by diffing
    the environment around ``oases_setup``, not from a list kept here), with its value, and the
    site-specific NCCL_* ones set before sbatch."""
    env = clean_env(DRY_RUN="1", MEGATRON_LM_PATH="/opt/Megatron-LM", NNODES="1",
                    GPUS_PER_NODE="4", CKPT_DIR=str(tmp_path / "ckpt"), NCCL_SOCKET_IFNAME="ib0",
                    RESULTS_DIR=str(tmp_path / "res"))
    for name in ("OMP_NUM_THREADS", "NCCL_IB_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                 "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_DEVICE_MAX_CONNECTIONS"):
        env.pop(name, None)
    script = ('source scripts/slurm/common.sh && oases_setup probe && echo "@@" '
              '&& env -0 | tr "\\0" "\\n" | grep -E "^[A-Za-z_][A-Za-z0-9_]*="')
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    header, after = proc.stdout.split("@@\n")
    line = next(ln for ln in header.splitlines() if ln.startswith("# env: "))
    shown = dict(w.split("=", 1) for w in shlex.split(line[len("# env: "):]))
    now = dict(ln.split("=", 1) for ln in after.splitlines() if "=" in ln)
    shell_own = ("SHLVL", "_", "OLDPWD", "PWD")  # bash's, not common.sh's
    exported = {k for k, v in now.items() if env.get(k) != v and k not in shell_own}
    assert {"OMP_NUM_THREADS", "NCCL_IB_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"} <= exported
    assert all(shown.get(k) == now[k] for k in exported), (exported, shown)
    assert shown["NCCL_SOCKET_IFNAME"] == "ib0" and shown["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "300"


def test_master_address_from_scontrol(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a17\\ngpu-a18\\n'\n")
    (fake / "scontrol").chmod(0o755)
    env = {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-a[17-18]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_ID": "4242"}
    proc = dry_run("multi_node", env)
    assert proc.returncode == 0, proc.stderr
    words = commands(proc.stdout)[0]
    assert "--rdzv-endpoint=gpu-a17:29742" in words and "--nnodes=2" in words
    assert "--rdzv-endpoint=gpu-a17:29743" in commands(proc.stdout)[1]  # next run, next port


def test_unknown_variant_is_refused():
    proc = dry_run("single_node", {"GPUS_PER_NODE": "8", "VARIANTS": "stock turbo"})
    assert proc.returncode == 2 and "unknown variant 'turbo'" in proc.stderr
    proc = dry_run("atp_models", {"GPUS_PER_NODE": "8", "VARIANTS": "atp-auto"})
    assert proc.returncode == 2 and "atp-auto needs TOPOLOGY" in proc.stderr


def test_our_flags_in_printed_commands_parse():
    from megatron_oases.megatron_lm.flags import add_flags

    parser = add_flags(argparse.ArgumentParser(allow_abbrev=False))
    for script, env in CASES:
        for words in commands(dry_run(script, env).stdout):
            kind, args = training_args(words)
            ns, rest = parser.parse_known_args(args)
            if kind == "stock":
                assert (ns.tp_backend, ns.schedule) == ("megatron", "default")


def test_full_run_with_stand_in_launchers(tmp_path):
    """Not a dry run: srun/torchrun stand-ins print Megatron-style iteration lines (faster with
    our flags), so logs, status, commands.sh and the compare.py table all get written."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nwhile [ \"${1#--}\" != \"$1\" ]; do shift; done\nexec \"$@\"\n")
    (fake / "torchrun").write_text(
        "#!/bin/sh\nms=200; case \"$*\" in *--schedule*|*--tp-backend*) ms=100;; esac\n"
        "for i in 1 2 3; do echo \" iteration $i/3 | elapsed time per iteration (ms): $ms.0 |\"; done\n"
        "case \"$*\" in *no-oases-cross-pass*) exit 3;; esac\n")
    for f in ("srun", "torchrun"):
        (fake / f).chmod(0o755)
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("")
    for dep in ("six", "einops", "pydantic", "regex"):  # what the pre-flight import check asks
        (mlm / f"{dep}.py").write_text("")  # for; the stand-in torchrun needs none of them
    res = tmp_path / "res"
    env = clean_env(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", MEGATRON_LM_PATH=str(mlm),
                    RESULTS_DIR=str(res), NNODES="1", GPUS_PER_NODE="2", PYTHON=sys.executable,
                    MODELS="1024", VARIANTS="stock oases oases-no-cross-pass")
    proc = subprocess.run(["bash", os.path.join(SLURM, "oases_models.sbatch")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(res / "h1024")) == ["oases-no-cross-pass.log", "oases.log", "stock.log"]
    status = (res / "status.txt").read_text()
    assert "h1024 stock exit=0" in status and "h1024 oases-no-cross-pass exit=3" in status
    assert "failed (exit 3)" in proc.stderr
    assert len((res / "commands.sh").read_text().splitlines()) == 3
    table = (res / "speedup.txt").read_text()
    assert "2.000x" in table and (res / "speedup.csv").exists() and (res / "env.txt").exists()


def test_missing_dependencies_stop_before_any_srun(tmp_path):
    """The compute nodes' python must import megatron_oases and megatron.training's dependencies:
    checked once, one line naming the pip install, exit 2, no results directory."""
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("")
    res = tmp_path / "res"
    env = clean_env(MEGATRON_LM_PATH=str(mlm), RESULTS_DIR=str(res), NNODES="1", GPUS_PER_NODE="2",
                    PYTHON="false", MODELS="1024", VARIANTS="stock")
    proc = subprocess.run(["bash", os.path.join(SLURM, "oases_models.sbatch")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and not res.exists()
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "[megatron-lm]" in err[0], proc.stderr


# ---- with a Megatron-LM checkout: Megatron-LM itself accepts every printed command -----------
CHECKOUT = os.environ.get("MEGATRON_LM_PATH", "")


@pytest.mark.skipif(not CHECKOUT or not os.path.isfile(os.path.join(CHECKOUT, "pretrain_gpt.py")),
                    reason="needs a Megatron-LM checkout: set MEGATRON_LM_PATH (the installed release's tag)")
def test_printed_commands_pass_megatron_lm_validation(monkeypatch):
    from megatron_oases.megatron_lm.checkout import import_stock_pretrain_gpt
    from megatron_oases.megatron_lm.pretrain_gpt import entry_objects

    _, extra = entry_objects(import_stock_pretrain_gpt(CHECKOUT))
    import megatron.training.arguments as margs

    monkeypatch.setattr(margs, "get_device_arch_version", lambda: 9)  # validate_args' CUDA query
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    checked = 0
    for script, env in CASES:
        world = int(env.get("NNODES", "1")) * int(env["GPUS_PER_NODE"])
        monkeypatch.setenv("WORLD_SIZE", str(world))
        for words in commands(dry_run(script, env).stdout):
            kind, args = training_args(words)
            monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *args])
            parsed = margs.parse_args(extra if kind == "ours" else None)
            with contextlib.redirect_stdout(io.StringIO()):
                margs.validate_args(parsed, {"tokenizer_type": "GPT2BPETokenizer"})
            checked += 1
    assert checked > 50


# ---- preemption: SIGTERM before the time limit, save, resume on resubmission ---------------
def test_every_script_asks_for_sigterm_before_its_time_limit():
    """Each sbatch asks SLURM for SIGTERM to the batch shell ahead of --time (the ``B:`` form,
    commented), among its #SBATCH lines, and the dry run prints the request."""
    for s in SBATCH:
        lines = open(s).read().splitlines()
        head = lines[:next(i for i, ln in enumerate(lines[1:], 1) if not ln.startswith("#"))]
        request = [ln for ln in head if ln.startswith("#SBATCH --signal=")]
        assert len(request) == 1, s
        m = re.fullmatch(r"#SBATCH --signal=B:TERM@(\d+)", request[0])
        assert m and int(m.group(1)) >= 60, (s, request)
        i = head.index(request[0])
        assert "before --time runs out" in head[i + 1], s  # says why
    for script, env in CASES:
        out = dry_run(script, env).stdout
        assert "# preemption: #SBATCH --signal=B:TERM@300: SIGTERM before the time limit" in out


def test_dry_run_with_ckpt_dir_saves_and_loads_the_same_directory(tmp_path):
    """CKPT_DIR: every run gets Megatron-LM's --save = --load (its own directory), a
    --save-interval and --exit-signal-handler, and appends to its log."""
    ck = tmp_path / "ck"
    proc = dry_run("single_node", {"GPUS_PER_NODE": "4", "CKPT_DIR": str(ck),
                                   "VARIANTS": "stock oases", "RESULTS_DIR": str(tmp_path / "r")})
    assert proc.returncode == 0, proc.stderr
    assert f"checkpoints in {ck}/<case>/<variant>" in proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("#")]
    assert len(lines) == 2 and not ck.exists()
    for line, variant in zip(lines, ("stock", "oases")):
        assert " >> " in line
        _, args = training_args(shlex.split(line.split(" >> ")[0]))
        save, load = args[args.index("--save") + 1], args[args.index("--load") + 1]
        assert save == load == f"{ck}/custom/{variant}"
        assert "--exit-signal-handler" in args and "--save-interval" in args


def _stand_ins(tmp_path):
    """srun and torchrun stand-ins: the 'training' resumes from --load's latest iteration, prints
    an iteration line every STANDIN_STEP_S seconds (default 0.1) and, on SIGTERM (or at the end),
    saves the iteration it reached to --save and exits 0, as Megatron-LM's --exit-signal-handler
    does."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nwhile [ \"${1#--}\" != \"$1\" ]; do shift; done\nexec \"$@\"\n")
    (fake / "torchrun").write_text(r"""#!/bin/bash
prev=; for a in "$@"; do
  case "$prev" in --save) save=$a;; --load) load=$a;; --train-iters) iters=$a;; esac; prev=$a; done
it=$(cat "$load/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
echo "resumed at $it"
save_and_exit() { mkdir -p "$save"; echo "$it" > "$save/latest_checkpointed_iteration.txt"; echo "saved $it"; exit 0; }
trap save_and_exit TERM
while [ "$it" -lt "$iters" ]; do
  it=$((it + 1)); echo " iteration $it/$iters | elapsed time per iteration (ms): 100.0 |"
  sleep "${STANDIN_STEP_S:-0.1}" & wait $!
done
save_and_exit
""")
    for f in ("srun", "torchrun"):
        (fake / f).chmod(0o755)
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("")
    for dep in ("six", "einops", "pydantic", "regex"):
        (mlm / f"{dep}.py").write_text("")
    return fake, mlm


def test_sigterm_to_the_batch_shell_saves_stops_and_a_resubmission_resumes(tmp_path):
    """SIGTERM to the batch shell (what --signal=B:TERM asks for): the running run gets it, saves
    and exits 0, no further run starts; the same job submitted again skips nothing it has not
    finished, resumes the interrupted run from its checkpoint and then runs the rest."""
    import signal
    import time

    fake, mlm = _stand_ins(tmp_path)
    res, ck = tmp_path / "res", tmp_path / "ck"
    env = clean_env(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", MEGATRON_LM_PATH=str(mlm),
                    RESULTS_DIR=str(res), CKPT_DIR=str(ck), NNODES="1", GPUS_PER_NODE="2",
                    PYTHON=sys.executable, MODELS="1024", VARIANTS="stock oases", TRAIN_ITERS="60")
    script = os.path.join(SLURM, "oases_models.sbatch")
    job = subprocess.Popen(["bash", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    log = res / "h1024" / "stock.log"
    deadline = time.monotonic() + 60
    while not (log.exists() and " iteration 5/" in log.read_text()):
        assert time.monotonic() < deadline and job.poll() is None, "the first run did not start"
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    stopped = int((ck / "h1024" / "stock" / "latest_checkpointed_iteration.txt").read_text())
    assert 5 <= stopped < 60 and f"saved {stopped}" in log.read_text()
    assert "skip h1024/oases: stopping after SIGTERM" in err
    assert not (res / "h1024" / "oases.log").exists()
    status = (res / "status.txt").read_text()
    assert "h1024 stock exit=0 (stopped by SIGTERM; resumes when resubmitted)" in status

    env["STANDIN_STEP_S"] = "0.005"  # no signal to wait for: the rest of both runs goes fast
    again = subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=180)
    assert again.returncode == 0, again.stderr
    text = log.read_text()
    assert f"resumed at {stopped}" in text and text.count(" iteration 60/60 ") == 1
    assert "resumed at 0" in (res / "h1024" / "oases.log").read_text()
    third = subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=180)
    assert "skip h1024/stock: finished in an earlier job" in third.stderr
    assert "skip h1024/oases: finished in an earlier job" in third.stderr


# ---- bad values: one line, exit 2, before any srun ------------------------------------------
@pytest.mark.parametrize("script, env, says", [
    ("single_node", {"NNODES": "0"}, "NNODES=0 must be a whole number >= 1"),
    ("single_node", {"NNODES": "abc"}, "NNODES=abc must be a whole number >= 1"),
    ("multi_node", {"GPUS_PER_NODE": "-1"}, "GPUS_PER_NODE=-1 must be a whole number >= 1"),
    ("single_node", {"TRAIN_ITERS": "ten"}, "TRAIN_ITERS=ten must be"),
    ("atp_models", {"GPUS_PER_NODE": "8", "ATP_TP": "0"}, "ATP_TP=0 must be a whole number >= 1"),
    ("atp_models", {"GPUS_PER_NODE": "8", "MODELS": "M1", "ATP_MESHES": "3x3"}, "mesh 3x3 is not ATP_TP=8 GPUs"),
    ("atp_models", {"GPUS_PER_NODE": "8", "VARIANTS": "atp-4x"}, "variant 'atp-4x' is not atp-D1xD2"),
    ("single_node", {"GPUS_PER_NODE": "8", "VARIANTS": "stock atp-4x2-c0"}, "variant 'atp-4x2-c0' is not"),
    ("single_node", {"GPUS_PER_NODE": "8", "VARIANTS": "stock atp-4x2-cX"}, "variant 'atp-4x2-cX' is not"),
    ("oases_models", {"MICRO_BATCH_SIZE": "0"}, "MICRO_BATCH_SIZE=0 must be"),
    ("oases_models", {"NNODES": "1", "GPUS_PER_NODE": "3"}, "no model of MODELS (1024 2048 3072"),
    ("tp3d_scaling", {"NNODES": "2", "GPUS_PER_NODE": "4", "HIDDEN": "big"}, "HIDDEN=big must be"),
    # TP is every GPU of the job; 3-D TP needs a cube of them (was: a TP 16 "cube" run printed)
    ("tp3d_scaling", {"NNODES": "4", "GPUS_PER_NODE": "4"},
     "16 GPUs for variant 3d: --tp-backend 3d: 3-D tensor parallelism needs "
     "--tensor-model-parallel-size = p^3"),
    ("single_node", {"NNODES": "2"}, "NNODES=2: single_node runs on 1 node(s); set NNODES=1"),
    ("atp_models", {"GPUS_PER_NODE": "8", "TOPOLOGY": "/no/such/topology.yaml"},
     "TOPOLOGY: topology /no/such/topology.yaml: no such file or shipped example"),
])
def test_bad_values_are_one_line_before_anything_runs(script, env, says, tmp_path):
    """Counts, variant names and TOPOLOGY are checked up front: one error line, exit 2, no
    command printed (was: bash arithmetic errors, `--nodes=0`, `--atp-chunks X` or a TOPOLOGY
    each run would refuse, passed on to srun)."""
    proc = dry_run(script, {**env, "RESULTS_DIR": str(tmp_path / "res")})
    assert proc.returncode == 2, proc.stdout
    err = [ln for ln in proc.stderr.splitlines() if ln]
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], proc.stderr
    assert not commands(proc.stdout) and not (tmp_path / "res").exists()


def test_a_topology_with_a_bad_field_is_refused_by_the_loader(tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text("name: t\nlevels:\n  - {name: a, size: 8, scope: intra_node, p2p_bandwidth_GBps: -1, "
                    "group_bandwidth_GBps: 600}\n")
    proc = dry_run("atp_models", {"GPUS_PER_NODE": "8", "MODELS": "M1", "TOPOLOGY": str(topo)})
    assert proc.returncode == 2 and not commands(proc.stdout)
    assert proc.stderr.strip() == (f"error: TOPOLOGY: topology {topo}: levels[0].p2p_bandwidth_GBps "
                                   "must be > 0 (got -1)")
