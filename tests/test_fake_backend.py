"""A fourth TP backend is one record row (``describe.backends``) and the modules that row names:
a fake one with a three-axis layout ``{"a": 2, "b": 2, "c": 2}`` (``tests/fake_backend.py``, the
cube's layer under its own event names), added to the table and nowhere else, is accepted by the
trainer's validation, ``sim``, ``sim --search``, ``plan`` and ``profile``, and priced as the cube
it borrows its layer from. docs/architecture.md's count of what a backend costs is this test's."""
from __future__ import annotations

import json
import pathlib
import re

import pytest

from megatron_oases.describe import backends
from megatron_oases.describe.layout import Layout
from megatron_oases.errors import ConfigError
from tests import fake_backend
from tests.fake_backend import FAKE

GRID = Layout(a=2, b=2, c=2)
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "16",
         "--micro-batch-size", "4", "--ffn-hidden-size", "256", "--vocab-size", "128"]


@pytest.fixture
def fake(monkeypatch):
    """The fake row in the table: the only change to the package a new backend needs."""
    monkeypatch.setitem(backends.BACKENDS, "fake", FAKE)
    fake_backend.BUILT.clear()
    return FAKE


def _validate(argv):
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    return validate_config(run_config(build_parser().parse_args(MODEL + argv)), 8, False)


def test_the_trainer_accepts_it_and_refuses_in_its_records_words(fake):
    cfg = _validate(["--tp-backend", "fake", "--tensor-model-parallel-size", "8", "--global-batch-size", "4"])
    assert cfg.layout == GRID and cfg.atp_mesh is None
    with pytest.raises(ConfigError, match="--micro-batch-size 2 is not a multiple of 4"):  # the record's split
        _validate(["--tp-backend", "fake", "--tensor-model-parallel-size", "8", "--micro-batch-size", "2",
                   "--global-batch-size", "2"])
    with pytest.raises(ConfigError, match="^--atp-mesh needs --tp-backend atp$"):
        _validate(["--tp-backend", "fake", "--tensor-model-parallel-size", "8", "--atp-mesh", "2,4"])


def _sim(capsys, argv) -> str:
    from megatron_oases.sim.frontends.cli import sim_main

    capsys.readouterr()
    assert sim_main(["--topology", "dgx-a100", *MODEL, "--global-batch-size", "8", *argv]) == 0, \
        capsys.readouterr().err
    return capsys.readouterr().out


def test_sim_prices_it_as_the_cube_whose_layer_it_borrows(fake, capsys):
    mine = _sim(capsys, ["--tp-backend", "fake", "--tensor-model-parallel-size", "8"]).splitlines()
    cube = _sim(capsys, ["--tp-backend", "3d", "--tensor-model-parallel-size", "8"]).splitlines()
    assert "fake grid 2x2x2" in mine[0] and "3-D cube" in cube[0]
    assert mine[1:] == cube[1:]  # the same events, so the same iteration


def test_sim_search_offers_its_layout(fake, capsys):
    out = _sim(capsys, ["--search", "--gpus", "8", "--tp-sizes", "8", "--backends", "megatron,fake",
                        "--schedules", "default", "--top", "50"])
    assert re.search(r"tp8\.pp1\.dp1\.fake2x2x2 ", out), out


def test_plan_plans_it_and_its_plan_file_launches_it(fake, tmp_path):
    from megatron_oases.plan.plan_cli import build_parser, make_plan
    from megatron_oases.plan.plan_file import plan_launch_flags, whole_model_backend

    def plan(family):
        a = build_parser().parse_args(MODEL + ["--global-batch-size", "8", "--tensor-model-parallel-size", "8",
                                               "--topology", "dgx-a100", "--families", family,
                                               "--sub-batches", "1", "--out", str(tmp_path / "p.json")])
        return make_plan(a)[0]

    mine, cube = plan("fake"), plan("3d")
    assert mine["layouts"] == {"fake8": {"tp_backend": "fake", "layout": {"a": 2, "b": 2, "c": 2}}}
    assert mine["predicted"]["iteration_ms"] == cube["predicted"]["iteration_ms"]
    written = json.loads(json.dumps(mine))  # as read back from the file
    assert whole_model_backend(written) == {"--tp-backend": "fake"}
    assert plan_launch_flags(written, "p.json")["--tp-backend"] == "fake"


def test_profile_builds_its_events_with_the_workloads_its_record_names(fake):
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.sim.calibrate.profiler import ProfileSettings, needed_events, profile_compute
    from megatron_oases.sim.core.strategy import Strategy
    from megatron_oases.topology import load_topology

    model = GPTShape(num_layers=1, hidden_size=64, num_attention_heads=8, seq_length=16, micro_batch_size=4,
                     ffn_hidden_size=256, padded_vocab_size=128, dtype="fp32")
    events = needed_events(model, [Strategy(tp=8, backend="fake")], load_topology("dgx-a100"))
    compute = [e for e in events.values() if e.kind == "compute" and e.name.startswith("fake.")]
    times = profile_compute(compute, ProfileSettings(device="cpu", warmup=0, reps=1))
    assert set(times) == {e.key for e in compute} and all(t >= 0 for t in times.values())
    assert sorted(set(fake_backend.BUILT)) == sorted({e.name.removesuffix(".bwd") for e in compute})


def test_the_architecture_note_counts_what_the_fake_took():
    """docs/architecture.md: a backend is one edited file (this test's one ``setitem``) and as
    many new modules as the record's parts that are the backend's own (``NEW_PARTS``)."""
    words = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    m = re.search(r"\*\*A TP backend\*\*[^\n]*?(\w+) edited file and (\w+) new modules", text)
    assert m, "docs/architecture.md no longer states what a backend costs"
    assert (words[m.group(1)], words[m.group(2)]) == (1, len(fake_backend.NEW_PARTS))
    assert all(getattr(FAKE, part) for part in fake_backend.NEW_PARTS)
