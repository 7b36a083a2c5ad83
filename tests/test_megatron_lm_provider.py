"""The Megatron-LM model provider and entry, without a Megatron-LM checkout.

The provider is given Megatron-LM-shaped args and a config factory (Megatron-LM's
``core_transformer_config_from_args`` needs the checkout; tests/test_megatron_lm_checkout.py
uses the real one). Models are built on 2 gloo ranks with TP=2 and run forward and backward.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import pytest

from megatron_oases.megatron_lm.flags import add_flags
from megatron_oases.megatron_lm.hooks import wrap_entry
from megatron_oases.megatron_lm.model_provider import ModelProvider, ensure_validated

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def megatron_args(**over) -> argparse.Namespace:
    """What Megatron-LM's parse_args + validate_args leave, for the fields the provider reads
    (``vocab_size`` None as with a GPT-2 tokenizer: only ``padded_vocab_size`` is set)."""
    ns = argparse.Namespace(
        num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, seq_length=8,
        max_position_embeddings=8, micro_batch_size=2, global_batch_size=2,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
        num_layers_per_virtual_pipeline_stage=None, context_parallel_size=1,
        sequence_parallel=False, recompute_granularity=None, recompute_method=None,
        recompute_num_layers=None, bf16=False, fp16=False, normalization="LayerNorm",
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        untie_embeddings_and_output_weights=False, position_embedding_type="learned_absolute",
        vocab_size=None, make_vocab_size_divisible_by=128, padded_vocab_size=256,
        gradient_accumulation_fusion=False,  # as --no-gradient-accumulation-fusion
        swiglu=False, group_query_attention=False, num_query_groups=1, add_bias_linear=True,
        qk_layernorm=False, rotary_percent=1.0, rotary_base=10000)  # Megatron-LM's defaults
    ours = add_flags(argparse.ArgumentParser()).parse_args([])  # our flags' defaults
    for k, v in {**vars(ours), **over}.items():
        setattr(ns, k, v)
    return ns


def _config_keeping_recompute(args):
    """Like Megatron-LM's config factory: recompute straight from the args, whatever the schedule."""
    import dataclasses

    from megatron_oases.run_config import run_config
    from megatron_oases.specs import transformer_config_from_args

    return transformer_config_from_args(dataclasses.replace(run_config(args), schedule="default"),
                                        cuda=False)


def _build_and_step(over: dict):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_oases.runtime import init_distributed, init_runtime

    runtime = init_runtime("cpu")
    init_distributed(runtime, timeout_s=120)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    args = megatron_args(**over)
    provider = ModelProvider(None, get_args=lambda: args, config_from_args=_config_keeping_recompute)
    chunks = [provider(pre_process=True, post_process=True) for _ in range(2)]
    model = chunks[0]
    tokens = torch.randint(0, 200, (2, args.seq_length), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(args.seq_length).unsqueeze(0).expand(2, -1)
    loss = model(tokens, pos, None, labels=tokens).float().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    layer = model.decoder.layers[0]
    mesh = getattr(layer, "mesh_groups", None)
    return {"layer": type(layer).__name__, "block": type(model.decoder).__name__,
            "loss": float(loss), "all_grads": all(g is not None for g in grads),
            "groups_reused": mesh is None or mesh is chunks[1].decoder.layers[0].mesh_groups,
            "atp_mesh": args.atp_mesh, "vocab": model.embedding.word_embeddings.weight.shape[0],
            "config_recompute": model.config.recompute_granularity}


@pytest.mark.parametrize("over, layer, block", [
    ({}, "TransformerLayer", "TransformerBlock"),
    ({"tp_backend": "atp", "atp_mesh": "1,2", "atp_chunks": 2}, "ATPTransformerLayer", "TransformerBlock"),
    ({"tp_backend": "atp", "atp_mesh": (2, 1)}, "ATPTransformerLayer", "TransformerBlock"),
    ({"schedule": "oases", "recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": 1}, "TransformerLayer", "OasesTransformerBlock"),
])
def test_provider_builds_each_backend_and_schedule(on_ranks, over, layer, block):
    out = on_ranks(_build_and_step, 2, over, timeout_s=240)
    r = out[0]
    assert (r["layer"], r["block"]) == (layer, block), r
    assert math.isfinite(r["loss"]) and r["all_grads"] and r["groups_reused"]
    assert r["vocab"] == 256 // 2  # Megatron-LM's padded vocabulary, split over TP=2
    if over.get("tp_backend") == "atp":
        assert isinstance(r["atp_mesh"], tuple)  # validated on the way in
    if over.get("schedule") == "oases":
        assert r["config_recompute"] is None  # Oases recomputes by itself
    assert out[0]["loss"] == pytest.approx(out[1]["loss"])


def test_stock_runs_use_the_stock_provider():
    calls = []

    def stock(**kwargs):
        calls.append(kwargs)
        return "stock model"

    args = megatron_args()
    provider = ModelProvider(stock, get_args=lambda: args,
                             config_from_args=lambda a: pytest.fail("stock builds its own config"))
    assert provider(pre_process=True, post_process=False, vp_stage=1) == "stock model"
    assert calls == [{"pre_process": True, "post_process": False, "vp_stage": 1, "config": None,
                      "pg_collection": None}]


def test_non_stock_runs_build_through_the_checkouts_model_provider():
    """The checkout's ``model_provider(builder, ...)`` wraps our builder (so its
    ``--record-memory-history`` applies to our models too), in place of ``gpt_builder``."""
    import functools

    calls = []

    def checkout_model_provider(builder, pre_process=True, post_process=True, vp_stage=None,
                                config=None, pg_collection=None):
        calls.append((builder, pre_process, post_process, vp_stage))
        return "wrapped"

    def gpt_builder(*a, **k):
        pytest.fail("a non-stock run must not build Megatron-LM's stock model")

    args = megatron_args(schedule="oases")
    provider = ModelProvider(functools.partial(checkout_model_provider, gpt_builder),
                             get_args=lambda: args)
    assert provider(pre_process=True, post_process=False, vp_stage=0) == "wrapped"
    assert calls == [(provider._builder, True, False, 0)]


def test_wrap_entry_and_unvalidated_args(monkeypatch):
    stock = object()
    model_provider, extra = wrap_entry(stock, None, cpu_layer=False)  # parses only
    assert isinstance(model_provider, ModelProvider) and model_provider.stock is stock
    p = extra(argparse.ArgumentParser(allow_abbrev=False))
    assert any("--tp-backend" in a.option_strings for a in p._actions)
    args = megatron_args(tp_backend="atp", atp_mesh="2,1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(Exception, match="world size 1"):
        ensure_validated(args)  # a parse that skipped our hook is validated here
    bare = argparse.Namespace(num_layers=2)
    with pytest.raises(RuntimeError, match="extra_args_provider"):
        ensure_validated(bare)


def _entry(env_path: str | None, argv=("--help",)):
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_PATH", "RANK")}
    if env_path is not None:
        env["MEGATRON_LM_PATH"] = env_path
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "megatron_oases.pretrain_gpt", *argv],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_entry_without_a_checkout():
    """0.16 (no ``megatron.training`` in the wheel): one line asking for MEGATRON_LM_PATH; from
    0.17 the wheel's ``megatron.training`` runs (``--help`` lists our flags)."""
    from megatron_oases import mcore_compat

    proc = _entry(None)
    if mcore_compat.megatron_training_in_wheel():
        assert proc.returncode == 0 and "--tp-backend {megatron,atp,3d}" in proc.stdout, proc.stderr
        # the usage names the command run, not argparse's default (the script's file name)
        assert proc.stdout.startswith("usage: python -m megatron_oases.pretrain_gpt "), proc.stdout
        return
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("python -m megatron_oases.pretrain_gpt: error: set MEGATRON_LM_PATH "
                               "to a Megatron-LM checkout of the installed release (core_v0.16.1)")


@pytest.mark.parametrize("argv, needle", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # Megatron-LM asserts on these (or fails without a GPU); our builds shard nothing
    (["--use-torch-fsdp2"], "does not support --use-torch-fsdp2"),
    (["--use-megatron-fsdp"], "does not support --use-megatron-fsdp"),
])
def test_entry_errors_name_the_command_run(argv, needle):
    """Without a checkout (megatron-core 0.17+): parse errors are one line prefixed with the
    command the user ran, and FSDP stops at parse time, not at Megatron-LM's asserts."""
    from megatron_oases import mcore_compat
    from tests.test_megatron_lm_wheel import CPU_TRAIN

    if not mcore_compat.megatron_training_in_wheel():
        pytest.skip("the no-checkout entry needs megatron-core >= 0.17")
    proc = _entry(None, [*CPU_TRAIN, *argv])
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]  # not import-time warnings
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("python -m megatron_oases.pretrain_gpt: error: ") and \
        needle in lines[0], lines[0]


def test_entry_with_a_bad_checkout_is_one_line():
    proc = _entry("/")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("python -m megatron_oases.pretrain_gpt: error: ")
    assert "MEGATRON_LM_PATH=/ is not a Megatron-LM checkout: pretrain_gpt.py is missing" \
        in lines[0], proc.stderr


def test_checkout_version_check(tmp_path):
    from megatron_oases.megatron_lm.checkout import check_versions, checkout_path, checkout_version
    from megatron_oases.errors import ConfigError

    (tmp_path / "megatron/training").mkdir(parents=True)
    (tmp_path / "megatron/training/__init__.py").write_text("")
    (tmp_path / "pretrain_gpt.py").write_text("")
    info = tmp_path / "megatron/core/package_info.py"
    info.parent.mkdir(parents=True)
    from megatron_oases.mcore_compat import mcore_version

    major, minor, _ = mcore_version()
    info.write_text("MAJOR = 0\nMINOR = 15\nPATCH = 3\n")
    assert checkout_path(tmp_path) == tmp_path.resolve()
    assert checkout_version(tmp_path) == "0.15.3"
    with pytest.raises(ConfigError, match="checkout is Megatron-Core 0.15.3; supported: "
                                          "core_v0.16.1, core_v0.17.x"):
        check_versions(tmp_path)
    info.write_text("MAJOR = 0\nMINOR = 16\nPATCH = 0\n")  # before the oldest supported
    with pytest.raises(ConfigError, match="0.16.0; supported"):
        check_versions(tmp_path)
    other = 17 if minor != 17 else 18  # supported, but not the installed release
    info.write_text(f"MAJOR = 0\nMINOR = {other}\nPATCH = 1\n")
    with pytest.raises(ConfigError, match=f"checkout is Megatron-Core 0.{other}.1 but megatron-core "
                                          f"{major}.{minor}"):
        check_versions(tmp_path)
    info.write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = 9\n")
    check_versions(tmp_path)


@pytest.mark.parametrize("installed, tag", [("0.19.2", "core_v0.19.0"), ("0.18.1", "core_v0.18.2"),
                                            ("0.17.0", "core_v0.17.1"), ("0.16.1", "core_v0.16.1")])
def test_version_hints_name_tags_that_exist(tmp_path, monkeypatch, installed, tag):
    """megatron-core's wheel versions are not Megatron-LM's tags: the hints name the tag each
    release is tested at (``checkout.TAGS``; core_v0.19.2 does not exist)."""
    import megatron.core.package_info as package_info

    from megatron_oases.errors import ConfigError
    from megatron_oases.megatron_lm.checkout import ENV, check_versions, checkout_path

    monkeypatch.setattr(package_info, "__version__", installed)
    info = tmp_path / "megatron/core/package_info.py"
    info.parent.mkdir(parents=True)
    other = 17 if not installed.startswith("0.17") else 18
    info.write_text(f"MAJOR = 0\nMINOR = {other}\nPATCH = 1\n")
    with pytest.raises(ConfigError, match=f"is installed; check out tag {tag}$"):
        check_versions(tmp_path)
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ConfigError, match=f"git clone -b {tag} "):
        checkout_path()


def test_replica_sync_broadcasts_on_the_runtime_device(monkeypatch):
    """``--oases-plan`` on Megatron-LM's GPU init: the provider syncs the replicas before
    Megatron's ``get_model`` moves the model to the GPU, and the torch norms are still on the
    host then. NCCL broadcasts device tensors only, so every tensor broadcast must be on the
    runtime's device (``meta`` stands in for a CUDA device here; the broadcast is recorded)."""
    import torch

    # 0.16's wheel has no megatron.training (the entry then needs a checkout)
    training = pytest.importorskip("megatron.training.training")
    import torch.distributed as dist

    from megatron_oases.megatron_lm import model_provider
    from megatron_oases.runtime import device as runtime_device

    from megatron_oases.layers import planned_layer

    model = torch.nn.Module()
    model.norm = torch.nn.LayerNorm(4)  # as Megatron's WrappedTorchNorm builds it: on the host
    # (a move to ``meta`` replaces the Parameter objects, a move to CUDA keeps them and their
    # ``oases_replica_group``: the replica groups are read from the model as it is at the sync)
    monkeypatch.setattr(planned_layer, "replica_grad_groups",
                        lambda chunks: [(object(), list(chunks[0].parameters()))])
    seen = []
    monkeypatch.setattr(runtime_device, "_RUNTIME",
                        runtime_device.Runtime(device=torch.device("meta"), backend="nccl"))
    monkeypatch.setattr(dist, "get_global_rank", lambda g, r: 0)
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group: seen.append(t.device))
    monkeypatch.setattr(training, "finalize_model_grads", training.finalize_model_grads)
    model_provider._prepare_replicas(model, argparse.Namespace(use_cpu_initialization=False))
    assert seen == [torch.device("meta")] * 2, seen
