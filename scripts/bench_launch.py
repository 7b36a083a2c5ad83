"""How long a launch takes before it trains, and before it refuses a bad flag.

Four timings, each from the command's start (wall clock, the machine-wide benchmark lock held):

* ``trainer first iteration``: the README's first command (``megatron-oases train
  --nproc-per-node 4``, TP 2 x PP 2, full uniform recompute; the trainer's default model) until
  its first ``iteration 1/`` line;
* ``trainer refusal``: the same command with ``--tensor-model-parallel-size 3``, until it exits;
* ``entry first iteration``: the same model and layout through Megatron-LM's loop
  (``torchrun --nproc-per-node 4 -m megatron_oases.pretrain_gpt``, CPU flags of
  docs/megatron_lm.md) until Megatron's first ``iteration 1/`` line;
* ``entry refusal``: that launch with ``--tp-backend atp --atp-mesh 2,2`` (d1 x d2 != TP), until
  torchrun exits.

``--root DIR`` measures another copy of the code (e.g. ``git archive HEAD`` unpacked), with
this venv. Prints a table and writes JSON (``--json``)::

    flock /tmp/oases_tests.lock .venv/bin/python scripts/bench_launch.py --json launch.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import bench_lock, loadavg, print_table
from megatron_oases.run_config import DEFAULTS

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIRST_ITERATION = re.compile(r"iteration\s+1/")
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--recompute-granularity", "full", "--recompute-method", "uniform"]
"""The README's first command's layout (its --train-iters 10 does not change the start-up)."""


def trainer_cmd(python: str, bad: bool) -> list[str]:
    tp = ["--tensor-model-parallel-size", "3"] if bad else []
    return [python, "-m", "megatron_oases.cli", "train", "--nproc-per-node", "4", *LAYOUT,
            "--train-iters", "1", *tp]


def entry_model() -> list[str]:
    """The trainer's default model as Megatron-LM flags (NullTokenizer: vocab + 1 with eod)."""
    d = DEFAULTS
    return [f"--{k.replace('_', '-')}={v}" for k, v in (
        ("num_layers", d.num_layers), ("hidden_size", d.hidden_size),
        ("num_attention_heads", d.num_attention_heads), ("seq_length", d.seq_length),
        ("max_position_embeddings", d.seq_length), ("micro_batch_size", d.micro_batch_size),
        ("global_batch_size", d.global_batch_size), ("vocab_size", d.vocab_size - 1),
        ("lr", d.lr), ("seed", d.seed))]


CPU_FLAGS = ("--mock-data --tokenizer-type NullTokenizer --transformer-impl local "
             "--use-cpu-initialization --no-bias-gelu-fusion --no-bias-dropout-fusion "
             "--no-masked-softmax-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion "
             "--no-rope-fusion --distributed-backend gloo --log-interval 1 --eval-iters 0 "
             "--eval-interval 1000 --train-iters 1 --recompute-num-layers 1").split()
"""docs/megatron_lm.md's CPU flags."""


def entry_cmd(python: str, bad: bool) -> list[str]:
    atp = ["--tp-backend", "atp", "--atp-mesh", "2,2"] if bad else []
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
            "megatron_oases.pretrain_gpt", *entry_model(), *CPU_FLAGS, *LAYOUT, *atp]


def timed(cmd: list[str], root: str, wait_for: re.Pattern | None, timeout_s: float,
          cold: bool = False) -> dict:
    """Seconds until a stdout line matches ``wait_for`` (None: until exit); the run then goes on
    to its end. The process group is killed at the deadline. ``cold``: empty compile caches
    (torch.compile / inductor), as on a machine's first launch."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if cold:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="oases-bench-inductor-")
        env["TRITON_CACHE_DIR"] = env["TORCHINDUCTOR_CACHE_DIR"]
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATRON_LM_PATH"):
        env.pop(k, None)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=root, env=env, start_new_session=True)
    seen, tail, startup = None, [], None
    try:
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-20:]
            if startup is None and line.startswith("megatron_oases: model "):
                startup = line.rstrip()
            if seen is None and wait_for is not None and wait_for.search(line):
                seen = time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                raise subprocess.TimeoutExpired(cmd, timeout_s)
        rc = proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    total = time.perf_counter() - t0
    return {"seconds": seen if wait_for is not None else total, "exit_s": total, "rc": rc,
            "startup_line": startup,
            "tail": tail[-3:]}


CASES = {
    "trainer first iteration": (lambda py: trainer_cmd(py, False), FIRST_ITERATION),
    "trainer refusal": (lambda py: trainer_cmd(py, True), None),
    "entry first iteration": (lambda py: entry_cmd(py, False), FIRST_ITERATION),
    "entry refusal": (lambda py: entry_cmd(py, True), None),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=HERE, help="the code to measure (default: this checkout)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--only", nargs="+", choices=tuple(CASES), metavar="CASE")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--label", default="", help="a name for this measurement (e.g. before)")
    p.add_argument("--cold", action="store_true",
                   help="each launch with empty torch.compile caches (a machine's first launch)")
    a = p.parse_args(argv)
    rows = []
    for name in a.only or CASES:
        make, pattern = CASES[name]
        for i in range(a.repeat):
            with bench_lock() as waited:
                load = loadavg()
                r = timed(make(a.python), os.path.abspath(a.root), pattern, a.timeout, a.cold)
            rows.append({"case": name + (" (cold)" if a.cold else ""), "run": i + 1, "seconds": r["seconds"],
                         "exit_s": r["exit_s"], "rc": r["rc"], "load": load,
                         "lock_wait_s": waited, "startup_line": r["startup_line"],
                         "tail": r["tail"]})
            print(f"{rows[-1]['case']} #{i + 1}: {r['seconds']} s (rc {r['rc']}, load {load})", flush=True)
    print_table(rows, ["case", "run", "seconds", "exit_s", "rc", "load"])
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"label": a.label, "root": os.path.abspath(a.root), "cpus": os.cpu_count(),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
