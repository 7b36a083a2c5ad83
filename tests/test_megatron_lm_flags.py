"""Our flags on a Megatron-LM-style parser and their validation, without a Megatron-LM checkout.

``megatron_like_parser`` has the Megatron-LM flags our validation reads, with Megatron-LM's
names, dests and defaults; tests/test_megatron_lm_checkout.py repeats the key cases on the real
``megatron.training.arguments.parse_args``.
"""
from __future__ import annotations

import argparse
import re

import pytest

from megatron_oases.megatron_lm import flags
from megatron_oases.megatron_lm.flags import (extra_args_provider, make_extra_args_provider,
                                              trainer_view, validate_megatron_args)
from megatron_oases.errors import ConfigError
from megatron_oases.run_config import run_config


def megatron_like_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    for name in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--seq-length", "--max-position-embeddings", "--global-batch-size",
                 "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                 "--num-experts", "--recompute-num-layers", "--decoder-first-pipeline-num-layers",
                 "--save-interval", "--ckpt-step"):
        p.add_argument(name, type=int, default=None)
    for name, default in (("--micro-batch-size", None), ("--tensor-model-parallel-size", 1),
                          ("--pipeline-model-parallel-size", 1), ("--context-parallel-size", 1)):
        p.add_argument(name, type=int, default=default)
    for name in ("--sequence-parallel", "--bf16", "--fp16", "--swiglu", "--tp-comm-overlap",
                 "--overlap-param-gather", "--group-query-attention", "--qk-layernorm",
                 "--use-legacy-models", "--untie-embeddings-and-output-weights",
                 "--recompute-activations"):
        p.add_argument(name, action="store_true")
    p.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    p.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    p.add_argument("--position-embedding-type", default="learned_absolute")
    p.add_argument("--num-query-groups", type=int, default=1)  # Megatron-LM's default
    p.add_argument("--transformer-impl", default="transformer_engine")  # Megatron-LM's default
    p.add_argument("--normalization", default="LayerNorm")
    p.add_argument("--fp8-format", dest="fp8", default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    return p


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--transformer-impl", "local"]


def parse(argv, world=4, monkeypatch=None, provider=extra_args_provider):
    if monkeypatch is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    return provider(megatron_like_parser()).parse_args(BASE + argv)


def plain_parse(parser, argv):
    """argparse's own parse, without the validation hook our provider installs."""
    ns, extras = argparse.ArgumentParser.parse_known_args(parser, argv)
    assert not extras
    return ns


def test_flags_reuse_the_trainers_definitions():
    from megatron_oases.train_args import build_parser

    p = extra_args_provider(megatron_like_parser())
    ours = {o: a for a in p._actions for o in a.option_strings}
    trainer = {o: a for a in build_parser()._actions for o in a.option_strings}
    for opt in ("--schedule", "--atp-chunks", "--oases-cross-pass", "--no-oases-cross-pass",
                "--oases-fine-grained-recompute", "--no-oases-fine-grained-recompute"):
        assert ours[opt].help == trainer[opt].help and ours[opt].default == trainer[opt].default
    assert {"megatron", "atp", "3d"} <= set(ours["--tp-backend"].choices)
    assert ours["--oases-plan"].default is None and ours["--topology"].metavar == "FILE"
    ns = p.parse_args(BASE)
    assert (ns.tp_backend, ns.schedule, ns.atp_mesh, ns.atp_chunks) == ("megatron", "default", None, 1)
    assert ns.oases_cross_pass and ns.oases_fine_grained_recompute


def test_oases_accepts_sequence_parallel(monkeypatch):
    ns = parse(["--tensor-model-parallel-size", "2", "--schedule", "oases", "--sequence-parallel"],
               monkeypatch=monkeypatch)
    assert ns.schedule == "oases" and ns.sequence_parallel


def test_atp_mesh_is_validated_into_a_tuple(monkeypatch):
    ns = parse(["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "2,2",
                "--atp-chunks", "2"], monkeypatch=monkeypatch)
    assert ns.atp_mesh == (2, 2) and ns.atp_chunks == 2


def test_oases_flags_parse(monkeypatch):
    ns = parse(["--tensor-model-parallel-size", "2", "--schedule", "oases",
                "--no-oases-cross-pass", "--recompute-granularity", "full",
                "--recompute-method", "uniform", "--recompute-num-layers", "1"], monkeypatch=monkeypatch)
    assert ns.schedule == "oases" and not ns.oases_cross_pass and ns.oases_fine_grained_recompute


@pytest.mark.parametrize("argv, needle", [
    (["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "2,3"],
     "--atp-mesh 2,3: d1 x d2 = 6 must equal --tensor-model-parallel-size 4"),
    (["--tensor-model-parallel-size", "4", "--tp-backend", "atp"], "--tp-backend atp needs --atp-mesh"),
    (["--tensor-model-parallel-size", "4", "--atp-mesh", "2,2"], "--atp-mesh needs --tp-backend atp"),
    (["--tensor-model-parallel-size", "4", "--atp-chunks", "2"], "--atp-chunks 2 splits ATP's layers and has no effect"),
    (["--tensor-model-parallel-size", "2", "--no-oases-cross-pass"], "--no-oases-cross-pass switches part of the Oases executor"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--no-oases-fine-grained-recompute"],
     "has no effect without --recompute-granularity full"),
    (["--schedule", "oases", "--no-oases-cross-pass"],
     "--no-oases-cross-pass has no effect at --tensor-model-parallel-size 1"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--recompute-granularity", "full",
      "--recompute-method", "uniform"], "--recompute-granularity full needs --recompute-num-layers"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     "--recompute-num-layers 2 has no effect with --schedule oases"),
    (["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "auto"],
     "--atp-mesh auto needs --topology"),
    (["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "4,1",
      "--sequence-parallel"], "--tp-backend atp does not support --sequence-parallel"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--micro-batch-size", "1"],
     "needs --micro-batch-size >= 2"),
    # checkpoint paths, for stock runs too (Megatron-LM would assert, fail late or start over)
    (["--save", "/proc/ckpt", "--save-interval", "2"], "--save /proc/ckpt: /proc is not a writable directory"),
    (["--save", "/tmp/oases-never-written"], "--save needs --save-interval N >= 1"),
    (["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt: no such directory"),
    (["--load", "/tmp", "--ckpt-step", "3"], "--ckpt-step 3: /tmp/iter_0000003 is missing"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--recompute-granularity",
      "selective"], "--recompute-granularity selective cannot be combined with --schedule oases"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--recompute-activations"],
     "--recompute-activations cannot be combined with --schedule oases"),
    (["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "2,2",
      "--recompute-activations"], "--recompute-activations has no effect with --tp-backend atp"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--recompute-granularity", "full",
      "--recompute-method", "block"], "use --recompute-method uniform"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--tp-comm-overlap"],
     "drop --tp-comm-overlap"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--transformer-impl",
      "transformer_engine"], "pass --transformer-impl local"),
    (["--tensor-model-parallel-size", "4", "--schedule", "oases", "--tp-backend", "atp",
      "--atp-mesh", "2,2", "--overlap-param-gather"], "drop --overlap-param-gather"),
    (["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "2,2",
      "--num-experts", "8"], "--num-experts builds Megatron-Core's MoE layers, which --tp-backend atp does not"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--position-embedding-type",
      "mrope"], "drop --position-embedding-type mrope"),
    (["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "2,2",
      "--group-query-attention", "--num-query-groups", "2"],
     "--num-query-groups 2 must be divisible by --tensor-model-parallel-size 4"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--context-parallel-size", "2"],
     "--context-parallel-size > 1"),
    (["--tensor-model-parallel-size", "3", "--schedule", "oases", "--num-attention-heads", "3",
      "--hidden-size", "63"], "world size 4 is not divisible by --tensor-model-parallel-size 3"),
    (["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "2,2",
      "--hidden-size", "66", "--num-attention-heads", "4"], "--hidden-size 66 is not divisible"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--global-batch-size", "6"],
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2"),
    (["--oases-plan", "plan.json"], "--oases-plan plan.json: cannot be read"),
    (["--topology", "/nonexistent/cluster.yaml"], "--topology"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        parse(argv, monkeypatch=monkeypatch)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("pretrain_gpt.py: error: ") and needle in err, err


def test_only_rank_0_prints(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as exc:
        parse(["--oases-plan", "plan.json"], monkeypatch=monkeypatch)
    assert exc.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize("rank", ["0", "3"])
def test_argparse_errors_are_one_line_on_rank_0(monkeypatch, capsys, rank):
    """An unknown flag (argparse's own error) is one line on rank 0 and nothing elsewhere, as our
    refusals are: it printed the usage block and the error once per rank."""
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exc:
        parse(["--no-such-flag"], monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err == ("pretrain_gpt.py: error: unrecognized arguments: --no-such-flag\n" if rank == "0" else "")


def test_stock_runs_are_left_to_megatron(monkeypatch):
    # World 3 with TP 2 is Megatron-LM's to refuse (its own message); we add nothing to stock.
    ns = parse(["--tensor-model-parallel-size", "2"], world=3, monkeypatch=monkeypatch)
    assert ns.tp_backend == "megatron"


def test_atp_mesh_auto_uses_the_mesh_search(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    ns = parse(["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "auto",
                "--topology", "pcie-3090x4"], monkeypatch=monkeypatch)
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.plan.atp_mesh import search_mesh

    pick = search_mesh("pcie-3090x4", 4, GPTShape(hidden_size=64, num_layers=4, num_attention_heads=4,
                                                  micro_batch_size=2, seq_length=32, dtype="fp32")).pick
    assert ns.atp_mesh == (pick.d1, pick.d2)
    assert f"--atp-mesh auto picked {pick.d1},{pick.d2}" in capsys.readouterr().out


def test_other_providers_are_chained_and_validation_installed_once(monkeypatch):
    def modelopt_like(parser):
        parser.add_argument("--other-flag", type=int, default=7)
        return parser

    provider = make_extra_args_provider(None, modelopt_like)
    p = provider(megatron_like_parser())
    again = flags.validating(p)
    assert again is p and type(p).__mro__[1] is argparse.ArgumentParser
    monkeypatch.setenv("WORLD_SIZE", "4")
    ns = p.parse_args(BASE + ["--other-flag", "3", "--schedule", "oases",
                              "--tensor-model-parallel-size", "2"])
    assert ns.other_flag == 3 and ns.schedule == "oases"


def test_trainer_view_maps_megatron_names():
    p = extra_args_provider(megatron_like_parser())
    argv = BASE + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                   "1", "--swiglu", "--hidden-size", "96", "--num-attention-heads", "4",
                   "--global-batch-size", "4", "--micro-batch-size", "1"]
    ns = plain_parse(p, argv)
    view, dims = trainer_view(run_config(ns), world_size=8)
    assert (dims.tp, dims.pp, dims.vp, dims.dp) == (1, 2, 2, 4)
    assert view.ffn_hidden_size == int(4 * 96 * 2 / 3 / 64) * 64 and ns.ffn_hidden_size is None


def test_validate_can_be_called_directly():
    ns = plain_parse(extra_args_provider(megatron_like_parser()),
                     BASE + ["--tensor-model-parallel-size", "2", "--tp-backend", "atp",
                             "--atp-mesh", "1,2"])
    assert validate_megatron_args(ns, world_size=2).atp_mesh == (1, 2)
    assert ns.atp_mesh == "1,2"  # read, not edited: the parse hook writes it back (keep_on_megatron_args)
    with pytest.raises(ConfigError, match="world size 3"):
        validate_megatron_args(ns, world_size=3)


def test_stock_runs_still_refuse_stray_flags_of_ours(monkeypatch, capsys):
    options = {o for a in extra_args_provider(megatron_like_parser())._actions for o in a.option_strings}
    if "--oases-skip-tp-collectives" not in options:
        pytest.skip("no --oases-skip-tp-collectives in this version of the oases group")
    with pytest.raises(SystemExit):
        parse(["--oases-skip-tp-collectives", "--tensor-model-parallel-size", "2", "--tp-backend",
               "atp", "--atp-mesh", "1,2"], world=2, monkeypatch=monkeypatch)
    assert "--oases-skip-tp-collectives with the default schedule needs --tp-backend megatron" \
        in capsys.readouterr().err


def test_missing_model_sizes(monkeypatch, capsys):
    p = extra_args_provider(megatron_like_parser())
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert p.parse_args([]).tp_backend == "megatron"  # stock: Megatron-LM asks for them itself
    with pytest.raises(SystemExit):
        p.parse_args(["--schedule", "oases", "--transformer-impl", "local"])
    assert "--num-layers is required" in capsys.readouterr().err


def test_object_store_checkpoints_are_left_to_megatron(monkeypatch):
    parse(["--save", "msc://bucket/ckpt", "--save-interval", "2", "--load", "msc://bucket/other",
           "--ckpt-step", "3"], monkeypatch=monkeypatch)


def test_a_load_naming_the_save_directory_may_not_exist_yet(monkeypatch, tmp_path):
    """Megatron-LM's resume-when-present: ``--save D --load D`` with nothing in D yet trains."""
    ckpt = str(tmp_path / "ckpt")
    parse(["--save", ckpt, "--save-interval", "2", "--load", ckpt], monkeypatch=monkeypatch)
    assert not (tmp_path / "ckpt").exists()


def _dist_checkpoint(root, keys, tracker="2", iteration=2) -> str:
    """A torch_dist checkpoint under ``root`` (Megatron-LM's layout: tracker file, ``iter_N``)
    holding a tensor per key; written in this process, no process group."""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter, save

    folder = root / ("release" if tracker == "release" else f"iter_{iteration:07d}")
    save({k: torch.zeros(2) for k in keys}, storage_writer=FileSystemWriter(str(folder)), no_dist=True)
    (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    return str(root)


STACKED_KEYS = ["embedding.word_embeddings.weight", "decoder.layers.mlp.linear_fc1.weight",
                "decoder.final_layernorm.weight"]
PER_LAYER_KEYS = ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                  "decoder.layers.1.mlp.linear_fc1.weight", "decoder.final_layernorm.weight"]


@pytest.mark.parametrize("tracker", ["2", "release"])
@pytest.mark.parametrize("keys,plan_run,needle", [
    (STACKED_KEYS, False, None),
    (PER_LAYER_KEYS, True, None),
    (STACKED_KEYS, True, "stacks the decoder layers on one key per parameter (a run without --oases-plan"),
    (PER_LAYER_KEYS, False, "keys the decoder layers per layer (an --oases-plan run saved it)"),
])
def test_checkpoint_layer_keys_must_match_the_run(tmp_path, keys, plan_run, needle, tracker):
    """A plan run keys its layers per layer (Megatron's hetereogenous_dist_checkpoint), any other
    run stacks them; Megatron-LM cannot load one into the other (a traceback per rank inside
    dist_checkpointing.load, after start-up)."""
    from megatron_oases.megatron_lm.ckpt_layout import check_layer_keys

    load = _dist_checkpoint(tmp_path, keys, tracker)
    if needle is None:
        check_layer_keys(load, None, plan_run)
    else:
        with pytest.raises(ConfigError, match=r"--load .* " + re.escape(needle)):
            check_layer_keys(load, None, plan_run)


def test_checkpoint_layer_keys_of_the_step_loaded_and_other_formats(tmp_path):
    """``--ckpt-step`` picks the iteration read; a checkpoint without torch_dist's ``.metadata``
    (the legacy torch format) or with nothing saved yet is left to Megatron."""
    from megatron_oases.megatron_lm.ckpt_layout import check_layer_keys, layer_keys

    load = _dist_checkpoint(tmp_path, PER_LAYER_KEYS, tracker="4", iteration=4)
    _dist_checkpoint(tmp_path, STACKED_KEYS, tracker="4", iteration=2)
    check_layer_keys(load, 4, per_layer_run=True)
    with pytest.raises(ConfigError, match="iter_0000002 stacks"):
        check_layer_keys(load, 2, per_layer_run=True)
    (tmp_path / "iter_0000006" / "mp_rank_00").mkdir(parents=True)  # the torch format
    assert layer_keys(str(tmp_path / "iter_0000006")) is None
    check_layer_keys(load, 6, per_layer_run=False)
    check_layer_keys(str(tmp_path / "empty"), None, per_layer_run=True)


def test_stock_run_refuses_a_plan_runs_checkpoint_at_parse_time(monkeypatch, capsys, tmp_path):
    load = _dist_checkpoint(tmp_path, PER_LAYER_KEYS)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        parse(["--load", load], monkeypatch=monkeypatch)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert "a run without --oases-plan loads stacked layers only" in err, err
