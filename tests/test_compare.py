"""scripts/compare.py: logs -> speedup table, CSV, PNG; and a smoke run of the reference trainer."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "compare.py")

spec = importlib.util.spec_from_file_location("oases_compare", SCRIPT)
compare = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = compare  # dataclasses look their module up
spec.loader.exec_module(compare)

MEGATRON_LINE = (" [2025-11-22 01:02:03.456789] iteration {it:8d}/      10 | consumed samples:"
                 "          {s:3d} | elapsed time per iteration (ms): {ms:.1f} | throughput per GPU "
                 "(TFLOP/s/GPU): {tf:.1f} | learning rate: 1.000000E-04 | global batch size:     8 |"
                 " lm loss: 1.043210E+01 | loss scale: 1.0 | grad norm: 2.345 |")


def megatron_log(step_ms, tflops=100.0) -> str:
    lines = ["> building GPT model ...", "[before the start of training step] datetime: ..."]
    lines += [MEGATRON_LINE.format(it=i + 1, s=8 * (i + 1), ms=ms, tf=tflops) for i, ms in enumerate(step_ms)]
    return "\n".join(lines + ["[after training is done] datetime: ..."]) + "\n"


def json_log(step_ms) -> str:
    return "".join(json.dumps({"iteration": i + 1, "lm_loss": 5.0, "step_ms": ms,
                               "tokens_per_s": 1000.0 / ms, "tflops_per_rank": 0.5}) + "\n"
                   for i, ms in enumerate(step_ms))


def test_parse_both_formats():
    steps, tflops, tokens = compare.parse_log(megatron_log([500.0, 100.0, 110.0]))
    assert steps == [500.0, 100.0, 110.0] and tflops == [100.0] * 3 and tokens == []
    steps, tflops, tokens = compare.parse_log(json_log([20.0, 10.0]) + "not json {\n")
    assert steps == [20.0, 10.0] and tflops == [0.5, 0.5] and len(tokens) == 2
    trainer = (" iteration        2/       3 | lm loss: 5.5E+00 | grad norm: 1.569 | elapsed time per "
               "iteration (ms): 46.2 | tokens/s: 1385.3 | TFLOP/s per rank: 0.0001")
    assert compare.parse_log(trainer) == ([46.2], [0.0001], [1385.3])


def test_results_directory_table_csv_png(tmp_path, capsys):
    res = tmp_path / "results"
    for case, runs in {"h1024": {"stock": [900, 200, 200], "oases": [900, 100, 100]},
                       "h2048": {"stock": [900, 300, 300], "oases": [], "atp-2x2-c2": [1, 150, 150]}}.items():
        (res / case).mkdir(parents=True)
        for variant, steps in runs.items():
            (res / case / f"{variant}.log").write_text(megatron_log(steps) if steps else "Traceback\n")
    (res / "env.txt").write_text("not a log")
    out_csv, out_png = tmp_path / "s.csv", tmp_path / "s.png"
    assert compare.main([str(res), "--csv", str(out_csv), "--png", str(out_png)]) == 0
    table = capsys.readouterr().out
    assert "no data" in table and "2.000x" in table
    rows = {(r["case"], r["variant"]): r for r in csv.DictReader(open(out_csv))}
    assert set(rows) == {("h1024", "stock"), ("h1024", "oases"), ("h2048", "stock"),
                         ("h2048", "oases"), ("h2048", "atp-2x2-c2")}
    assert float(rows["h1024", "oases"]["speedup"]) == pytest.approx(2.0)
    assert float(rows["h2048", "atp-2x2-c2"]["speedup"]) == pytest.approx(2.0)
    assert float(rows["h1024", "stock"]["step_ms_mean"]) == pytest.approx(200.0)  # warm-up skipped
    assert rows["h2048", "oases"]["iterations"] == "0" and rows["h2048", "oases"]["speedup"] == ""
    assert list(rows)[0] == ("h1024", "stock")  # the baseline leads its case
    if importlib.util.find_spec("matplotlib"):
        assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_labels_baseline_choice_and_missing_baseline(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.log"
    a.write_text(json_log([50.0, 40.0, 40.0]))
    b.write_text(megatron_log([80.0, 20.0, 20.0]))
    assert compare.main([f"mine={a}", f"theirs={b}", "--baseline", "theirs", "--skip-first", "0"]) == 0
    out = capsys.readouterr().out
    assert "theirs" in out.splitlines()[2]  # baseline row first
    rows = compare.summarise(compare.collect([f"mine={a}", f"theirs={b}"]), baseline="x", skip_first=1)
    assert all(r["speedup"] != r["speedup"] for r in rows)  # NaN: no baseline "x"
    assert "no 'x' run" in compare.format_table(rows, "x")


def test_png_is_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch, capsys):
    log = tmp_path / "stock.log"
    log.write_text(megatron_log([10.0, 10.0]))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert compare.main([str(tmp_path), "--png", str(tmp_path / "x.png")]) == 0
    assert "matplotlib is not installed; skipped" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_bad_arguments(tmp_path):
    with pytest.raises(SystemExit, match="neither a log file nor a directory"):
        compare.main([str(tmp_path / "missing.log")])
    with pytest.raises(SystemExit, match="no \\*.log"):
        compare.main([str(tmp_path)])


TINY = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--train-iters", "3",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--vocab-size", "128"]


def test_smoke_reference_trainer_into_compare(tmp_path):
    """The reference trainer's --log-json output, default schedule and our variants, through
    compare.py (what a results directory of real runs goes through)."""
    case = tmp_path / "results" / "tiny"
    case.mkdir(parents=True)
    variants = {"stock": [], "atp-1x2-c2": ["--tp-backend", "atp", "--atp-mesh", "1,2",
                                            "--atp-chunks", "2"],
                "oases": ["--schedule", "oases"]}
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    for name, extra in variants.items():
        proc = subprocess.run([sys.executable, "-m", "megatron_oases.train", *TINY, *extra,
                               "--log-json", str(case / f"{name}.jsonl")],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "elapsed time per iteration (ms)" in proc.stdout
    out_csv = tmp_path / "speedup.csv"
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "results"), "--csv", str(out_csv)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(open(out_csv)))
    assert [r["variant"] for r in rows] == ["stock", "atp-1x2-c2", "oases"]
    assert all(r["iterations"] == "2" and float(r["speedup"]) > 0 for r in rows)
    assert float(rows[0]["speedup"]) == 1.0
