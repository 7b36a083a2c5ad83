"""Plan files, compact notation, launch-command rewriting and ``megatron-oases plan``."""
from __future__ import annotations

import json

import pytest

from megatron_oases.cli import main as cli_main
from megatron_oases.errors import ConfigError
from megatron_oases.plan.plan_cli import plan_main
from megatron_oases.plan.plan_file import (PLAN_FORMAT, compact_notation, load_plan, parse_compact,
                                           rewrite_command)

MODEL = """num_layers: 4
hidden_size: 1024
num_attention_heads: 16
seq_length: 512
ffn_hidden_size: 4096
vocab: 51200
micro_batch_size: 4
tp: 4
"""


def test_compact_notation_round_trips():
    d = [2] * 8 + [4] * 16
    assert compact_notation(d) == "[[2] * 8 + [4] * 16]"
    assert parse_compact("[[2] * 8 + [4] * 16]") == tuple(d)
    assert parse_compact(compact_notation([1, 2, 2, 1])) == (1, 2, 2, 1)
    assert parse_compact("[2, 4]") == (2, 4)


def _plan_file(tmp_path, **over):
    data = {"format": PLAN_FORMAT, "tensor_model_parallel_size": 4, "num_layers": 2,
            "block_kinds": ["attention", "mlp"], "degrees": [2, 2, 4, 4]}
    data.update(over)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(data))
    return p


def test_load_plan_accepts_a_good_file(tmp_path):
    plan = load_plan(_plan_file(tmp_path), num_layers=2, tp=4)
    assert plan.degrees == (2, 2, 4, 4) and plan.layer_degrees(1) == {"attention": 4, "mlp": 4}
    assert plan.per_layer == (2, 4)


@pytest.mark.parametrize("over,kw,match", [
    ({"degrees": [2, 2, 3, 4]}, {}, "block 2 .*degree 3.*not a power of two dividing --tensor-model-parallel-size 4"),
    ({"degrees": [2, 2, 8, 4]}, {}, "degree 8"),
    ({"degrees": [2, 2, 4]}, {}, "has 3 block degrees; 2 layers need 4"),
    ({}, {"num_layers": 3}, "--num-layers 2 but the launch uses 3"),
    ({}, {"tp": 8}, "--tensor-model-parallel-size 4 but the launch uses 8"),
    ({"format": "x/0"}, {}, "format is 'x/0'"),
    ({"degrees": "2,2,4,4"}, {}, "must be a list of integers"),
])
def test_load_plan_errors_are_one_line_naming_the_flag(tmp_path, over, kw, match):
    args = {"num_layers": 2, "tp": 4, **kw}
    with pytest.raises(ConfigError, match=match) as e:
        load_plan(_plan_file(tmp_path, **over), **args)
    assert str(e.value).startswith("--oases-plan ") and "\n" not in str(e.value)


def test_load_plan_malformed_and_missing(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path, match in ((bad, "not valid JSON"), (tmp_path / "nope.json", "cannot be read")):
        with pytest.raises(ConfigError, match=match) as e:
            load_plan(path, num_layers=2, tp=4)
        assert str(e.value).startswith("--oases-plan ") and "\n" not in str(e.value)


def test_rewrite_command_replaces_adds_and_keeps_the_rest():
    cmd = "torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 8 --lr 'a  b' --x=\"q r\""
    out = rewrite_command(cmd, tp=4, plan_path="p.json")
    assert out == ("torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 4 --lr 'a  b' "
                   "--x=\"q r\" --oases-plan p.json")
    cmd = "python train.py \\\n  --tensor-model-parallel-size=2 --oases-plan old.json --oases-plan older.json\n"
    out = rewrite_command(cmd, tp=4, plan_path="my plan.json")
    assert out == "python train.py \\\n  --tensor-model-parallel-size 4 --oases-plan 'my plan.json'\n"
    assert rewrite_command("run", tp=2, plan_path="p") == "run --tensor-model-parallel-size 2 --oases-plan p"


def test_plan_cli_end_to_end(tmp_path, capsys):
    cfg = tmp_path / "model.yaml"
    cfg.write_text(MODEL)
    out = tmp_path / "plan.json"
    rc = cli_main(["plan", "--model", str(cfg), "--topology", "pcie-3090-2node", "--global-batch-size", "16",
                   "--memory-gb", "6", "--out", str(out), "--granularity", "layer",
                   "--rewrite-cmd", "torchrun x.py --tensor-model-parallel-size 8 --seed 1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    plan = load_plan(out, num_layers=4, tp=4)
    data = json.loads(out.read_text())
    assert data["compact"] in text and data["compact_layers"] in text and plan.per_layer is not None
    assert f"launch flags: --tensor-model-parallel-size 4 --oases-plan {out}" in text
    assert f"launch command: torchrun x.py --tensor-model-parallel-size 4 --seed 1 --oases-plan {out}" in text
    assert data["predicted"]["memory_gib"] <= 6 and len(data["predicted"]["blocks"]) == 8
    assert data["inputs"]["num_microbatches"] == 2 and data["inputs"]["data_parallel_size"] == 2
    assert "run the plan with --oases-plan" in text
    # The trainer accepts the plan file as written (a layer-granularity plan).
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    args = build_parser().parse_args(["--num-layers", "4", "--hidden-size", "1024",
                                      "--num-attention-heads", "16", "--micro-batch-size", "4",
                                      "--global-batch-size", "16", "--tensor-model-parallel-size",
                                      "4", "--oases-plan", str(out)])
    cfg = validate_config(run_config(args), 8, cuda=False)
    assert cfg.oases_layer_degrees == tuple((d, d) for d in plan.per_layer)


def test_plan_cli_flags_only_and_errors(tmp_path, capsys):
    base = ["--topology", "pcie-3090-2node", "--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "256", "--micro-batch-size", "4", "--tensor-model-parallel-size", "4",
            "--out", str(tmp_path / "p.json"), "--quiet"]
    assert plan_main(base + ["--global-batch-size", "8"]) == 0
    capsys.readouterr()
    cases = [(["--global-batch-size", "8", "--memory-gb", "0.01"], "--memory-gb 0.01 is too small: the least memory"),
             (["--global-batch-size", "12"], "--global-batch-size 12 is not divisible"),
             (["--global-batch-size", "8", "--gpu", "tpu"], "unknown GPU 'tpu'"),
             (["--global-batch-size", "8", "--degrees", "3"], "--degrees 3"),
             (["--global-batch-size", "8", "--degrees", ""], "--degrees must be comma-separated integers (got '')"),
             (["--global-batch-size", "8", "--degrees", "2,2"], "--degrees 2,2 names one twice"),
             (["--global-batch-size", "8", "--rewrite-cmd", " "], "--rewrite-cmd is empty"),
             (["--global-batch-size", "8", "--strict-profile"], "--strict-profile requires every event in --profile"),
             (["--global-batch-size", "8", "--time-limit", "5"], "--time-limit bounds an ILP solver and has no "
                                                                 "effect with --solver auto")]
    for extra, match in cases:
        assert plan_main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and len(err.splitlines()) == 1, err
    # no model flags, no --model: the trainer's defaults (megatron_oases.flags), as its launch runs them
    assert plan_main(["--topology", "pcie-3090-2node", "--data-parallel-size", "1", "--quiet",
                      "--out", str(tmp_path / "d.json")]) == 0
    assert "Oases plan: 4 layers, h 64, 4 heads, s 32" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"])
def test_virtual_stages_are_refused_in_one_line_before_any_work(flag, tmp_path, capsys):
    """Megatron-LM's two spellings of virtual pipeline stages (which ``sim`` and the trainer take):
    the planner prices a stage as contiguous layers under non-interleaved 1F1B, so it refuses them
    in one line naming the flag and the fix, before reading the topology (none here) or writing a
    plan (issue 49)."""
    out = tmp_path / "p.json"
    assert plan_main(["--topology", "no-such-topology", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
                      flag, "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} 2: plan prices each pipeline stage" in err[0], err
    assert "non-interleaved 1F1B" in err[0] and "drop it" in err[0] and not out.exists()


@pytest.mark.parametrize("stated_in", ["flags", "model-file"])
def test_flash_attention_in_fp32_is_refused(stated_in, tmp_path, capsys):
    """The planner prices a GPU, where the flash kernel has no fp32 variant (as the trainer refuses
    it on CUDA): one line naming the flag and the fix, from the flags or the model file."""
    cfg = tmp_path / "m.yaml"
    cfg.write_text(MODEL + "dtype: fp32\n" + ("attention_backend: flash\n" if stated_in == "model-file" else ""))
    argv = ["--topology", "pcie-3090-2node", "--model", str(cfg), "--global-batch-size", "8",
            "--out", str(tmp_path / "p.json"), "--quiet"]
    assert plan_main(argv + (["--attention-backend", "flash"] if stated_in == "flags" else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--attention-backend flash has no fp32 kernel; add --dtype bf16 or fp16" in err[0], err
    assert not (tmp_path / "p.json").exists()


def test_whole_model_atp_plan_rewrites_the_backend_flags(tmp_path, capsys):
    """With --families megatron,atp and a budget only ATP 4x2 meets well, the plan's launch flags
    select the ATP backend (no --oases-plan); the trainer refuses the file as --oases-plan."""
    out = tmp_path / "p.json"
    rc = plan_main(["--topology", "nvlink-pairs", "--gpu", "rtx-3090", "--num-layers", "8", "--hidden-size", "4096",
                    "--num-attention-heads", "32", "--seq-length", "1024", "--micro-batch-size", "4",
                    "--tensor-model-parallel-size", "8", "--global-batch-size", "16", "--memory-gb", "5.3", "--bf16",
                    "--families", "megatron,atp", "--out", str(out), "--quiet",
                    "--rewrite-cmd", "torchrun x.py --tensor-model-parallel-size 4 --oases-plan old.json --bf16"])
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads(out.read_text())
    assert set(data["strategies"]) == {"atp4x2"} and "atp4x2" in data["inputs"]["candidate_strategies"]
    assert "launch flags: --tensor-model-parallel-size 8 --tp-backend atp --atp-mesh 4,2\n" in text
    assert "launch command: torchrun x.py --tensor-model-parallel-size 8 --bf16 --tp-backend atp --atp-mesh 4,2\n" in text
    with pytest.raises(ConfigError, match="launch with --tp-backend atp --atp-mesh 4,2 instead of --oases-plan") as e:
        load_plan(out, num_layers=8, tp=8)
    assert "\n" not in str(e.value)
    assert plan_main(["--topology", "pcie-3090-2node", "--num-layers", "4", "--hidden-size", "512",
                      "--num-attention-heads", "8", "--seq-length", "64", "--micro-batch-size", "4", "--tensor-model-parallel-size", "8",
                      "--global-batch-size", "16", "--families", "megatron,cube", "--out", str(out)]) == 2
    assert "--families: 'cube' is not one of megatron, atp, 3d" in capsys.readouterr().err


def test_llama_model_flags(tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = ["--topology", "pcie-3090-2node", "--num-layers", "2", "--hidden-size", "256",
            "--num-attention-heads", "8", "--seq-length", "64", "--micro-batch-size", "8",
            "--tensor-model-parallel-size", "8", "--global-batch-size", "16", "--swiglu",
            "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
            "--disable-bias-linear", "--out", str(out), "--quiet"]
    assert plan_main(argv) == 0, capsys.readouterr()
    degrees = json.loads(out.read_text())["degrees"]
    assert all(d <= 2 for d in degrees[0::2])  # attention blocks keep whole key/value groups
    capsys.readouterr()
    bad = [a for a in argv if a != "--group-query-attention"]
    assert plan_main(bad) == 2
    assert "--num-query-groups needs --group-query-attention" in capsys.readouterr().err


def test_rope_and_qk_norm_flags_and_model_file_keys(tmp_path, capsys):
    """--position-embedding-type rope (--rotary-percent) and --qk-layernorm, or the same keys in
    the model file, reach the plan's model and its layer variant; the plan runs."""
    out = tmp_path / "p.json"
    argv = ["--topology", "pcie-3090-2node", "--num-layers", "2", "--hidden-size", "256",
            "--num-attention-heads", "8", "--seq-length", "64", "--micro-batch-size", "8",
            "--tensor-model-parallel-size", "8", "--global-batch-size", "16", "--swiglu", "--normalization",
            "RMSNorm", "--disable-bias-linear", "--out", str(out), "--quiet"]
    assert plan_main(argv + ["--position-embedding-type", "rope", "--rotary-percent", "0.5", "--qk-layernorm"]) == 0
    model = json.loads(out.read_text())["inputs"]["model"]
    assert (model["position_embedding_type"], model["rotary_percent"], model["qk_layernorm"]) == ("rope", 0.5, True)
    cfg = tmp_path / "model.yaml"
    cfg.write_text("position_embedding_type: rope\nqk_layernorm: true\n")
    assert plan_main(argv + ["--model", str(cfg)]) == 0
    assert json.loads(out.read_text())["inputs"]["model"]["qk_layernorm"] is True
    capsys.readouterr()
    assert plan_main(argv + ["--rotary-percent", "0.5"]) == 2
    assert "applies to --position-embedding-type rope only" in capsys.readouterr().err


def test_a_closed_pipe_stops_quietly():
    """``megatron-oases sim ... | true``: the reader is gone before the first write (simulating
    takes longer than ``true``), stdout block-buffered (PYTHONUNBUFFERED cleared), the whole output
    smaller than the buffer, so it only leaves at the final flush: that flush must fail inside the
    handler, not at interpreter exit ("Exception ignored ... BrokenPipeError", status 120)."""
    import os
    import subprocess
    import sys

    cmd = (f"{sys.executable} -m megatron_oases.cli sim --topology dgx-a100 --num-layers 2 --hidden-size 256 "
           "--num-attention-heads 8 --seq-length 128 --micro-batch-size 2 --tensor-model-parallel-size 2 "
           "--global-batch-size 64 | true")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=300, env=env)
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode == 1, done.returncode  # pipefail: the command's own status


def test_no_command_is_a_usage_error(capsys):
    """``megatron-oases`` alone: the usage on stderr and exit 2; ``--help``: on stdout, exit 0."""
    assert cli_main([]) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith("megatron-oases: error: a command is required") and "usage:" in err
    assert cli_main(["--help"]) == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("extra, match", [
    (["--global-batch-size", "0"], "--global-batch-size must be a positive integer (got 0)"),
    (["--global-batch-size", "-8"], "--global-batch-size must be a positive integer (got -8)"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be a positive integer (got 0)"),
    (["--memory-gb", "nan"], "--memory-gb must be a number > 0 (got nan)"),
    (["--memory-gb", "inf"], "--memory-gb must be a number > 0 (got inf)"),
    (["--solver", "cbc", "--time-limit", "0"], "--time-limit must be > 0 (got 0.0)"),
    (["--solver", "ilp", "--time-limit", "-1"], "--time-limit must be > 0 (got -1.0)"),
    (["--families", "megatron,megatron"], "--families megatron,megatron names one twice"),
    (["--families", ","], "--families: '' is not one of megatron, atp, 3d"),
    (["--out", "/proc/plan.json"], "--out /proc/plan.json: /proc is not a writable directory"),
    (["--out", ""], "--out is an empty path"),
    (["--out", "{tmp}/no/such/dir/p.json"], "does not exist; create it or pick another path"),
])
def test_plan_cli_refuses_bad_values_in_one_line_and_writes_nothing(tmp_path, capsys, extra, match):
    """Each was accepted (a plan written for a global batch of 0 or -8; --ffn-hidden-size 0 read
    as 4h; --memory-gb nan; duplicate families) or failed late (the ILP solver's 'Not Solved' for
    --time-limit 0; --out checked only after the solve)."""
    out = tmp_path / "p.json"
    argv = ["--topology", "pcie-3090-2node", "--num-layers", "2", "--hidden-size", "512",
            "--num-attention-heads", "8", "--seq-length", "256", "--micro-batch-size", "4",
            "--tensor-model-parallel-size", "4", "--global-batch-size", "8", "--quiet", "--out", str(out)]
    assert plan_main(argv + [x.format(tmp=tmp_path) for x in extra]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_swiglu_without_ffn_prices_megatron_lms_default(tmp_path, capsys):
    """--swiglu without --ffn-hidden-size: the FFN the launch runs (Megatron-LM's and the
    trainer's int(4h x 2/3 / 64) x 64), not 4h (was: the plan priced 4h, 2x the launch's fc1)."""
    from megatron_oases.run_config import megatron_ffn_hidden_size

    out = tmp_path / "p.json"
    argv = ["--topology", "pcie-3090-2node", "--num-layers", "2", "--hidden-size", "512",
            "--num-attention-heads", "8", "--seq-length", "256", "--micro-batch-size", "4",
            "--tensor-model-parallel-size", "4", "--global-batch-size", "8", "--quiet", "--swiglu",
            "--out", str(out)]
    assert plan_main(argv) == 0, capsys.readouterr().err
    ffn = json.loads(out.read_text())["inputs"]["model"]["ffn_hidden_size"]
    assert ffn == megatron_ffn_hidden_size(512, True) == 1344
    assert plan_main(argv + ["--ffn-hidden-size", "2048"]) == 0  # a stated size stays
    assert json.loads(out.read_text())["inputs"]["model"]["ffn_hidden_size"] == 2048


def _small_plan(tmp_path, *, topology: str = "pcie-3090-2node", tp: int = 4) -> list[str]:
    """A two-layer plan's command line, its plan file in ``tmp_path``."""
    return ["--topology", topology, "--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "256", "--micro-batch-size", "4", "--tensor-model-parallel-size", str(tp),
            "--global-batch-size", "8", "--quiet", "--out", str(tmp_path / "p.json")]


@pytest.mark.parametrize("flags, dtype", [([], "fp32"), (["--bf16"], "bf16"), (["--fp16"], "fp16"),
                                          (["--dtype", "fp32"], "fp32"), (["--fp16", "--dtype", "fp16"], "fp16")])
def test_plan_prices_the_launchs_precision_flags(tmp_path, capsys, flags, dtype):
    """The launch's --bf16 / --fp16 price as --dtype does (``precision.priced_dtype``, sim's rule
    too); none of them: fp32, as the trainer and Megatron-LM (was: bf16; before that, plan refused
    --bf16 / --fp16)."""
    assert plan_main(_small_plan(tmp_path) + flags) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "p.json").read_text())["inputs"]["model"]["dtype"] == dtype


@pytest.mark.parametrize("flags, needle", [(["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive; pick one"),
                                           (["--bf16", "--dtype", "fp32"],
                                            "--bf16 and --dtype fp32 contradict each other; give one"),
                                           (["--fp16", "--dtype", "bf16"],  # was let through: bf16 was the default
                                            "--fp16 and --dtype bf16 contradict each other; give one")])
def test_plan_refuses_two_precisions_in_sims_words(tmp_path, capsys, flags, needle):
    from megatron_oases.sim.frontends.cli import sim_main

    assert plan_main(_small_plan(tmp_path) + flags) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert sim_main(["--topology", "pcie-3090-2node", "--tensor-model-parallel-size", "4", *flags]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("family, tp", [("atp", 4), ("3d", 8)])
def test_whole_model_families_refuse_sequence_parallel_in_the_trainers_words(tmp_path, capsys, family, tp):
    """ATP's and the cube's layers do not run --sequence-parallel: plan leaves them out with the
    trainer's line (the record's ``run_refusal``), as ``train --tp-backend`` refuses the launch
    (was: plan priced an ATP plan with --sequence-parallel that the trainer refuses)."""
    import dataclasses

    from megatron_oases.describe.backends import BACKENDS
    from megatron_oases.run_config import DEFAULTS

    trainers = BACKENDS[family].run_refusal(dataclasses.replace(DEFAULTS, sequence_parallel=True))
    argv = _small_plan(tmp_path, topology="dgx-a100", tp=tp) + ["--families", family]
    assert plan_main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert plan_main(argv + ["--sequence-parallel"]) == 2
    err = capsys.readouterr().err.strip()
    assert trainers and trainers in err and len(err.splitlines()) == 1, err


def test_sequence_parallel_plan_launches_without_oases_plan(tmp_path, capsys):
    """A --sequence-parallel plan is uniform T, and --oases-plan refuses --sequence-parallel at
    launch: the launch flags and --rewrite-cmd drop --oases-plan (were: '--oases-plan FILE', a
    command the trainer refuses)."""
    out = tmp_path / "p.json"
    argv = ["--topology", "pcie-3090-2node", "--num-layers", "2", "--hidden-size", "512",
            "--num-attention-heads", "8", "--seq-length", "256", "--micro-batch-size", "4",
            "--tensor-model-parallel-size", "4", "--global-batch-size", "8", "--quiet", "--sequence-parallel",
            "--out", str(out), "--rewrite-cmd", "x.py --tensor-model-parallel-size 2 --sequence-parallel "
                                                "--oases-plan old.json"]
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "launch flags: --tensor-model-parallel-size 4\n" in text
    assert "launch command: x.py --tensor-model-parallel-size 4 --sequence-parallel\n" in text
    assert "without --oases-plan" in text and out.exists()


@pytest.mark.parametrize("extra, why", [
    (["--tensor-model-parallel-size", "8", "--families", "3d", "--schedule", "oases"],
     ": --tp-backend 3d runs the stock executor (no Oases tape): plan with --schedule default; or add megatron"),
    (["--tensor-model-parallel-size", "4", "--families", "3d", "--global-batch-size", "16"],
     ": 3d has no layout at --tensor-model-parallel-size 4; or add megatron"),
])
def test_no_strategy_of_the_families_says_why(tmp_path, capsys, extra, why):
    """(was: 'add megatron or raise --micro-batch-size' whatever the reason)"""
    argv = ["--topology", "pcie-3090-2node", "--num-layers", "2", "--hidden-size", "512",
            "--num-attention-heads", "8", "--seq-length", "256", "--micro-batch-size", "8",
            "--global-batch-size", "8", "--quiet", "--out", str(tmp_path / "p.json")]
    assert plan_main(argv + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(why) and len(err.splitlines()) == 1, err


# ---- the launch a plan is made for (issue 47) ----------------------------------------------------
LAUNCH_MODEL = ["--topology", "pcie-3090-2node", "--num-layers", "2", "--hidden-size", "512",
                "--num-attention-heads", "8", "--seq-length", "256", "--micro-batch-size", "4",
                "--tensor-model-parallel-size", "2", "--global-batch-size", "16", "--quiet"]
TRAIN_MODEL = ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256",
               "--micro-batch-size", "4", "--global-batch-size", "16", "--tensor-model-parallel-size", "2"]


def _plan(tmp_path, capsys, *extra) -> tuple[str, dict, str]:
    out = tmp_path / "plan.json"
    assert plan_main([*LAUNCH_MODEL, "--out", str(out), *extra]) == 0, capsys.readouterr().err
    return str(out), json.loads(out.read_text()), capsys.readouterr().out


def _train_validate(plan, world, *extra):
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    args = build_parser().parse_args([*TRAIN_MODEL, "--oases-plan", plan, *extra])
    return validate_config(run_config(args), world, cuda=False)


def test_plan_made_for_dp2_is_refused_at_dp4_in_one_line(tmp_path, capsys, monkeypatch):
    """The plan records the launch's world (--nproc-per-node 4, TP 2: DP 2); the trainer and the
    Megatron-LM entry run it at DP 2 and refuse it at DP 4 (was: DP from the topology's 16 GPUs,
    unrecorded, any launch accepted)."""
    plan, data, text = _plan(tmp_path, capsys, "--nproc-per-node", "4")
    assert (data["world_size"], data["data_parallel_size"], data["micro_batch_size"], data["schedule"]) == \
        (4, 2, 4, "default")
    assert data["inputs"]["data_parallel_size"] == 2 and data["inputs"]["num_microbatches"] == 2
    assert "made for: world 4 = TP 2 x DP 2, --micro-batch-size 4, --schedule default" in text
    assert _train_validate(plan, 4).oases_layer_degrees is not None
    with pytest.raises(ConfigError) as e:
        _train_validate(plan, 8)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--oases-plan {plan}: was made for data-parallel size 2 (world 4)")
    assert "this launch's is 4" in msg and "--data-parallel-size 4" in msg
    # the Megatron-LM entry: the same check, one line on stderr, exit 2
    from test_megatron_lm_flags import parse

    monkeypatch.setenv("RANK", "0")
    flags = ["--tensor-model-parallel-size", "2", "--micro-batch-size", "4", "--global-batch-size", "16",
             "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256",
             "--max-position-embeddings", "256", "--num-layers", "2", "--oases-plan", plan]
    parse(flags, world=4, monkeypatch=monkeypatch)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        parse(flags, world=8, monkeypatch=monkeypatch)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "was made for data-parallel size 2" in err


def test_plan_made_for_pp2_is_refused_at_pp1_in_one_line(tmp_path, capsys, monkeypatch):
    """A plan for two pipeline stages (world 4 = TP 2 x PP 2 x DP 1) records PP; the trainer runs
    it at PP 2 and refuses it at PP 1 (world 2, DP 1 too), naming the flag; so does the Megatron-LM
    entry."""
    plan, data, _ = _plan(tmp_path, capsys, "--nproc-per-node", "4", "--pipeline-model-parallel-size", "2")
    assert (data["pipeline_model_parallel_size"], data["data_parallel_size"], len(data["degrees"])) == (2, 1, 4)
    assert _train_validate(plan, 4, "--pipeline-model-parallel-size", "2").oases_layer_degrees is not None
    with pytest.raises(ConfigError) as e:
        _train_validate(plan, 2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--oases-plan {plan}: was made for --pipeline-model-parallel-size 2 "
                                               "but this launch runs --pipeline-model-parallel-size 1"), msg
    from test_megatron_lm_flags import parse

    monkeypatch.setenv("RANK", "0")
    flags = [*TRAIN_MODEL, "--max-position-embeddings", "256", "--oases-plan", plan]
    with pytest.raises(SystemExit) as exc:
        parse(flags, world=2, monkeypatch=monkeypatch)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "--pipeline-model-parallel-size 2" in err


def test_plan_prices_one_stage_of_the_pipeline(tmp_path, capsys):
    """PP 2 prices each stage's one layer (the plan's table: 2 blocks), its first stage keeping two
    micro-batches in flight; a layer count PP does not divide is one line naming the flag."""
    _, one, _ = _plan(tmp_path, capsys, "--nproc-per-node", "2")
    _, two, _ = _plan(tmp_path, capsys, "--nproc-per-node", "4", "--pipeline-model-parallel-size", "2")
    assert len(one["predicted"]["blocks"]) == 4 and len(two["predicted"]["blocks"]) == 2
    b1, b2 = one["predicted"]["blocks"][0], two["predicted"]["blocks"][0]
    assert b1["degree"] == b2["degree"] and b2["memory_bytes"] > b1["memory_bytes"]  # 2 micro-batches in flight
    assert plan_main([*LAUNCH_MODEL, "--out", str(tmp_path / "p.json"), "--nproc-per-node", "6",
                      "--pipeline-model-parallel-size", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--num-layers 2 is not a multiple of --pipeline-model-parallel-size 3; give a divisor"), err


def test_plan_takes_the_world_from_the_launch_flags(tmp_path, capsys):
    _, by_nodes, _ = _plan(tmp_path, capsys, "--nproc-per-node", "2", "--nnodes", "4")
    _, by_dp, _ = _plan(tmp_path, capsys, "--data-parallel-size", "4")
    _, default, text = _plan(tmp_path, capsys)
    assert (by_nodes["world_size"], by_nodes["data_parallel_size"]) == (8, 4) == (by_dp["world_size"],
                                                                              by_dp["data_parallel_size"])
    assert "the topology's ranks" in text and default["inputs"]["world_from"] == "topology"


@pytest.mark.parametrize("extra, needle", [
    (["--nnodes", "2"], "--nnodes needs --nproc-per-node"),
    (["--nproc-per-node", "4", "--data-parallel-size", "4"], "is not the world of --nproc-per-node x --nnodes (4)"),
    (["--nproc-per-node", "3"], "the launch's 3 ranks are not a multiple of --tensor-model-parallel-size 2"),
    (["--nproc-per-node", "8", "--nnodes", "4"], "the launch's 32 ranks exceed the"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1"),
    (["--schedule", "default", "--sub-batches", "2"], "--sub-batches 2 contradicts --schedule default"),
])
def test_plan_launch_flags_bad_input_is_one_line(tmp_path, capsys, extra, needle):
    out = tmp_path / "p.json"
    assert plan_main([*LAUNCH_MODEL, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_sub_batches_follow_the_schedule(tmp_path, capsys):
    """--schedule oases prices 2 sub-batches, the stock schedule (the trainer's default) 1;
    --sub-batches alone still sets the executor; an odd micro-batch under oases names the fix."""
    for extra, want in (([], (1, "default")), (["--schedule", "oases"], (2, "oases")),
                        (["--sub-batches", "2"], (2, "oases")), (["--schedule", "default"], (1, "default"))):
        _, data, _ = _plan(tmp_path, capsys, *extra)
        assert (data["inputs"]["model"]["sub_batches"], data["schedule"]) == want, extra
    argv = [*LAUNCH_MODEL, "--micro-batch-size", "3", "--global-batch-size", "24", "--out", str(tmp_path / "o.json")]
    assert plan_main(argv) == 0  # the stock schedule runs an odd micro-batch
    capsys.readouterr()
    assert plan_main(argv + ["--schedule", "oases"]) == 2
    assert "(--schedule default)" in capsys.readouterr().err


def test_plan_made_for_another_micro_batch_or_schedule_is_refused(tmp_path, capsys):
    plan, _, text = _plan(tmp_path, capsys, "--nproc-per-node", "4", "--schedule", "oases")
    assert f"launch flags: --tensor-model-parallel-size 2 --oases-plan {plan} --schedule oases" in text
    assert _train_validate(plan, 4, "--schedule", "oases").oases_layer_degrees is not None
    with pytest.raises(ConfigError, match="was made for --schedule oases but the launch uses --schedule default; "
                                          "plan again with --schedule default"):
        _train_validate(plan, 4)
    with pytest.raises(ConfigError, match="was made for --micro-batch-size 4 but the launch uses 8"):
        _train_validate(plan, 4, "--schedule", "oases", "--micro-batch-size", "8", "--global-batch-size", "32")


def test_a_plan_file_without_the_launch_record_loads_with_one_warning(tmp_path, capsys, monkeypatch):
    """Files written before plans recorded their launch run as before, with one warning line on
    rank 0, on stdout (not again when the run validates its config a second time)."""
    plan, data, _ = _plan(tmp_path, capsys, "--nproc-per-node", "4")
    for key in ("world_size", "data_parallel_size", "micro_batch_size", "schedule"):
        del data[key]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    monkeypatch.setenv("RANK", "0")
    cfg = _train_validate(plan, 8)
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: --oases-plan {plan} does not record the launch"), lines
    assert out.err == ""  # stderr stays for the one line of a refusal
    from megatron_oases.train_args import validate_config

    validate_config(cfg, 8, cuda=False)
    monkeypatch.setenv("RANK", "3")
    _train_validate(plan, 8)
    assert capsys.readouterr().out == ""
