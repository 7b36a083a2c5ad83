"""scripts/compare.py: logs -> speedup table, CSV, PNG; and a smoke run of the reference trainer."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest
from tests.script_modules import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "compare.py")

compare = load_script("scripts/compare.py", "oases_compare")

MEGATRON_LINE = (" [2025-11-22 01:02:03.456789] iteration {it:8d}/{n:8d} | consumed samples:"
                 "          {s:3d} | elapsed time per iteration (ms): {ms:.1f} | throughput per GPU "
                 "(TFLOP/s/GPU): {tf:.1f} | learning rate: 1.000000E-04 | global batch size:     8 |"
                 " lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 2.345 |")
ARGS_BLOCK = """------------------------ arguments ------------------------
  bf16 ............................................ {bf16}
  exit_on_missing_checkpoint ...................... False
  fp16 ............................................ False
  hidden_size ..................................... {hidden}
  num_layers ...................................... 8
  train_iters ..................................... {n}
  transformer_impl ................................ {impl}
-------------------- end of arguments ---------------------
"""


def megatron_log(step_ms, tflops=100.0, *, total=None, iters=None, tail="", args=None,
                 losses=None, head="") -> str:
    """Megatron-LM stdout logging ``step_ms`` (and ``losses``, default 10.4321 each) at iterations
    ``iters`` (default 1, 2, ...) of ``total`` (default: as many as logged), then ``tail``;
    ``args`` fills the arguments block; ``head``: lines before it."""
    iters = iters or list(range(1, len(step_ms) + 1))
    losses = losses or [10.4321] * len(step_ms)
    n = total or (iters[-1] if iters else 10)
    lines = [head] if head else []
    lines.append("> building GPT model ...")
    if args is not None:
        lines.append(ARGS_BLOCK.format(n=n, **{"bf16": True, "hidden": 1024, "impl": "local", **args}))
    lines.append("[before the start of training step] datetime: ...")
    lines += [MEGATRON_LINE.format(it=it, n=n, s=8 * it, ms=ms, tf=tflops, loss=loss)
              for it, ms, loss in zip(iters, step_ms, losses)]
    if tail:
        lines.append(tail)
    elif iters and iters[-1] == n:
        lines.append("[after training is done] datetime: ...")
    return "\n".join(lines) + "\n"


def json_log(step_ms, start=1, losses=None) -> str:
    losses = losses or [5.0] * len(step_ms)
    return "".join(json.dumps({"iteration": start + i, "lm_loss": loss, "step_ms": ms,
                               "tokens_per_s": 1000.0 / ms, "tflops_per_rank": 0.5}) + "\n"
                   for i, (ms, loss) in enumerate(zip(step_ms, losses)))


TRACEBACK = """Traceback (most recent call last):
  File "pretrain_gpt.py", line 300, in <module>
    pretrain(...)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"""


def test_parse_both_formats():
    log = compare.parse_log(megatron_log([500.0, 100.0, 110.0]))
    assert log.step_ms == [500.0, 100.0, 110.0] and log.total == 3 and log.crash is None
    assert [v["tflops"] for v in log.iterations.values()] == [100.0] * 3
    log = compare.parse_log(json_log([20.0, 10.0]) + "not json {\n")
    assert log.step_ms == [20.0, 10.0] and sorted(log.iterations) == [1, 2] and log.total is None
    assert log.iterations[2] == {"step_ms": 10.0, "tflops": 0.5, "tokens_per_s": 100.0, "loss": 5.0}
    trainer = (" iteration        2/       3 | lm loss: 5.5E+00 | grad norm: 1.569 | elapsed time per "
               "iteration (ms): 46.2 | tokens/s: 1385.3 | TFLOP/s per rank: 0.0001")
    log = compare.parse_log(trainer)
    assert log.iterations == {2: {"step_ms": 46.2, "tflops": 0.0001, "tokens_per_s": 1385.3,
                                  "loss": 5.5}}
    assert log.total == 3
    # the same iteration as a JSON record and a text line counts once
    assert compare.parse_log(json_log([46.2], start=2) + trainer).step_ms == [46.2]
    # Megatron-LM's arguments block; the rank prefix of torchrun --tee is dropped
    log = compare.parse_log("\n".join("[rank0]: " + x for x in
                                      megatron_log([9.0], args={"impl": "transformer_engine"}).splitlines()))
    assert log.settings["transformer_impl"] == "transformer_engine" and log.settings["bf16"] == "True"
    assert compare.precision(log.settings) == "bf16" and log.step_ms == [9.0]


@pytest.mark.parametrize("tail", [
    TRACEBACK,
    "pretrain_gpt.py: error: --atp-mesh 4,2: d1 x d2 = 8 must equal --tensor-model-parallel-size 4",
    "srun: error: node12: task 3: Exited with exit code 1",
    "[rank3]: RuntimeError: NCCL communicator was aborted",
    "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 0",
    "megatron-oases train: rank(s) [1] failed",
])
def test_crash_lines(tail):
    log = compare.parse_log(megatron_log([10.0] * 6, total=20, tail=tail))
    assert log.crash and len(log.iterations) == 6


def test_no_crash_from_warnings_and_arguments():
    text = megatron_log([10.0] * 4, args={}, tail="/x/y.py:12: UserWarning: TypedStorage is deprecated\n"
                        "WARNING: Logging before flag parsing goes to stderr.\nexit code 0")
    log = compare.parse_log(text)
    assert log.crash is None and log.settings["exit_on_missing_checkpoint"] == "False"


def _write(root, case, variant, text):
    (root / case).mkdir(parents=True, exist_ok=True)
    path = root / case / variant
    path.write_text(text)
    return path


def test_crashed_and_truncated_runs_are_marked_in_table_csv_and_chart(tmp_path, capsys):
    """One crashed and one truncated variant next to complete ones, a crashed baseline, a case
    without a baseline: statuses in the table, the CSV and the chart's data; speedups only
    between complete runs; the footer names each cause."""
    res = tmp_path / "results"
    ten = [900.0] + [200.0] * 9
    _write(res, "h1024", "stock.log", megatron_log(ten))
    _write(res, "h1024", "oases.log", megatron_log([900.0] + [100.0] * 9))
    _write(res, "h1024", "atp-2x2-c2.log", megatron_log([900.0] + [50.0] * 5, total=10, tail=TRACEBACK))
    _write(res, "h1024", "oases-no-cross-pass.log", megatron_log([900.0] + [80.0] * 5, total=10))
    _write(res, "h2048", "stock.log", megatron_log([900.0] + [300.0] * 5, total=20, tail=TRACEBACK))
    _write(res, "h2048", "oases.log", megatron_log([900.0] + [150.0] * 19))
    _write(res, "h4096", "oases.log", megatron_log([900.0] + [150.0] * 19))
    out_csv, out_png = tmp_path / "s.csv", tmp_path / "s.png"
    assert compare.main([str(res), "--csv", str(out_csv), "--png", str(out_png)]) == 0
    out = capsys.readouterr().out
    table = {tuple(line.split()[:2]): line for line in out.splitlines()[2:9]}
    assert "complete" in table["h1024", "oases"] and table["h1024", "oases"].endswith("2.000x")
    assert "crashed at iteration 6 of 10" in table["h1024", "atp-2x2-c2"]
    assert table["h1024", "atp-2x2-c2"].endswith("crashed")
    assert "incomplete (6 of 10 iterations)" in table["h1024", "oases-no-cross-pass"]
    assert table["h1024", "oases-no-cross-pass"].endswith("incomplete")
    assert table["h2048", "oases"].endswith("baseline crashed")
    assert table["h4096", "oases"].endswith("no baseline")
    assert "baseline stock crashed at iteration 6 of 20 in case h2048: torch.OutOfMemoryError" in out
    no_base = [line for line in out.splitlines() if "no 'stock' run" in line]
    assert len(no_base) == 1 and no_base[0].startswith("no 'stock' run in case h4096")  # not h2048
    assert "h1024/atp-2x2-c2 crashed at iteration 6 of 10: torch.OutOfMemoryError" in out

    rows = {(r["case"], r["variant"]): r for r in csv.DictReader(open(out_csv))}
    assert len(rows) == 7 and list(rows)[0] == ("h1024", "stock")  # the baseline leads its case
    assert [rows["h1024", v]["status"] for v in ("stock", "oases", "atp-2x2-c2", "oases-no-cross-pass")] \
        == ["complete", "complete", "crashed", "incomplete"]
    assert rows["h1024", "oases-no-cross-pass"]["status_detail"] == "incomplete (6 of 10 iterations)"
    assert rows["h1024", "oases-no-cross-pass"]["speedup"] == ""
    assert rows["h1024", "oases-no-cross-pass"]["speedup_note"] == "incomplete"
    assert rows["h1024", "atp-2x2-c2"]["speedup"] == "" and rows["h1024", "atp-2x2-c2"]["iterations"] == "6"
    assert rows["h1024", "atp-2x2-c2"]["crash_line"].startswith("torch.OutOfMemoryError")
    assert float(rows["h1024", "oases"]["speedup"]) == pytest.approx(2.0)
    assert rows["h1024", "oases"]["compared_iterations"] == "9"
    assert float(rows["h1024", "stock"]["step_ms_mean"]) == pytest.approx(200.0)  # warm-up skipped
    assert rows["h2048", "stock"]["status"] == "crashed" and rows["h2048", "oases"]["speedup"] == ""
    assert rows["h2048", "oases"]["speedup_note"] == "baseline crashed"
    assert rows["h4096", "oases"]["speedup_note"] == "no baseline"

    rows_ = compare.summarise(compare.collect([str(res)]), baseline="stock", skip_first=1)
    chart = compare.chart_data(rows_)
    bars = {(b["case"], b["variant"]): b for b in chart["bars"]}
    assert len(bars) == 7 and chart["cases"] == ["h1024", "h2048", "h4096"]
    assert bars["h1024", "oases"]["height"] == pytest.approx(2.0) and not bars["h1024", "oases"]["hatched"]
    assert bars["h1024", "oases"]["label"] == "2.00x"
    for key, status, label in [(("h1024", "atp-2x2-c2"), "crashed", "crashed at iteration 6 of 10"),
                               (("h1024", "oases-no-cross-pass"), "incomplete",
                                "incomplete (6 of 10 iterations)"),
                               (("h2048", "stock"), "crashed", "crashed at iteration 6 of 20"),
                               (("h2048", "oases"), "complete", "baseline crashed"),
                               (("h4096", "oases"), "complete", "no baseline")]:
        b = bars[key]
        assert (b["status"], b["label"], b["hatched"], b["speedup"]) == (status, label, True, None), key
        assert b["height"] > 2.0  # spans the axis: never a bar of height 0
    xs = [bars["h1024", v]["x"] for v in ("stock", "oases", "atp-2x2-c2", "oases-no-cross-pass")]
    assert len(set(xs)) == 4 and all(-0.5 < x < 0.5 for x in xs)  # side by side over h1024
    assert out_png.read_bytes()[:4] == b"\x89PNG"  # matplotlib is an install dependency


def test_speedup_over_common_iterations_and_unknown_length(tmp_path, capsys):
    res = tmp_path / "res"
    # baseline logs every iteration, the variant every second one (--log-interval 2)
    base = [900.0, 100.0, 300.0, 100.0, 300.0, 100.0, 300.0, 100.0, 300.0, 100.0]
    _write(res, "c", "stock.log", megatron_log(base))
    _write(res, "c", "oases.log", megatron_log([400.0, 50.0, 50.0, 50.0, 50.0], iters=[2, 4, 6, 8, 10], total=10))
    # JSON logs do not say how long the run was meant to be: the longest run of the case decides
    _write(res, "j", "stock.jsonl", json_log([900.0] + [100.0] * 7))
    _write(res, "j", "oases.jsonl", json_log([900.0] + [50.0] * 4))
    assert compare.main([str(res), "--skip-first", "1"]) == 0
    out = capsys.readouterr().out
    rows = {(r["case"], r["variant"]): r
            for r in compare.summarise(compare.collect([str(res)]), baseline="stock", skip_first=1)}
    # common iterations 2,4,...,10 minus the first: 4,6,8,10 -> baseline 100 ms there, not 200 ms
    assert rows["c", "oases"]["status"] == "complete" and rows["c", "oases"]["compared_iterations"] == 4
    assert rows["c", "oases"]["speedup"] == pytest.approx(2.0)
    assert rows["j", "oases"]["status_detail"] == "incomplete (5 of 8 iterations)"
    assert rows["j", "stock"]["status"] == "complete"
    assert "judged against the longest run of case j" in out


def test_settings_mismatch_warnings_and_sidecar(tmp_path, capsys):
    res = tmp_path / "res"
    _write(res, "m", "stock.log", megatron_log([10.0] * 4, args={"impl": "transformer_engine"}))
    _write(res, "m", "oases.log", megatron_log([10.0] * 4, args={"hidden": 2048}))
    _write(res, "m", "same.log", megatron_log([10.0] * 4, args={"impl": "transformer_engine"}))
    # reference trainer: JSON log + sidecar arguments (mapping, or the command line)
    _write(res, "t", "stock.jsonl", json_log([10.0] * 4))
    _write(res, "t", "stock.args.json", json.dumps({"train_iters": 4, "transformer_impl": "local"}))
    _write(res, "t", "oases.jsonl", json_log([10.0] * 3))
    _write(res, "t", "oases.args.json", json.dumps(["--train-iters", "4", "--bf16", "--schedule", "oases"]))
    _write(res, "u", "stock.jsonl", json_log([10.0] * 4))  # no sidecar: nothing compared
    _write(res, "u", "oases.jsonl", json_log([10.0] * 4))
    assert compare.main([str(res)]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warnings[0] == ("warning: m/oases differs from stock: transformer_impl local vs "
                           "transformer_engine, hidden_size 2048 vs 1024 (its speedup compares different work)")
    assert warnings[1].startswith("warning: t/oases differs from stock: precision bf16 vs fp32")
    assert len(warnings) == 2  # m/same matches; case u has no arguments to compare
    assert "incomplete (3 of 4 iterations)" in out  # N from the sidecar's --train-iters


def test_json_log_with_its_stdout_beside_it(tmp_path, capsys):
    """The trainer's --log-json file says nothing of a crash; its stdout (<variant>.out) does."""
    res = tmp_path / "res"
    _write(res, "t", "stock.jsonl", json_log([10.0] * 5))
    _write(res, "t", "oases.jsonl", json_log([5.0] * 3))
    trainer = "".join(f" iteration {i:8d}/{5:8d} | lm loss: 5.5E+00 | elapsed time per iteration (ms): 5.0\n"
                      for i in (1, 2, 3))
    _write(res, "t", "oases.out", trainer + "megatron-oases train: rank(s) [1] failed\n" + TRACEBACK)
    assert compare.main([str(res)]) == 0
    out = capsys.readouterr().out
    assert "t/oases crashed at iteration 3 of 5: torch.OutOfMemoryError" in out


def test_status_file_exit_code_marks_a_crash(tmp_path, capsys):
    res = tmp_path / "res"
    _write(res, "h1", "stock.log", megatron_log([10.0] * 4))
    _write(res, "h1", "oases.log", megatron_log([5.0] * 4))
    (res / "status.txt").write_text("h1 stock exit=0\nh1 oases exit=137\n")
    assert compare.main([str(res)]) == 0
    out = capsys.readouterr().out
    assert "h1/oases crashed at iteration 4 of 4: exit=137 in" in out


def test_labels_baseline_choice_and_missing_baseline(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.log"
    a.write_text(json_log([50.0, 40.0, 40.0]))
    b.write_text(megatron_log([80.0, 20.0, 20.0]))
    assert compare.main([f"mine={a}", f"theirs={b}", "--baseline", "theirs", "--skip-first", "0"]) == 0
    out = capsys.readouterr().out
    assert "theirs" in out.splitlines()[2]  # baseline row first
    assert "mine" in out.splitlines()[3] and out.splitlines()[3].endswith("0.923x")  # 40/43.3
    rows = compare.summarise(compare.collect([f"mine={a}", f"theirs={b}"]), baseline="x", skip_first=1)
    assert all(r["speedup"] != r["speedup"] for r in rows)  # NaN: no baseline "x"
    assert all(r["speedup_note"] == "no baseline" for r in rows)
    assert "no 'x' run in case -" in compare.format_table(rows, "x")


def test_loss_parity_column(tmp_path, capsys):
    """The loss column: the largest relative difference from the baseline's per-iteration losses
    (warm-up included, up to a crash), in the table and the CSV; a run of another seed or with a
    non-finite loss says so instead of a number."""
    res = tmp_path / "res"
    base = [10.0, 9.0, 8.0, 7.0]
    _write(res, "c", "same.log", megatron_log([9.0] * 4, losses=base, args={}))
    _write(res, "c", "oases.log", megatron_log([5.0] * 4, losses=[10.0, 9.0, 8.08, 7.0], args={}))
    _write(res, "c", "atp.log", megatron_log([5.0] * 3, total=4, losses=[10.5, 9.0, 8.0],
                                             tail=TRACEBACK, args={}))
    _write(res, "c", "nan.log", megatron_log([5.0] * 4, losses=[10.0, math.nan, 8.0, 7.0], args={}))
    seeded = megatron_log([5.0] * 4, losses=base, args={}).replace(
        "  train_iters", "  seed ............................................ 7\n  train_iters")
    _write(res, "c", "seed7.log", seeded)
    _write(res, "c", "stock.log", megatron_log([9.0] * 4, losses=base, args={}).replace(
        "  train_iters", "  seed ............................................ 1234\n  train_iters"))
    _write(res, "j", "stock.jsonl", json_log([9.0] * 3, losses=[6.0, 5.0, 4.0]))
    _write(res, "j", "oases.jsonl", json_log([5.0] * 3, losses=[6.0, 5.0, 4.0001]))
    out_csv = tmp_path / "s.csv"
    assert compare.main([str(res), "--csv", str(out_csv)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-5:] == ["loss", "vs", "stock", "vs", "stock"]
    table = {tuple(line.split()[:2]): line.split() for line in lines[2:10]}
    assert table["c", "oases"][-2:] == ["1.0e-02", "1.800x"]  # 0.08 / 8.0 at iteration 3
    assert table["c", "same"][-2:] == ["0", "1.000x"]
    assert table["c", "atp"][-2:] == ["5.0e-02", "crashed"]  # 0.5 / 10.0 before the crash
    assert table["c", "nan"][-3:-1] == ["non-finite", "loss"]
    assert table["c", "seed7"][-5:-1] == ["seed", "7", "vs", "1234"]
    assert table["c", "stock"][-2:] == ["-", "1.000x"]  # the baseline itself
    rows = {(r["case"], r["variant"]): r for r in csv.DictReader(open(out_csv))}
    assert float(rows["j", "oases"]["loss_rel_diff"]) == pytest.approx(0.0001 / 4.0)
    assert rows["j", "oases"]["loss_iterations"] == "3" and rows["j", "stock"]["loss_rel_diff"] == ""
    assert rows["c", "seed7"]["loss_note"] == "seed 7 vs 1234"


def test_cpu_timings_get_one_caveat_line(tmp_path, capsys):
    """Runs whose logs show CPU ranks (the entries' start-up line, a ``device`` argument, or
    Megatron-LM's gloo backend) get one caveat line after the table; GPU runs none."""
    res = tmp_path / "res"
    gpu = ("megatron_oases: model --tp-backend megatron (1-D TP) | --schedule default | no plan | "
           "TP 2 x PP 1 x DP 1 on 2 ranks | cuda, nccl")
    _write(res, "g", "stock.log", megatron_log([9.0] * 3, head=gpu))
    _write(res, "g", "oases.log", megatron_log([5.0] * 3, head=gpu.replace("default", "oases")))
    assert compare.main([str(res)]) == 0
    assert "CPU timings" not in capsys.readouterr().out
    _write(res, "c", "stock.log", megatron_log([9.0] * 3, head=gpu.replace("cuda, nccl", "cpu, gloo")))
    _write(res, "c", "oases.jsonl", json_log([5.0] * 3))
    _write(res, "c", "oases.args.json", json.dumps(["--device", "cpu", "--schedule", "oases"]))
    args = ARGS_BLOCK.replace("  train_iters", "  distributed_backend ............................. "
                              "gloo\n  train_iters")
    _write(res, "c", "atp.log", megatron_log([5.0] * 3).replace(
        "> building GPT model ...", args.format(bf16=False, hidden=1024, n=3, impl="local")))
    assert compare.main([str(res)]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "CPU timings" in ln]
    assert len(notes) == 1 and notes[0].startswith("note: CPU timings (c/stock, c/atp, c/oases): ")
    rows = compare.summarise(compare.collect([str(res / "c")]), baseline="stock", skip_first=1)
    assert [r["device"] for r in rows] == ["cpu"] * 3
    assert "CPU timings (every run)" in compare.format_table(rows, "stock")


def test_png_is_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch, capsys):
    log = tmp_path / "stock.log"
    log.write_text(megatron_log([10.0, 10.0]))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert compare.main([str(tmp_path), "--png", str(tmp_path / "x.png")]) == 0
    assert "matplotlib is not installed; skipped" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_bad_arguments(tmp_path, capsys):
    """Bad input: one ``compare.py: error:`` line and exit 2, as every tool of the project."""
    def refused(argv, needle):
        assert compare.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("compare.py: error: ") and needle in err[0], err

    refused([str(tmp_path / "missing.log")], "neither a log file nor a directory")
    refused([str(tmp_path)], "no *.log")
    (tmp_path / "stock.log").write_text(megatron_log([1.0]))
    (tmp_path / "stock.args.json").write_text("{not json")
    refused([str(tmp_path)], "stock.args.json: cannot be read as JSON")


TINY = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--train-iters", "3",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--vocab-size", "128"]


def test_smoke_reference_trainer_into_compare(tmp_path):
    """The reference trainer's --log-json output, default schedule and our variants, through
    compare.py (what a results directory of real runs goes through). Each run is the trainer's
    ``main`` on its 2 ranks as torchrun starts them (forkserver ranks, ``tests/rank_fns_main.py``:
    no interpreter and imports per run)."""
    from tests.rank_fns_main import main_on_ranks

    case = tmp_path / "results" / "tiny"
    case.mkdir(parents=True)
    variants = {"stock": [], "atp-1x2-c2": ["--tp-backend", "atp", "--atp-mesh", "1,2",
                                            "--atp-chunks", "2"],
                "oases": ["--schedule", "oases"]}
    assert TINY[:2] == ["--nproc-per-node", "2"]
    for name, extra in variants.items():
        rc, out = main_on_ranks("megatron_oases.train", 2, [*TINY[2:], *extra, "--log-json",
                                                            str(case / f"{name}.jsonl")])
        assert rc == 0, out[-3000:]
        assert "elapsed time per iteration (ms)" in out
    out_csv = tmp_path / "speedup.csv"
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "results"), "--csv", str(out_csv)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(open(out_csv)))
    assert [r["variant"] for r in rows] == ["stock", "atp-1x2-c2", "oases"]
    assert all(r["status"] == "complete" and r["iterations"] == "3" and r["compared_iterations"] == "2"
               and float(r["speedup"]) > 0 for r in rows)
    assert float(rows[0]["speedup"]) == 1.0
    # same seed, same layout: ATP's and Oases' losses are stock's (the loss column)
    assert all(r["loss_iterations"] == "3" and float(r["loss_rel_diff"]) < 1e-5 for r in rows[1:])
