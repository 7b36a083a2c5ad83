"""Every front end reads a shared flag the same way (issue 47 item 1).

The parsers of ``megatron-oases train``, ``sim``, ``profile``, ``plan``, ``mesh`` and our additions
to Megatron-LM's parser are built; a flag two of them take must have one name, ``dest``, default,
type and choices there, and be declared once, in ``megatron_oases.flags``; each flag's name is a
string literal at most twice in the package (the table, and at most one other place)."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib
from collections import defaultdict

import pytest

from megatron_oases.flags import FLAGS, MEGATRON_LM_ADDITIONS, option
from megatron_oases.run_config import DEFAULTS, RunConfig

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_oases"

NOT_SHARED = {"--out": "each front end's own output file: plan's plan JSON, profile's ProfileDB"}
"""Options two front ends spell alike that are not one run's flag, and why."""


def parsers() -> dict[str, argparse.ArgumentParser]:
    from megatron_oases.megatron_lm.flags import add_flags
    from megatron_oases.plan.mesh_cli import _parser as mesh_parser
    from megatron_oases.plan.plan_cli import build_parser as plan_parser
    from megatron_oases.sim.frontends.cli import build_parser as sim_parser
    from megatron_oases.sim.frontends.profile_cli import build_parser as profile_parser
    from megatron_oases.train_args import build_parser as train_parser

    return {"train": train_parser(), "sim": sim_parser(), "profile": profile_parser(), "plan": plan_parser(),
            "mesh": mesh_parser(), "megatron-lm": add_flags(argparse.ArgumentParser(add_help=False))}


def reading(action: argparse.Action) -> dict:
    """What a user sees and gets of one flag: its name, where it lands, default, type, choices."""
    return {"name": action.option_strings[0], "dest": action.dest, "default": action.default,
            "type": action.type, "choices": tuple(action.choices) if action.choices else None,
            "action": type(action).__name__, "nargs": action.nargs}


def flags_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of the parser's flags (not --help, nor a refused old name)."""
    return {o: a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction) for o in a.option_strings}


@pytest.fixture(scope="module")
def built():
    return {name: flags_of(p) for name, p in parsers().items()}


def test_a_flag_two_front_ends_take_reads_the_same_in_both(built):
    seen: dict[str, dict[str, dict]] = defaultdict(dict)
    for front, flags in built.items():
        for opt, action in flags.items():
            seen[opt][front] = reading(action)
    bad = []
    for opt, fronts in sorted(seen.items()):
        if len(fronts) < 2 or opt in NOT_SHARED:
            continue
        (first, want), *others = fronts.items()
        bad += [f"{opt}: {front} {got} != {first} {want}" for front, got in others if got != want]
    assert not bad, "\n".join(bad)


def test_a_flag_two_front_ends_take_is_declared_in_the_table(built):
    """sim and profile share their flag functions (one declaration); any other pair must take the
    flag from the table."""
    fronts_of: dict[str, set[str]] = defaultdict(set)
    for front, flags in built.items():
        for opt in flags:
            fronts_of[opt].add("sim" if front == "profile" else front)
    table = {f.name for f in FLAGS.values()}
    stray = sorted(o for o, fronts in fronts_of.items() if len(fronts) > 1 and o not in table | set(NOT_SHARED)
                   and o == flags_of_name(built, o))
    assert not stray, f"declare these in megatron_oases/flags.py: {stray}"


def flags_of_name(built, opt: str) -> str:
    """The first name of the flag ``opt`` spells in any front end (an alias maps to its flag)."""
    return next(flags[opt].option_strings[0] for flags in built.values() if opt in flags)


def test_each_front_end_takes_the_table_as_declared(built):
    """Name, dest, default, type and choices as the table says, wherever a front end takes it."""
    for front, flags in built.items():
        for flag in FLAGS.values():
            if flag.name in flags:
                action = flags[flag.name]
                assert (action.option_strings[0], action.dest, action.default, action.type) == (
                    flag.name, flag.dest, flag.default_value, flag.type), (front, flag.name)
                assert tuple(action.choices or ()) == tuple(flag.choices or ()), (front, flag.name)


def test_the_table_defaults_are_the_run_config_fields():
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    for flag in FLAGS.values():
        if flag.dest in fields:
            assert flag.default_value == getattr(DEFAULTS, flag.dest), flag.name
        else:  # a pricing flag of sim / plan: its own default, stated in the table
            assert flag.default is not dataclasses.MISSING, flag.name


def test_megatron_lm_gets_only_what_it_lacks(built):
    """Our additions to Megatron-LM's parser are the table's ``megatron_lm`` flags, and none of the
    model, parallel or batch flags Megatron-LM has itself."""
    added = {a.dest for a in built["megatron-lm"].values()}
    assert added == {d for d in MEGATRON_LM_ADDITIONS if FLAGS[d].refusal is None}  # a refused one is hidden
    assert not added & {"tensor_model_parallel_size", "num_layers", "micro_batch_size", "bf16"}


def test_every_shared_flag_is_in_train_or_a_pricing_flag(built):
    """A table flag the trainer lacks prices a run (sim / plan) or describes the launch's world."""
    lacking = {f.dest for f in FLAGS.values() if f.name not in built["train"] and f.refusal is None}
    # async_tensor_model_parallel_allreduce: a Megatron-LM older than megatron-core 0.16 (sim only)
    assert lacking == {"data_parallel_size", "dtype", "gpu", "memory_gb", "profile",
                       "async_tensor_model_parallel_allreduce"}


def literal_counts() -> dict[str, list[str]]:
    names = {f.name for f in FLAGS.values()}
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                where[node.value].append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return where


def test_each_shared_flag_name_is_written_at_most_twice():
    where = literal_counts()
    over = {name: spots for name, spots in where.items() if len(spots) > 2}
    assert not over, f"use megatron_oases.flags.option(dest) instead of the literal: {over}"
    assert all("flags.py" in where[f.name][0] or len(where[f.name]) <= 2 for f in FLAGS.values())


def test_option_names_the_table_flag_or_the_field():
    assert option("tensor_model_parallel_size") == "--tensor-model-parallel-size"
    assert option("add_bias_linear") == "--disable-bias-linear"  # the table's name, not the field's
    assert option("min_gain") == "--min-gain"


def test_plan_flags_given_win_over_the_model_file_and_defaults_fill_the_rest(tmp_path):
    """plan reads a flag given (even at its default) over ``--model``'s value, the file over the
    flag's default (the trainer's)."""
    from megatron_oases.plan.plan_cli import build_parser, model_from_args

    model = tmp_path / "m.yaml"
    model.write_text("num_layers: 8\nhidden_size: 256\nnum_attention_heads: 8\nvocab_size: 2048\n"
                     "dtype: fp32\n", encoding="utf-8")
    a = build_parser().parse_args(["--topology", "dgx-a100", "--model", str(model), "--dtype", "bf16",
                                   "--num-layers", "4"])
    m = model_from_args(a)
    assert (m.num_layers, m.hidden_size, m.dtype) == (4, 256, "bf16")  # given at its default: wins
    assert m.seq_length == DEFAULTS.seq_length and m.tp == DEFAULTS.tensor_model_parallel_size
