"""examples/: the paper model files through the tools' own parsers and CLIs, and the CPU walk-through
(mesh -> plan -> profile -> sim -> train stock / oases / oases + plan -> compare.py) end to end."""
from __future__ import annotations

import csv
import glob
import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml
from tests.script_modules import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
MODELS = sorted(glob.glob(os.path.join(EXAMPLES, "models", "*.yaml")))

model_flags = load_script("examples/model_flags.py", "oases_model_flags")


def test_every_model_file_parses_for_plan_train_sim_and_mesh():
    from megatron_oases.plan.graph import model_from_mapping
    from megatron_oases.plan.mesh_cli import _parser as mesh_parser
    from megatron_oases.sim.frontends.cli import build_parser as sim_parser
    from megatron_oases.train_args import build_parser as train_parser

    names = {os.path.basename(p)[:-5] for p in MODELS}
    assert {"oases-h2048", "oases-h4096", "oases-h8192", "oases-gpt-18.4b", "atp-m1", "atp-m4",
            "tp3d-weak-8gpu", "tp3d-strong-64gpu", "walkthrough-tiny"} <= names
    for path in MODELS:
        raw = yaml.safe_load(open(path))
        m = model_from_mapping(raw, source=path)  # what `megatron-oases plan --model` accepts
        t = train_parser().parse_args(model_flags.model_flags(path, "train"))
        assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.seq_length, t.micro_batch_size,
                t.tensor_model_parallel_size, t.ffn_hidden_size) == \
            (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.micro_batch_size, m.tp,
             m.ffn_hidden_size), path
        assert (t.bf16, t.fp16) == (m.dtype == "bf16", m.dtype == "fp16"), path
        s = sim_parser().parse_args(model_flags.model_flags(path, "sim"))
        assert (s.num_layers, s.hidden_size, s.tensor_model_parallel_size, s.dtype) == (m.num_layers, m.hidden_size, m.tp, m.dtype)
        k = mesh_parser().parse_args(["--topology", "dgx-a100"] + model_flags.model_flags(path, "mesh"))
        from megatron_oases.plan.mesh_cli import run_shape

        _, shape = run_shape(k)  # the layer the picker prices is the planner's
        assert k.tensor_model_parallel_size == m.tp, path
        assert (shape.hidden_size, shape.num_layers, shape.seq_length, shape.num_attention_heads,
                shape.ffn_hidden_size, shape.dtype, shape.variant) == \
            (m.hidden_size, m.num_layers, m.seq_length, m.num_attention_heads, m.ffn_hidden_size,
             m.dtype, m.variant), path  # (rotary and QK-norm are no flags of mesh: no model file has them)


def test_a_stated_attention_backend_reaches_every_tool(tmp_path):
    """A model file that states ``attention_backend`` gives it to train and sim (the planner reads
    it itself); one that does not leaves each tool its own default."""
    from megatron_oases.describe.core_attention import core_attention_of
    from megatron_oases.sim.frontends.cli import build_parser as sim_parser
    from megatron_oases.train_args import build_parser as train_parser

    # bf16: the planner, pricing a GPU, refuses flash in fp32 (no kernel; test_planner_cli.py)
    base = open(os.path.join(EXAMPLES, "models", "walkthrough-tiny.yaml")).read().replace("dtype: fp32", "dtype: bf16")
    from megatron_oases.plan.plan_cli import build_parser as plan_parser, model_from_args

    for key, value, kind in (("attention-backend", "local", "local"), ("attention_backend", "unfused", "unfused"),
                             ("attention-backend", "flash", "fused"), ("attention_backend", "auto", "fused")):
        path = tmp_path / f"{value}.yaml"
        path.write_text(base + f"\n{key}: {value}\n")
        t = train_parser().parse_args(model_flags.model_flags(str(path), "train"))
        s = sim_parser().parse_args(model_flags.model_flags(str(path), "sim"))
        assert t.attention_backend == s.attention_backend == value  # the file's value, not only its kind
        assert core_attention_of(attention_backend=t.attention_backend) == kind
        plan = plan_parser().parse_args(["--model", str(path), "--topology", "x", "--global-batch-size", "8"])
        assert model_from_args(plan).core_attention == kind  # the planner reads either spelling
    assert "--attention-backend" not in model_flags.model_flags(
        os.path.join(EXAMPLES, "models", "walkthrough-tiny.yaml"), "sim")


def test_paper_values_in_the_model_files():
    """The files carry the papers' tables (Oases Table 4/5, ATP Table 2, 3-D TP Tables 1-2)."""
    def load(name):
        return yaml.safe_load(open(os.path.join(EXAMPLES, "models", name + ".yaml")))
    oases = {1024: (24, 16, 2), 2048: (24, 32, 4), 3072: (24, 48, 4), 4096: (16, 64, 4),
             6144: (16, 96, 8), 8192: (8, 128, 8), 12288: (4, 192, 8)}
    for h, (layers, heads, tp) in oases.items():
        d = load(f"oases-h{h}")
        assert (d["hidden_size"], d["num_layers"], d["num_attention_heads"], d["tensor_model_parallel_size"],
                d["seq_length"]) == (h, layers, heads, tp, 1024)
    for name, h, heads in [("atp-m1", 2048, 16), ("atp-m2", 4096, 32), ("atp-m3", 8192, 64), ("atp-m4", 12288, 96)]:
        d = load(name)
        assert (d["hidden_size"], d["num_attention_heads"], d["micro_batch_size"], d["seq_length"],
                d["dtype"]) == (h, heads, 4, 2048, "fp16")
    assert (load("tp3d-weak-8gpu")["micro_batch_size"], load("tp3d-weak-64gpu")["hidden_size"]) == (192, 8192)
    assert load("oases-gpt-39.1b")["num_layers"] == 48 and load("oases-gpt-18.4b")["hidden_size"] == 6144


def test_paper_models_through_plan_mesh_and_sim(tmp_path, capsys):
    from megatron_oases.plan.mesh_cli import mesh_main
    from megatron_oases.plan.plan_cli import plan_main
    from megatron_oases.sim.frontends.cli import sim_main

    # Oases Table 6's models: the planner gives one degree per block of every layer
    for h, layers in [(2048, 24), (4096, 16), (8192, 8)]:
        out = tmp_path / f"plan-{h}.json"
        assert plan_main(["--model", os.path.join(EXAMPLES, "models", f"oases-h{h}.yaml"), "--topology",
                          "pcie-3090-2node", "--global-batch-size", "32", "--out", str(out), "--quiet"]) == 0
        plan = json.loads(out.read_text())
        assert plan["num_layers"] == layers and len(plan["degrees"]) == 2 * layers
    # ATP's M1-M4 on 8 GPUs: a mesh pick
    for m in ("atp-m1", "atp-m2", "atp-m3", "atp-m4"):
        flags = model_flags.model_flags(os.path.join(EXAMPLES, "models", f"{m}.yaml"), "mesh")
        assert mesh_main(["--topology", "pcie-ic1", *flags, "--json", str(tmp_path / "m.json")]) == 0
        pick = json.loads((tmp_path / "m.json").read_text())["pick"]
        assert pick["d1"] * pick["d2"] == 8
    # the 3-D weak/strong scaling points on 8 GPUs, as stock 1-D TP in the simulator
    for m in ("tp3d-weak-8gpu", "tp3d-strong-8gpu"):
        flags = model_flags.model_flags(os.path.join(EXAMPLES, "models", f"{m}.yaml"), "sim")
        assert sim_main(["--topology", "dgx-a100", *flags, "--dp", "1", "--num-microbatches", "1"]) == 0
        assert re.search(r"iteration [0-9.,]+ ms", capsys.readouterr().out)


def test_model_flags_bad_input(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layers: 2\nhidden: 64\nlayerz: 3\n")
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "model_flags.py"), str(bad), "--for", "sim"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "unknown field 'layerz'" in proc.stderr


def test_walkthrough_end_to_end(tmp_path):
    """examples/walkthrough.sh on 2 CPU ranks; every output holds what examples/README.md says."""
    out = tmp_path / "wt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    bindir = os.path.dirname(sys.executable)
    env.update(ITERS="4", OASES=os.path.join(bindir, "megatron-oases"), PYTHON=sys.executable)
    start = time.monotonic()
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, "walkthrough.sh"), str(out)], capture_output=True,
                          text=True, env=env, timeout=600)
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"walk-through wall time {wall:.0f} s")
    assert "walk-through done in" in proc.stdout

    mesh = json.loads((out / "mesh.json").read_text())
    assert mesh["tp"] == 2 and mesh["pick"]["d1"] * mesh["pick"]["d2"] == 2
    plan = json.loads((out / "plan.json").read_text())
    assert plan["num_layers"] == 2 and plan["tensor_model_parallel_size"] == 2
    assert len(plan["degrees"]) == 4 and all(d in (1, 2) for d in plan["degrees"])
    assert sorted({b["layer"] for b in plan["predicted"]["blocks"]}) == [0, 1]
    profile = json.loads((out / "profile.json").read_text())
    assert profile["format"].startswith("megatron-oases-profile/") and profile["events"]
    # every event took time; the trainer's loop overhead (loop.*) is at least 0
    assert all(v > 0 or (v == 0 and "loop." in k) for k, v in profile["events"].items())
    assert "schedule default" in (out / "sim_stock.txt").read_text()
    assert "schedule oases" in (out / "sim_oases.txt").read_text()
    assert float(re.search(r"predicted step time: ([0-9.]+) ms", (out / "predict_oases.txt").read_text())[1]) > 0

    runs = {}
    for name in ("stock", "oases", "oases-plan"):
        recs = [json.loads(line) for line in open(out / "results" / "tiny" / f"{name}.jsonl")]
        assert [r["iteration"] for r in recs] == [1, 2, 3, 4] and all(r["step_ms"] > 0 for r in recs)
        assert json.loads((out / "results" / "tiny" / f"{name}.args.json").read_text())[:2] == ["--nproc-per-node", "2"]
        runs[name] = recs
    for name in ("oases", "oases-plan"):  # same model and data: the same losses
        for a, b in zip(runs["stock"], runs[name]):
            assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5), name

    table = (out / "speedup.txt").read_text().splitlines()
    assert table[0].split()[:4] == ["case", "variant", "status", "iters"]
    body = {line.split()[1]: line for line in table[2:5]}
    assert set(body) == {"stock", "oases", "oases-plan"}
    for name, line in body.items():
        assert line.split()[2] == "complete" and line.split()[3] == "4/4", line
        assert re.search(r"\d\.\d{3}x$", line), line
    assert body["stock"].endswith("1.000x")
    for name in ("oases", "oases-plan"):  # the loss column: stock's losses
        cell = body[name].split()[-2]
        assert cell == "0" or float(cell) < 1e-5, body[name]
    assert [line for line in table if line.startswith("note: CPU timings (every run)")]
    assert not [line for line in table if line.startswith("warning:")]
    rows = {r["variant"]: r for r in csv.DictReader(open(out / "speedup.csv"))}
    assert {r["status"] for r in rows.values()} == {"complete"}
    assert all(r["compared_iterations"] == "3" and float(r["speedup"]) > 0 for r in rows.values())
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
