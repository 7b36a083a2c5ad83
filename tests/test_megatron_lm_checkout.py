"""Against a real Megatron-LM checkout (MEGATRON_LM_PATH, a supported tag of the installed
megatron-core's release); skipped without one.

* the upstream signatures our entry and patch rely on are unchanged;
* Megatron-LM's own ``parse_args`` with our ``extra_args_provider`` takes and validates our flags;
* our model provider builds a GPTModel for every backend / schedule from those args on CPU
  (2 gloo ranks; process groups set up here: ``initialize_megatron`` asserts CUDA);
* ``python -m megatron_oases.pretrain_gpt`` answers --help and bad flags before needing CUDA;
* without CUDA, a Llama-style model trains through Megatron-LM's own ``pretrain`` on gloo ranks
  with the stock losses (the other training runs, which also run without a checkout from 0.17,
  are in ``tests/test_megatron_lm_wheel.py``); the upstream functions
  ``runtime.cpu_training_compat`` wraps are pinned;
* ``scripts/apply_patches.sh`` applies each tag's patch set to that tag's ``pretrain_gpt.py``
  (core_v0.16.1, 0.17.1, 0.18.2, 0.19.0, read from the checkout's git history) idempotently,
  refuses other files / releases / commits, and the patched ``pretrain_gpt.py`` of the checkout
  hands our providers to ``pretrain``.

Megatron-LM's ``validate_args`` reads the GPU architecture when TP > 1; the CPU runs replace
that one function (``get_device_arch_version``) and set CUDA_DEVICE_MAX_CONNECTIONS=1.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import math
import os
import shutil
import subprocess
import sys

import pytest

CHECKOUT = os.environ.get("MEGATRON_LM_PATH", "")
pytestmark = pytest.mark.skipif(
    not CHECKOUT or not os.path.isfile(os.path.join(CHECKOUT, "pretrain_gpt.py")),
    reason="needs a Megatron-LM checkout: set MEGATRON_LM_PATH (the installed release's tag)")

from tests.test_megatron_lm_wheel import PLAN, ROOT, TINY, losses_of, needs_cpu, train  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _checkout_off_sys_path_afterwards():
    """The checkout goes first on sys.path, and it has a ``tests`` package of its own: ranks
    spawned by later test modules would import it instead of ours. Restore sys.path after."""
    saved = list(sys.path)
    yield
    sys.path[:] = saved


@pytest.fixture(scope="module")
def stock():
    from megatron_oases.megatron_lm.checkout import import_stock_pretrain_gpt

    return import_stock_pretrain_gpt(CHECKOUT)


def parse_megatron(argv, *, world, validate_megatron=False):
    """Megatron-LM's parse_args (+ validate_args) with our extra_args_provider, on CPU."""
    from megatron_oases.megatron_lm.pretrain_gpt import entry_objects

    provider, extra = entry_objects(import_stock_pretrain_gpt_cached())  # checkout on sys.path
    import megatron.training.arguments as margs

    saved_env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "CUDA_DEVICE_MAX_CONNECTIONS")}
    saved_argv, saved_arch = sys.argv, margs.get_device_arch_version
    sys.argv, os.environ["WORLD_SIZE"] = ["pretrain_gpt.py", *argv], str(world)
    try:
        args = margs.parse_args(extra)
        if validate_megatron:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
            margs.get_device_arch_version = lambda: 9  # the one CUDA query of validate_args
            with contextlib.redirect_stdout(io.StringIO()):
                margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    finally:
        sys.argv, margs.get_device_arch_version = saved_argv, saved_arch
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return args, provider


def import_stock_pretrain_gpt_cached():
    from megatron_oases.megatron_lm.checkout import import_stock_pretrain_gpt

    return import_stock_pretrain_gpt(CHECKOUT)


# ---- upstream surface ----------------------------------------------------------------------
def test_upstream_signatures_we_rely_on(stock):
    from megatron.training import pretrain
    from megatron.training.arguments import parse_args
    from megatron.training.training import get_model

    params = inspect.signature(pretrain).parameters
    # mcore_compat.run_pretrain's two calls: the args parsed by pretrain (0.16-0.17), or by
    # parse_and_validate_args and handed over in a config container (0.18+)
    parsed_inside = ("extra_args_provider", "args_defaults")
    if "cfg_container" in params:
        assert list(params)[0] == "cfg_container" and not set(parsed_inside) & set(params)
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        assert {"extra_args_provider", "args_defaults"} <= set(
            inspect.signature(parse_and_validate_args).parameters)
        assert list(inspect.signature(pretrain_cfg_container_from_args).parameters)[:2] == [
            "args", "model_cfg"]
    else:
        assert set(parsed_inside) <= set(params)
    for name in ("train_valid_test_dataset_provider", "model_provider", "model_type",
                 "forward_step_func", "get_embedding_ranks", "store"):
        assert name in params, name
    assert list(inspect.signature(parse_args).parameters) == ["extra_args_provider",
                                                              "ignore_unknown_args"]
    src = inspect.getsource(parse_args)
    assert "parser = extra_args_provider(parser)" in src and "parser.parse_args()" in src
    call = inspect.getsource(get_model)
    for kw in ("pre_process=pre_process", "post_process=post_process", "vp_stage=i",
               "config=config", "pg_collection=pg_collection"):
        assert kw in call, kw
    assert list(inspect.signature(stock.model_provider).parameters) == [
        "model_builder", "pre_process", "post_process", "vp_stage", "config", "pg_collection"]
    for name in ("train_valid_test_datasets_provider", "forward_step", "get_embedding_ranks",
                 "gpt_builder", "has_nvidia_modelopt"):
        assert hasattr(stock, name), name


def test_our_flags_do_not_redefine_megatrons(stock):  # the checkout on sys.path
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_oases.megatron_lm.flags import add_flags

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    before = {o for a in parser._actions for o in a.option_strings}
    add_flags(parser)  # argparse raises on a conflicting option string
    ours = {o for a in parser._actions for o in a.option_strings} - before
    assert {"--tp-backend", "--atp-mesh", "--atp-chunks", "--topology", "--schedule",
            "--oases-plan", "--oases-cross-pass", "--no-oases-fine-grained-recompute"} <= ours


# ---- parse and validate ----------------------------------------------------------------------
def test_megatron_parse_args_takes_our_flags():
    args, _ = parse_megatron(TINY + ["--tensor-model-parallel-size", "4", "--tp-backend", "atp",
                                     "--atp-mesh", "2,2", "--atp-chunks", "2"], world=4,
                             validate_megatron=True)
    assert (args.tp_backend, args.atp_mesh, args.atp_chunks) == ("atp", (2, 2), 2)
    args, _ = parse_megatron(TINY + ["--tensor-model-parallel-size", "2", "--schedule", "oases",
                                     "--no-oases-cross-pass", "--recompute-granularity", "full",
                                     "--recompute-method", "uniform", "--recompute-num-layers", "1"], world=2,
                             validate_megatron=True)
    assert args.schedule == "oases" and not args.oases_cross_pass


@pytest.mark.parametrize("extra, needle", [
    (["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "4,2"],
     "--atp-mesh 4,2: d1 x d2 = 8 must equal --tensor-model-parallel-size 4"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--tp-backend", "atp",
      "--atp-mesh", "1,2", "--sequence-parallel"], "does not support --sequence-parallel"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--recompute-granularity",
      "selective"], "--recompute-granularity selective cannot be combined with --schedule oases"),
    (["--tensor-model-parallel-size", "2", "--schedule", "oases", "--recompute-activations"],
     "--recompute-activations cannot be combined with --schedule oases"),
    (["--tensor-model-parallel-size", "2", "--tp-backend", "atp", "--atp-mesh", "1,2",
      "--recompute-activations"], "--recompute-activations has no effect with --tp-backend atp"),
    (["--oases-plan", "plan.json"], "--oases-plan plan.json: cannot be read"),
])
def test_megatron_parse_args_refuses_bad_combinations(extra, needle, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        parse_megatron(TINY + extra + ["--global-batch-size", "8"], world=4)
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(err) == 1 and needle in err[0], err


# ---- every option of Megatron-LM's GPT builder is honoured or refused --------------------------
def _read(path: str) -> str:
    """The checkout's ``path`` ("" where it has none)."""
    full = os.path.join(CHECKOUT, path)
    return open(full).read() if os.path.isfile(full) else ""


def _builder_reads() -> set[str]:
    """``args.X`` (and ``getattr/hasattr(args, "X")``) in the checkout's three GPT builders."""
    import ast

    config_from_args = next(  # moved to argument_utils.py at core_v0.19
        p for p in ("megatron/training/argument_utils.py", "megatron/training/arguments.py")
        if "def core_transformer_config_from_args(" in _read(p))
    where = {"gpt_builders.py": {"gpt_builder", "_get_transformer_layer_spec"},
             config_from_args: {"core_transformer_config_from_args"},
             "model_provider.py": {"model_provider"}}
    out = set()
    for path, funcs in where.items():
        tree = ast.parse(open(os.path.join(CHECKOUT, path)).read())
        bodies = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in funcs]
        assert len(bodies) == len(funcs), (path, funcs)  # upstream renamed one: look again
        for n in (m for body in bodies for m in ast.walk(body)):
            if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "args":
                out.add(n.attr)
            elif (isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("getattr", "hasattr")
                  and getattr(n.args[0], "id", None) == "args"
                  and isinstance(n.args[1], ast.Constant)):
                out.add(n.args[1].value)
    return out


def _megatron_parser():
    import argparse

    import_stock_pretrain_gpt_cached()  # the checkout on sys.path
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def test_every_gpt_builder_option_is_classified():
    """The options Megatron-LM's GPT build reads: config fields with a flag, and the builders'
    own ``args.X`` reads. A new one fails here until megatron_lm/options.py classifies it."""
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    from megatron_oases.megatron_lm import options

    dests = {a.dest for a in _megatron_parser()._actions}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    read = (fields & dests) | _builder_reads()
    derived = {"params_dtype", "padded_vocab_size"}  # set by validate_args from walked flags
    classes = options.classes()
    unclassified = sorted(n for n in read if n not in classes)
    assert not unclassified, f"classify in megatron_lm/options.py: {unclassified}"
    assert not sorted(n for n in read - derived if classes[n] == "not-a-flag")
    assert not options.NOT_FLAGS & dests  # a flag now: classify what our builds do with it


def _flip(action) -> list[str]:
    """argv that sets ``action`` to a value other than its default."""
    opt = action.option_strings[0]
    if action.nargs == 0:
        return [opt]
    if action.choices:
        return [opt, next(str(c) for c in action.choices if c != action.default)]
    special = {"window_size": "64,0", "no_rope_freq": "4", "recompute_modules": "core_attn",
               "glu_linear_offset": "0.5", "activation_func_clamp_value": "7.0"}
    if action.dest in special:
        return [opt, special[action.dest]]
    return [opt, "3" if action.type in (int, float) else "x"]


_RUN = {"oases": (2, ["--tensor-model-parallel-size", "2", "--schedule", "oases"]),
        "plan": None,
        "atp": (2, ["--tensor-model-parallel-size", "2", "--tp-backend", "atp",
                    "--atp-mesh", "1,2"]),
        "3d": (8, ["--tensor-model-parallel-size", "8", "--tp-backend", "3d"])}


def test_every_refused_option_stops_parse_args(capsys, monkeypatch):
    """Flip each refused option for a build that refuses it: Megatron-LM's parse_args exits 2
    with one line naming the flag, before anything starts; the same flags pass a stock run."""
    from megatron_oases.megatron_lm import options

    monkeypatch.setenv("RANK", "0")
    actions = {a.dest: a for a in _megatron_parser()._actions}
    flipped = 0
    for name, (flag, builds) in options.REFUSED.items():
        if name not in actions:  # ModelOpt / Kitchen flags exist only with those packages
            continue
        assert flag in actions[name].option_strings, (name, flag)
        build = next(b for b in ("oases", "atp", "3d") if b in builds)
        world, run = _RUN[build]
        with pytest.raises(SystemExit) as exc:
            parse_megatron(TINY + run + _flip(actions[name]), world=world)
        err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
        assert exc.value.code == 2 and len(err) == 1 and f"support {flag};" in err[0], (name, err)
        flipped += 1
    assert flipped >= 40


# ---- model provider on CPU -------------------------------------------------------------------
def _provider_rank(argv, world):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_oases.runtime import init_distributed, init_runtime

    args, provider = parse_megatron(argv, world=world, validate_megatron=True)
    from megatron.training.global_vars import set_global_variables
    with contextlib.redirect_stdout(io.StringIO()):
        set_global_variables(args)  # get_args() for the providers; builds the NullTokenizer
    runtime = init_runtime("cpu")
    init_distributed(runtime, timeout_s=120)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    with contextlib.redirect_stdout(io.StringIO()):
        model = provider(pre_process=True, post_process=True)
    b = args.micro_batch_size
    tokens = torch.randint(0, 1000, (b, args.seq_length), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(args.seq_length).unsqueeze(0).expand(b, -1)
    model.train()
    loss = model(tokens, pos, None, labels=tokens).float().mean()
    loss.backward()
    layer = model.decoder.layers[0]
    return {"model": type(model).__name__, "layer": type(layer).__name__,
            "block": type(model.decoder).__name__, "loss": float(loss),
            "grads": all(p.grad is not None for p in model.parameters() if p.requires_grad)}


@pytest.mark.parametrize("extra, layer, block", [
    ([], "TransformerLayer", "TransformerBlock"),  # stock: Megatron-LM's own gpt_builder
    (["--oases-plan", PLAN], "PlannedTransformerLayer", "TransformerBlock"),
    (["--tp-backend", "atp", "--atp-mesh", "1,2", "--schedule", "oases"], "ATPTransformerLayer",
     "OasesTransformerBlock"),
    (["--tp-backend", "atp", "--atp-mesh", "1,2", "--atp-chunks", "2"], "ATPTransformerLayer",
     "TransformerBlock"),
    (["--tp-backend", "atp", "--atp-mesh", "2,1"], "ATPTransformerLayer", "TransformerBlock"),
    (["--schedule", "oases", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "TransformerLayer", "OasesTransformerBlock"),
    (["--schedule", "oases", "--no-oases-cross-pass", "--no-oases-fine-grained-recompute"],
     "TransformerLayer", "OasesTransformerBlock"),
])
def test_model_provider_builds_from_megatron_args(on_ranks, extra, layer, block):
    argv = TINY + ["--tensor-model-parallel-size", "2"] + extra
    out = on_ranks(_provider_rank, 2, argv, 2, timeout_s=300)
    r = out[0]
    assert (r["model"], r["layer"], r["block"]) == ("GPTModel", layer, block), r
    assert math.isfinite(r["loss"]) and r["grads"]
    assert out[1]["loss"] == pytest.approx(r["loss"])


# ---- entry -----------------------------------------------------------------------------------
def _entry(argv):
    env = {**os.environ, "MEGATRON_LM_PATH": CHECKOUT, "WORLD_SIZE": "2",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "megatron_oases.pretrain_gpt", *argv],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_entry_help_bad_flags_and_cpu():
    proc = _entry(["--help"])
    assert proc.returncode == 0 and "--tp-backend {megatron,atp,3d}" in proc.stdout
    assert "--oases-fine-grained-recompute" in proc.stdout
    proc = _entry(TINY + ["--tensor-model-parallel-size", "2", "--tp-backend", "atp",
                          "--atp-mesh", "2,2"])
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert proc.returncode == 2 and len(errors) == 1 and "--atp-mesh 2,2" in errors[0], proc.stderr
    if not __import__("torch").cuda.is_available():  # CUDA-only flags: one line, before any rank work
        proc = _entry(TINY + ["--distributed-backend", "gloo", "--record-memory-history"])
        errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        assert "--record-memory-history" in errors[0] and "needs CUDA" in errors[0]
        proc = _entry(TINY)  # Megatron-LM's default backend is nccl
        errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        assert "--distributed-backend gloo" in errors[0]


# ---- patch set -------------------------------------------------------------------------------
def _copy_checkout(dst):
    os.makedirs(os.path.join(dst, "megatron/core"))
    shutil.copy(os.path.join(CHECKOUT, "pretrain_gpt.py"), dst)
    shutil.copy(os.path.join(CHECKOUT, "megatron/core/package_info.py"),
                os.path.join(dst, "megatron/core"))
    return dst


def _apply(*argv):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts/apply_patches.sh"), *argv],
                          capture_output=True, text=True, timeout=60)


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


TAGS = tuple(__import__("megatron_oases.megatron_lm.checkout", fromlist=["TAGS"]).TAGS.values())
"""One tag per supported release; each gets its release's patch set (patches/README.md)."""


def _patch_set(version: str) -> str:
    """patches/<set> for a package_info version: core_v0.16.1 or core_v0.MINOR.x."""
    return "core_v0.16.1" if version == "0.16.1" else "core_v" + version.rsplit(".", 1)[0] + ".x"


def _tag_tree(dst, tag):
    """``tag``'s pretrain_gpt.py and package_info.py (from the checkout's git history) in dst."""
    for path in ("pretrain_gpt.py", "megatron/core/package_info.py"):
        proc = subprocess.run(["git", "-C", CHECKOUT, "show", f"{tag}:{path}"],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode:
            pytest.skip(f"the checkout's git history has no {tag}:{path} (a shallow clone?); "
                        f"fetch the tags: git -C {CHECKOUT} fetch --tags")
        os.makedirs(os.path.dirname(os.path.join(dst, path)) or dst, exist_ok=True)
        with open(os.path.join(dst, path), "w") as f:
            f.write(proc.stdout)
    return dst


@pytest.mark.parametrize("tag", TAGS)
def test_apply_patches_idempotent_and_revertible(tmp_path, tag):
    from megatron_oases.megatron_lm.checkout import checkout_version

    tree = _tag_tree(str(tmp_path / "mlm"), tag)
    target = os.path.join(tree, "pretrain_gpt.py")
    upstream = _sha(target)
    check = _apply("--check", tree)
    assert check.returncode == 0 and "would apply" in check.stdout, check.stderr
    first = _apply(tree)
    assert first.returncode == 0 and "applied" in first.stdout, first.stderr
    patched = _sha(target)
    text = open(target).read()
    assert patched != upstream and "wrap_entry" in text
    assert f"patches/{_patch_set(checkout_version(__import__('pathlib').Path(tree)))}" in text
    if tag >= "core_v0.19":  # the provider is a keyword, and it builds only non-stock runs
        assert "model_provider=gpt_model_provider" in text and ".uses_stock(args)" in text
    again = _apply(tree)
    assert again.returncode == 0 and "already applied" in again.stdout and _sha(target) == patched
    assert _apply("--revert", tree).returncode == 0 and _sha(target) == upstream


def test_apply_patches_refuses_other_files_and_releases(tmp_path):
    import re

    tree = _copy_checkout(str(tmp_path / "mlm"))
    target = os.path.join(tree, "pretrain_gpt.py")
    text = open(target).read().replace("inprocess_restart.maybe_wrap_for_inprocess_restart(",
                                       "my_restart_wrapper(")
    open(target, "w").write(text)
    proc = _apply(tree)
    assert proc.returncode == 1 and "nor patched" in proc.stderr, proc.stderr
    assert open(target).read() == text  # untouched
    info = os.path.join(tree, "megatron/core/package_info.py")
    release = re.sub(r"^MINOR = \d+", "MINOR = 15", open(info).read(), flags=re.M)
    open(info, "w").write(release)
    proc = _apply(tree)
    assert proc.returncode == 1 and "is Megatron-Core 0.15." in proc.stderr
    assert _apply().returncode == 2 and _apply(str(tmp_path / "missing")).returncode == 1


def test_apply_patches_checks_the_git_tag(tmp_path):
    from pathlib import Path

    from megatron_oases.megatron_lm.checkout import checkout_version

    tree = _copy_checkout(str(tmp_path / "mlm"))
    version = checkout_version(Path(tree))
    git = ["git", "-C", tree, "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "upstream"], check=True)
    subprocess.run([*git, "tag", f"core_v{version}"], check=True)
    assert _apply(tree).returncode == 0
    subprocess.run([*git, "commit", "-qam", "local change"], check=True)
    proc = _apply(tree)
    assert proc.returncode == 1 and f"not {_patch_set(version)}" in proc.stderr, proc.stderr


def _run_patched_main(path, argv):
    """Run the patched pretrain_gpt.py as __main__ with pretrain() replaced by a recorder."""
    import runpy

    import megatron.training as mt

    seen = {}

    def fake_pretrain(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)

    saved = mt.pretrain, sys.argv
    mt.pretrain, sys.argv = fake_pretrain, [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        mt.pretrain, sys.argv = saved
    return seen


def test_patched_pretrain_gpt_hands_over_our_providers(tmp_path, stock, monkeypatch):
    """The checkout's patched ``__main__`` passes our model provider (positional before 0.19,
    ``model_provider=`` from 0.19) and our flags: as ``extra_args_provider`` to ``pretrain``
    (0.16-0.17), or parsed by ``parse_and_validate_args`` before ``pretrain`` (0.18+)."""
    import argparse

    from megatron_oases.megatron_lm.model_provider import ModelProvider

    tree = _copy_checkout(str(tmp_path / "mlm"))
    assert _apply(tree).returncode == 0
    monkeypatch.setenv("WORLD_SIZE", "1")
    # without CUDA the patched script trains on CPU ranks (wrap_entry's CPU layer): gloo
    cpu = [] if __import__("torch").cuda.is_available() else ["--distributed-backend", "gloo"]
    seen = _run_patched_main(os.path.join(tree, "pretrain_gpt.py"), TINY + cpu)
    args, kwargs = seen["args"], seen["kwargs"]
    provider = kwargs.get("model_provider") or next(
        a for a in args if isinstance(a, ModelProvider))
    assert isinstance(provider, ModelProvider) and provider.stock is not None
    if "extra_args_provider" in kwargs:  # pretrain parses the args itself
        parser = kwargs["extra_args_provider"](argparse.ArgumentParser(allow_abbrev=False))
        assert any("--schedule" in a.option_strings for a in parser._actions)
    else:  # the script parsed them, with our flags, and built the config container from them
        from megatron.training import get_args

        assert get_args().tp_backend == "megatron" and provider.uses_stock(get_args())
        assert "args_defaults" not in kwargs and not isinstance(args[0], type(provider))


def test_model_provider_builds_3d_from_megatron_args(on_ranks):
    from megatron_oases.train_args import TP_BACKENDS

    if "3d" not in TP_BACKENDS:
        pytest.skip("--tp-backend 3d is not a Megatron-Core layer spec yet")
    _cube_equals_stock_tp8(on_ranks, [])


def _cube_equals_stock_tp8(on_ranks, model_flags):
    """The cube and stock TP 8 from the same Megatron-LM flags (CPU init, no dropout): the cube
    draws Megatron's CPU master weights in Megatron's order and keeps its shards, so both start
    from the same model and the first loss is equal."""
    argv = TINY + ["--tensor-model-parallel-size", "8", "--num-attention-heads", "8",
                   "--micro-batch-size", "4", "--global-batch-size", "4", "--hidden-dropout", "0",
                   "--attention-dropout", "0", *model_flags]
    stock = on_ranks(_provider_rank, 8, argv, 8, timeout_s=600)
    cube = on_ranks(_provider_rank, 8, argv + ["--tp-backend", "3d"], 8, timeout_s=600)
    assert (cube[0]["model"], cube[0]["layer"]) == ("GPTModel", "TransformerLayer3D")
    assert math.isfinite(cube[0]["loss"]) and cube[0]["grads"]
    assert all(r["loss"] == pytest.approx(cube[0]["loss"]) for r in cube)
    assert cube[0]["loss"] == pytest.approx(stock[0]["loss"], rel=1e-5), (cube[0], stock[0])


LLAMA_MLM = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
             "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--qk-layernorm", "--hidden-dropout", "0",
             "--attention-dropout", "0"]


def test_model_provider_builds_llama_for_every_build_from_megatron_args(on_ranks):
    """A Llama-style model from Megatron-LM's flags under every TP-2 build: the layer each build
    makes, and (same CPU init, no dropout) the loss and gradients flow of stock's model."""
    builds = {"stock": ([], "TransformerLayer", "TransformerBlock"),
              "oases": (["--schedule", "oases"], "TransformerLayer", "OasesTransformerBlock"),
              "plan": (["--oases-plan", PLAN], "PlannedTransformerLayer", "TransformerBlock"),
              "plan+oases": (["--oases-plan", PLAN, "--schedule", "oases"], "PlannedTransformerLayer",
                             "OasesTransformerBlock"),
              "atp 1,2": (["--tp-backend", "atp", "--atp-mesh", "1,2"], "ATPTransformerLayer",
                          "TransformerBlock"),
              "atp 2,1 + oases": (["--tp-backend", "atp", "--atp-mesh", "2,1", "--schedule", "oases"],
                                  "ATPTransformerLayer", "OasesTransformerBlock")}
    losses = {}
    for name, (extra, layer, block) in builds.items():
        argv = TINY + ["--tensor-model-parallel-size", "2", *LLAMA_MLM, *extra]
        out = on_ranks(_provider_rank, 2, argv, 2, timeout_s=300)
        r = out[0]
        assert (r["model"], r["layer"], r["block"]) == ("GPTModel", layer, block), (name, r)
        assert math.isfinite(r["loss"]) and r["grads"] and out[1]["loss"] == pytest.approx(r["loss"])
        losses[name] = r["loss"]
    assert all(v == pytest.approx(losses["stock"], rel=1e-5) for v in losses.values()), losses


def test_model_provider_builds_llama_3d_from_megatron_args(on_ranks):
    _cube_equals_stock_tp8(on_ranks, [*LLAMA_MLM, "--num-query-groups", "8"])  # stock: groups % TP


# ---- megatron.training.pretrain on CPU (runtime.cpu_training_compat) --------------------------
# The training runs themselves (stock, Oases, ATP, plans, 3-D, resume) are in
# tests/test_megatron_lm_wheel.py, which uses this checkout when MEGATRON_LM_PATH is set.


def test_cpu_training_layer_pins_the_upstream_code_it_wraps(stock):
    """``cpu_training_compat`` relies on these lines of core_v0.16.1; fail loudly if they move."""
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    from megatron.core.datasets import utils as dutils

    from megatron_oases import mcore_compat
    from megatron_oases.runtime import cpu_training_compat as ctc

    init = initialize.initialize_megatron
    assert "allow_no_cuda" in inspect.signature(init).parameters
    assert 'assert torch.cuda.is_available(), "Megatron requires CUDA."' in inspect.getsource(init)
    assert "initialize_megatron(" in inspect.getsource(training.pretrain)
    assert "set_jit_fusion_options(" in inspect.getsource(training.pretrain)
    assert 'device="cuda"' in inspect.getsource(initialize._warmup_jit_function)
    dist = inspect.getsource(initialize._initialize_distributed)
    assert "device_count = torch.cuda.device_count()" in dist and "if device_count > 0:" in dist
    assert "mpu.initialize_model_parallel(" in dist
    assert "if torch.cuda.device_count() > 0:" in inspect.getsource(initialize._set_random_seed)
    deps = inspect.getsource(initialize._compile_dependencies)
    assert "compile_helpers()" in deps
    assert ("fused_kernels.load(args)" in deps) == mcore_compat.initialize_loads_fused_kernels()
    if mcore_compat.initialize_loads_fused_kernels():
        from megatron.legacy import fused_kernels

        load = inspect.getsource(fused_kernels.load)
        assert "_get_cuda_bare_metal_version(" in load
        assert load.count("_cpp_extention_load_helper(") == 1  # defined, never called
    assert "get_device_arch_version() < 10" in inspect.getsource(arguments.validate_args)
    compile_helpers = getattr(dutils.compile_helpers, "__wrapped_original__",
                              dutils.compile_helpers)
    assert 'command = ["make", "-C", os.path.abspath(os.path.dirname(__file__))]' in \
        inspect.getsource(compile_helpers)
    for modname in ctc.PATCHED_MODULES:
        __import__(modname)


@needs_cpu
def test_cpu_training_layer_is_scoped(stock):
    import torch

    from megatron_oases.runtime.cpu_training_compat import install_cpu_training_compat

    import_stock_pretrain_gpt_cached()
    assert install_cpu_training_compat()
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0  # global torch: real
    assert initialize.torch is not torch and initialize.torch.cuda.device_count() == 1
    assert initialize.torch.zeros(2, device="cuda").device.type == "cpu"
    assert training.torch.cuda.memory_reserved() == 0
    assert arguments.get_device_arch_version() == 0
    assert training.initialize_megatron.__cpu_compat_wrapped__ is initialize.initialize_megatron
    from megatron_oases import mcore_compat

    if not mcore_compat.initialize_loads_fused_kernels():
        assert not hasattr(initialize, "fused_kernels")
        assert install_cpu_training_compat()  # idempotent
        return
    from megatron.legacy import fused_kernels

    assert initialize.fused_kernels.load(None) is None  # no nvcc probe on CPU
    assert initialize.fused_kernels is not fused_kernels  # only initialize's name is replaced
    assert initialize.fused_kernels._get_cuda_bare_metal_version is \
        fused_kernels._get_cuda_bare_metal_version
    with pytest.raises(TypeError):  # the real probe, without a CUDA toolkit
        fused_kernels.load(None)
    assert install_cpu_training_compat()  # idempotent


def test_prebuilt_dataset_helpers_skip_make(stock):
    """megatron-core's wheel ships helpers_cpp but no Makefile: ``compile_helpers`` must not run
    make then (rank 0 would exit "Failed to compile the C++ dataset helper functions")."""
    import subprocess as sp
    from unittest import mock

    from megatron.core.datasets import utils as dutils

    from megatron_oases.megatron_lm.checkout import use_prebuilt_dataset_helpers

    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError:
        assert not use_prebuilt_dataset_helpers()
        return
    assert use_prebuilt_dataset_helpers() and use_prebuilt_dataset_helpers()
    with mock.patch.object(sp, "run", side_effect=AssertionError("make ran")):
        dutils.compile_helpers()
    assert dutils.compile_helpers.__wrapped_original__.__module__ == dutils.__name__


LLAMA = ["--position-embedding-type", "rope", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--normalization", "RMSNorm", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--qk-layernorm", "--no-bias-swiglu-fusion"]


@needs_cpu
def test_pretrain_llama_tp2_oases_and_plan_match_stock_cpu():
    """A Llama-style model (RoPE, SwiGLU, GQA, RMSNorm, no bias, untied, QK-norm) through
    Megatron-LM's own loop: stock TP 2, --schedule oases, --oases-plan and ATP (1,2) log the same
    losses."""
    tp2 = ["--tensor-model-parallel-size", "2"] + LLAMA
    stock, _ = train(2, tp2, 4)
    for extra in (["--schedule", "oases"], ["--oases-plan", PLAN],
                  ["--tp-backend", "atp", "--atp-mesh", "1,2"]):
        losses, _ = train(2, tp2 + extra, 4)
        for k, v in losses.items():
            assert v == pytest.approx(stock[k], rel=1e-5), (extra, k, losses, stock)


def _doc_blocks(path: str, heading: str, count: int) -> list[str]:
    """The first ``count`` ```bash blocks after ``heading`` in a Markdown file."""
    text = open(path, encoding="utf-8").read()
    after, blocks = text[text.index(heading):], []
    for _ in range(count):
        start = after.index("```bash\n") + len("```bash\n")
        blocks.append(after[start:after.index("```", start)])
        after = after[after.index("```", start) + 3:]
    return blocks


@needs_cpu
def test_docs_cpu_commands_run_as_written(tmp_path):
    """docs/megatron_lm.md's CPU section as a new user runs it: the install block in a new
    virtualenv (the megatron_oases path is this repository; the clone is replaced by this
    machine's checkout, which has no GitHub access), then the commands: every torchrun trains,
    and the resume logs iterations after 5."""
    import signal

    import re

    from megatron.core.package_info import __version__ as installed

    install, run = _doc_blocks(os.path.join(ROOT, "docs", "megatron_lm.md"),
                               "## On a CPU machine (gloo)", 2)
    clone = re.search(r"git clone -b core_v\S+ https://github.com/NVIDIA/Megatron-LM.*\n$", install)
    assert install.startswith("python3 -m venv ") and clone, install
    assert "megatron-core==0.19.2" in install  # the default; this machine's release replaces it
    install = install.replace("/path/to/megatron_oases", ROOT).replace(clone.group(), "")
    install = install.replace("megatron-core==0.19.2", f"megatron-core=={installed}")
    assert run.startswith("export MEGATRON_LM_PATH=") and run.count("torchrun") == 4
    run = run.replace(run.splitlines()[0], f"export MEGATRON_LM_PATH={CHECKOUT}", 1)
    script = "set -euo pipefail\n" + install + run
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "PYTHONPATH", "VIRTUAL_ENV", "MEGATRON_LM_PATH")}
    env["OMP_NUM_THREADS"] = "1"
    # no environment of this test run on PATH: the new virtualenv's python and torchrun only
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(sys.prefix))
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the documented commands passed 900 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-4000:]
    assert "successfully saved checkpoint from iteration       5" in out
    assert "successfully loaded checkpoint" in out
    assert max(losses_of(out)) == 10
