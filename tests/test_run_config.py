"""The typed run configuration (``megatron_oases.run_config``): one place for the flags' defaults,
one function that reads a namespace by name, and no ``getattr(args, ...)`` anywhere else."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib

import pytest

from megatron_oases.run_config import (DEFAULTS, FLAT_FIELDS, MegatronLMOptions, RunConfig,
                                       run_config)

PKG = pathlib.Path(__file__).resolve().parents[1] / "megatron_oases"
HARNESS = PKG.parent / "benchmarks"
"""The benchmark harness beside the package: its entries read a run's flags too."""


def _sources():
    """(name, path) of every module of the package (relative to it) and of the harness
    (``benchmarks/...``)."""
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(PKG).as_posix(), path
    for path in sorted(HARNESS.rglob("*.py")):
        yield path.relative_to(PKG.parent).as_posix(), path


NAMESPACE_NAMES = {"args", "a", "view", "ns", "namespace"}
EXEMPT: dict[tuple[str, str], str] = {
    # (file, function): reason -- Megatron-LM's own options named in a table are read
    # through run_config.options_present
    ("precision.py", "priced_dtype"): "sim's and plan's pricing namespaces (--dtype is no RunConfig field)",
}


def namespace_getattr_reads() -> list[tuple[str, str, int]]:
    """(file, enclosing function, line) of every ``getattr(<namespace>, ...)`` outside
    ``run_config.py``, where <namespace> is one of the names run arguments go by."""
    out = []
    for rel, path in _sources():
        if rel == "run_config.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        functions = [n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "getattr" and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in NAMESPACE_NAMES):
                enclosing = [f.name for f in functions
                             if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
                out.append((rel, enclosing[-1] if enclosing else "<module>", node.lineno))
    return out


def test_no_namespace_getattr_outside_the_config_module():
    reads = [r for r in namespace_getattr_reads() if r[:2] not in EXEMPT]
    assert reads == [], "read the typed RunConfig (run_config(args)) instead: " + ", ".join(
        f"{f}:{line} ({fn})" for f, fn, line in reads)


def test_exemptions_are_still_needed():
    used = {r[:2] for r in namespace_getattr_reads()}
    assert set(EXEMPT) <= used, f"drop the stale exemptions {set(EXEMPT) - used}"


def test_parser_defaults_are_the_config_defaults():
    from megatron_oases.train_args import build_parser

    actions = [a for a in build_parser()._actions  # not a flag the table refuses (flags.Refused: --fp32)
               if a.dest != "help" and a.default is not argparse.SUPPRESS]
    assert {a.dest for a in actions} <= set(FLAT_FIELDS)
    for a in actions:
        assert a.default == getattr(DEFAULTS, a.dest), a.dest
    # Not flags: set by validation (plan degrees) or programmatically (mesh search's gain).
    assert set(FLAT_FIELDS) - {a.dest for a in actions} == {"oases_layer_degrees", "atp_min_gain"}


def test_megatron_lm_flags_share_the_defaults():
    from megatron_oases.megatron_lm.flags import add_flags

    parser = add_flags(argparse.ArgumentParser())
    for a in parser._actions:
        if a.dest in FLAT_FIELDS:
            assert a.default == getattr(DEFAULTS, a.dest), a.dest


def test_trainer_namespace_round_trips():
    from megatron_oases.train_args import build_parser

    ns = build_parser().parse_args(["--hidden-size", "96", "--schedule", "oases", "--swiglu"])
    cfg = run_config(ns)
    assert (cfg.hidden_size, cfg.schedule, cfg.swiglu) == (96, "oases", True)
    assert cfg.as_dict() == {**vars(ns), "oases_layer_degrees": None,
                             "atp_min_gain": DEFAULTS.atp_min_gain}
    assert cfg.megatron_lm == MegatronLMOptions()
    assert run_config(cfg) is cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]


def test_partial_and_megatron_lm_namespaces_take_defaults():
    ns = argparse.Namespace(schedule="oases", context_parallel_size=2, transformer_impl="te",
                            num_virtual_stages_per_pipeline_rank=3, unrelated=object())
    cfg = run_config(ns)
    assert cfg.schedule == "oases" and cfg.tp_backend == DEFAULTS.tp_backend
    assert cfg.oases_plan is None and cfg.oases_layer_degrees is None
    assert cfg.megatron_lm.context_parallel_size == 2
    assert cfg.megatron_lm.transformer_impl == "te"
    assert cfg.megatron_lm.num_virtual_stages_per_pipeline_rank == 3
    assert not cfg.megatron_lm.uneven_pipeline
    assert run_config(argparse.Namespace(decoder_first_pipeline_num_layers=1)
                      ).megatron_lm.uneven_pipeline


def test_the_config_is_a_kw_only_frozen_dataclass():
    with pytest.raises(TypeError):
        RunConfig(4)  # type: ignore[misc]
    assert RunConfig(num_layers=8).num_layers == 8


@pytest.mark.parametrize("swiglu,cuda,fused", [(True, True, True), (True, False, False),
                                               (False, True, False)])
def test_megatron_swiglu_kernel_only_on_cuda(swiglu, cuda, fused):
    """Megatron's fused SwiGLU is on where it was measured faster (CUDA; docs/gpu.md); its
    GeLU kernel (tanh GeLU, slower) stays off."""
    from megatron_oases.specs import transformer_config_from_args

    cfg = dataclasses.replace(DEFAULTS, swiglu=swiglu, ffn_hidden_size=4 * DEFAULTS.hidden_size)
    assert transformer_config_from_args(cfg, cuda=cuda).bias_activation_fusion is fused


# ---- validate once, pass the config down ------------------------------------------------------
# Only the entries see the argparse namespace: they call ``run_config(args)`` once and hand the
# (validated) RunConfig down. Everything else takes ``cfg``.

RUN_CONFIG_ENTRIES: dict[tuple[str, str], str] = {
    ("train.py", "main"): "the trainer's command line",
    ("megatron_lm/flags.py", "validate_megatron_args"): "Megatron-LM's parse hook",
    ("megatron_lm/model_provider.py", "uses_stock"): "called with its args by the patched checkout",
    ("megatron_lm/model_provider.py", "_builder"): "gpt_builder's signature: Megatron-LM's args",
    ("megatron_lm/flags.py", "early_refusal"): "the entry's argv, read before Megatron-LM's parse",
    ("megatron_lm/pretrain_gpt.py", "main"): "python -m megatron_oases.pretrain_gpt",
    ("sim/frontends/predict.py", "sim_inputs_from_train_args"): "the simulator's trainer-flags front end",
    ("sim/frontends/predict.py", "profile_train_args"): "the simulator's trainer-flags front end",
    ("sim/frontends/predict.py", "_train_step"): "the simulator's trainer-flags front end",
    ("benchmarks/standin/measure.py", "trainer_config"): "the stand-in benchmark's trainer flags",
    ("plan/mesh_cli.py", "run_shape"): "megatron-oases mesh: the trainer's model flags",
    ("sim/frontends/launch.py", "trainer_refusal"): "sim --search's printed launch, checked as the trainer parses it",
    ("sim/frontends/predict.py", "_with_loop_overhead"):
        "the simulator's trainer-flags front end (the loop overhead's one-rank runs)",
}
"""(file, function) that may call ``run_config(``, and why it is an entry."""

ARGS_PARAMETERS: dict[tuple[str, str], str] = {
    **RUN_CONFIG_ENTRIES,
    ("run_config.py", "run_config"): "the one reader of a run's namespace",
    ("run_config.py", "options_present"): "Megatron-LM's own options, named in a table",
    ("megatron_lm/flags.py", "keep_on_megatron_args"): "the one write onto Megatron-LM's args",
    ("megatron_lm/flags.py", "parse_known_args"): "argparse's own method (args: the argv)",
    ("flags.py", "parse_known_args"): "argparse's own method (args: the argv)",
    ("megatron_lm/model_provider.py", "ensure_validated"): "Megatron-LM's args from get_args()",
    ("megatron_lm/model_provider.py", "_megatron_config_from_args"):
        "Megatron-LM's core_transformer_config_from_args reads its args",
    ("megatron_lm/options.py", "refusal"): "Megatron-LM's own options, which RunConfig lacks",
    ("megatron_lm/wheel_gpt.py", "refusal"): "Megatron-LM's own options, which RunConfig lacks",
    ("megatron_lm/wheel_gpt.py", "dataset_config"):
        "Megatron-LM's GPTDatasetConfig from its own data options",
    ("mcore_compat.py", "batch_on_this_tp_rank"): "Megatron's get_batch_on_this_tp_rank(args)",
    ("runtime/cpu_training_compat.py", "load"): "Megatron's fused_kernels.load(args) signature",
    ("runtime/spawn.py", "_rank_main"): "a function's positional arguments, not a namespace",
    ("runtime/spawn.py", "run_on_ranks"): "a function's positional arguments, not a namespace",
    ("topology/netns.py", "run"): "a command's argv list",
    ("sim/frontends/predict.py", "predict_train_step"): "the simulator's trainer-flags front end",
    ("sim/frontends/predict.py", "analytical_train_step"):
        "the simulator's trainer-flags front end (scripts/sim_vs_standin.py)",
    ("sim/calibrate/loop_overhead.py", "single_rank_args"):
        "the trainer flags of the loop overhead's one-rank runs, for the front end's entries",
    ("topology/probe.py", "overlap"): "the probe's own command line",
    ("topology/probe.py", "p2p"): "the probe's own command line",
}
"""(file, function) that may take a parameter named ``args``, and why. Functions that build a
parser take ``parser`` (``add_*_args(parser)``) and need no entry."""


def _functions():
    """(file, function node) of every function of the package."""
    for rel, path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield rel, node


def run_config_callers() -> set[tuple[str, str]]:
    """(file, innermost function) of every ``run_config(`` call in the package."""
    out = set()
    for rel, fn in _functions():
        inner = {id(n) for sub in ast.walk(fn) if sub is not fn
                 and isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(sub)}
        for n in ast.walk(fn):
            if (id(n) not in inner and isinstance(n, ast.Call)
                    and getattr(n.func, "id", getattr(n.func, "attr", None)) == "run_config"):
                out.add((rel, fn.name))
    return out


def args_parameters() -> set[tuple[str, str]]:
    """(file, function) of every function with a parameter named ``args``."""
    return {(rel, fn.name) for rel, fn in _functions()
            if "args" in [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]}


def test_run_config_is_built_at_the_entries_only():
    stray = run_config_callers() - set(RUN_CONFIG_ENTRIES)
    assert not stray, f"take the RunConfig as a parameter instead of building it: {sorted(stray)}"


def test_only_the_entries_take_the_namespace():
    stray = args_parameters() - set(ARGS_PARAMETERS)
    assert not stray, f"take the RunConfig (cfg) instead of the namespace (args): {sorted(stray)}"


def test_entry_lists_hold_no_stale_names():
    assert set(RUN_CONFIG_ENTRIES) <= run_config_callers() | args_parameters()
    assert set(ARGS_PARAMETERS) <= args_parameters() | run_config_callers()


def test_validation_returns_the_config_and_leaves_the_namespace_alone():
    from megatron_oases.train_args import build_parser, validate_config

    args = build_parser().parse_args(["--tensor-model-parallel-size", "4", "--tp-backend", "atp",
                                      "--atp-mesh", "2,2", "--swiglu", "--hidden-size", "128",
                                      "--recompute-granularity", "full",
                                      "--recompute-method", "uniform"])
    before = dict(vars(args))
    cfg = validate_config(run_config(args), 4, cuda=False)
    assert vars(args) == before
    assert (cfg.atp_mesh, cfg.ffn_hidden_size, cfg.max_position_embeddings,
            cfg.recompute_num_layers, cfg.oases_layer_degrees) == ((2, 2), 320, 32, 1, None)
    assert validate_config(cfg, 4, cuda=False) == cfg  # validating again changes nothing
