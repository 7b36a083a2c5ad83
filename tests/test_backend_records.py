"""The backend records (``describe/backends.py``) are the one list of TP backends and the one home
of each backend's divisibility rule: every consumer offers the table's names, the trainer refuses
what the record's check refuses in the same words, and the planner and the simulator accept and
refuse the same shapes.

Every consumer reads the table (a fake fourth record with a three-axis layout runs through all of
them: ``tests/test_fake_backend.py``)."""
from __future__ import annotations

import itertools

import pytest

from megatron_oases.describe import registry
from megatron_oases.describe.backends import BACKENDS, Backend, backend, resolve
from megatron_oases.describe.ops import GPT2, LayerVariant, ModelingError
from megatron_oases.errors import ConfigError
from megatron_oases.plan import graph
from megatron_oases.plan.graph import BlockStrategy, PlanModel, attention_fits, feasible
from megatron_oases.pricing.device_model import SimError
from megatron_oases.run_config import run_config

NAMES = set(BACKENDS)


def _choices(parser, option: str) -> set[str]:
    (action,) = [a for a in parser._actions if option in a.option_strings]
    return set(action.choices)


def test_the_table_lists_megatron_atp_and_3d():
    assert list(BACKENDS) == ["megatron", "atp", "3d"]
    assert all(isinstance(b, Backend) and b.name == n and b.summary for n, b in BACKENDS.items())


def test_every_consumer_offers_the_tables_names():
    import argparse

    from megatron_oases.megatron_lm.flags import add_flags
    from megatron_oases.sim.frontends.cli import build_parser as sim_parser
    from megatron_oases.train_args import build_parser

    assert tuple(registry.BACKENDS) == tuple(BACKENDS)
    assert set(graph.family_names()) == NAMES
    assert all(graph.family_of(BlockStrategy(degree=1, family=n)) for n in NAMES)  # the planner prices every record
    assert _choices(build_parser(), "--tp-backend") == NAMES  # the trainer
    assert _choices(add_flags(argparse.ArgumentParser()), "--tp-backend") == NAMES  # Megatron-LM's flags
    assert _choices(sim_parser(), "--tp-backend") == NAMES


def test_every_record_names_a_runtime_spec_builder_and_workloads_that_exist():
    """The record names (``module:function``) its runtime half (process groups and layer spec,
    ``specs.SpecBuilder``), its profiling workloads and its Oases tape; each resolves."""
    from megatron_oases.specs import SpecBuilder

    for b in BACKENDS.values():
        assert isinstance(resolve(b.spec_builder), SpecBuilder), b.name
        assert callable(resolve(b.profile_workloads)), b.name
        assert b.oases_tape is None or callable(resolve(b.oases_tape)), b.name


@pytest.mark.parametrize("tp", [6, 8, 12])
def test_the_simulators_search_offers_each_records_layouts(tp):
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.sim.core.search import SearchSpace, candidates

    shape = GPTShape(num_layers=2, hidden_size=tp * 48, num_attention_heads=tp * 2, seq_length=16,
                     micro_batch_size=4, ffn_hidden_size=tp * 192, padded_vocab_size=tp * 64)
    space = SearchSpace(gpus=tp, global_batch=4, tp_sizes=[tp], pp_sizes=[1], backends=tuple(BACKENDS),
                        schedules=("default",), recompute=("off",))
    offered = {(c.backend, c.strategy.layout) for c in candidates(shape, space) if c.strategy is not None}
    assert offered == {(n, layout) for n, b in BACKENDS.items() for layout in b.layouts(tp)}


def test_an_unknown_backend_is_named():
    with pytest.raises(ModelingError, match="backend must be one of megatron, atp, 3d \\(got 'x'\\)"):
        backend("x")


# ---- one divisibility rule: the record, the trainer, the planner and the simulator agree -------------

def _grid():
    """(backend, tp, layout, hidden, heads, ffn, query groups, micro-batch): sizes that split over
    some layouts and not others (hidden always divisible by the heads; an FFN of 36 splits over
    ATP's d1 = 4 but not over TP 8, which every consumer refuses: the record's check includes
    Megatron's TP split)."""
    for name, tp in (("megatron", 4), ("atp", 4), ("atp", 8), ("3d", 8)):
        for layout in BACKENDS[name].layouts(tp):
            for hidden, heads, ffn, groups, b in itertools.product(
                    (96, 128), (4, 8, 16), (192, 96, 64, 36), (None, 2, 4), (2, 4)):
                if hidden % heads == 0 and (groups is None or heads % groups == 0):
                    yield name, tp, layout, hidden, heads, ffn, groups, b


GRID = list(_grid())


def _refusal(name, tp, layout, hidden, heads, ffn, groups, b) -> str:
    return BACKENDS[name].refusal(tp=tp, layout=layout, hidden=hidden, heads=heads, ffn=ffn, micro_batch=b,
                                  query_groups=groups)


def _record(*case) -> bool:
    return not _refusal(*case)


def _trainer_refusal(name, tp, layout, hidden, heads, ffn, groups, b) -> str:
    from megatron_oases.train_args import build_parser, validate_config

    argv = ["--tensor-model-parallel-size", str(tp), "--tp-backend", name, "--num-layers", "2",
            "--hidden-size", str(hidden), "--num-attention-heads", str(heads), "--ffn-hidden-size", str(ffn),
            "--micro-batch-size", str(b), "--global-batch-size", str(b), "--seq-length", "16"]
    argv += [x for flag in BACKENDS[name].launch_flags(layout).items() for x in flag if flag[0] != "--tp-backend"]
    argv += ["--group-query-attention", "--num-query-groups", str(groups)] if groups else []
    try:
        validate_config(run_config(build_parser().parse_args(argv)), tp, False)
    except ConfigError as e:
        return str(e)
    return ""


def _planner(name, tp, layout, hidden, heads, ffn, groups, b) -> bool:
    try:
        m = PlanModel(num_layers=2, hidden_size=hidden, num_attention_heads=heads, seq_length=16,
                      micro_batch_size=b, ffn_hidden_size=ffn, padded_vocab_size=tp * 64, tp=tp, sub_batches=1,
                      variant=LayerVariant(query_groups=groups) if groups else GPT2)
    except ConfigError:
        return False
    s = BlockStrategy(degree=tp, family=name, layout=layout)
    return not feasible(s, m) and attention_fits(s, m)


def _simulator(name, tp, layout, hidden, heads, ffn, groups, b) -> bool:
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.sim.core.strategy import Strategy, check

    try:
        m = GPTShape(num_layers=2, hidden_size=hidden, num_attention_heads=heads, seq_length=16,
                     micro_batch_size=b, ffn_hidden_size=ffn, padded_vocab_size=tp * 64,
                     variant=LayerVariant(query_groups=groups) if groups else GPT2)
        s = Strategy(tp=tp, backend=name, layout=layout)
        check(m, s, tp)
        registry.layer_description(backend=name, layout=layout, micro_batch=b, seq=16, hidden=hidden, heads=heads,
                                   ffn=ffn, tp=tp, bytes_per_element=2, variant=m.variant)
    except SimError:
        return False
    return True


def _ids(case) -> str:
    name, tp, layout, hidden, heads, ffn, groups, b = case
    return f"{name}-t{tp}-{layout.label}-h{hidden}a{heads}f{ffn}g{groups}b{b}"


def _disagreements(consumer) -> list[str]:
    return [_ids(c) for c in GRID if consumer(*c) != _record(*c)]


def test_the_grid_has_refusals_and_acceptances_of_every_backend():
    for name in BACKENDS:
        decisions = {_record(*c) for c in GRID if c[0] == name}
        assert decisions == {True, False}, name


def test_the_trainer_refuses_as_the_record_in_the_same_words():
    assert [_ids(c) for c in GRID if _trainer_refusal(*c) != _refusal(*c)] == []


def test_the_planner_decides_as_the_record():
    assert _disagreements(_planner) == []


def test_the_simulator_decides_as_the_record():
    """``sim.core.strategy.check`` reads the record (it used to accept Megatron 1-D key/value
    groups that the TP degree does not divide, which the trainer and the planner refuse)."""
    assert _disagreements(_simulator) == []
