"""A backend's layout (``describe/layout.py``) and each record's reading of it: named axes, size,
label and JSON form; the records parse, label, list and refuse their layouts in the trainer's
words; a plan file written before plan files stored layouts (ATP's mesh only in its label) still
loads and launches the same run."""
from __future__ import annotations

import json
import pickle

import pytest

from megatron_oases.describe.backends import BACKENDS
from megatron_oases.describe.layout import Layout
from megatron_oases.describe.ops import ModelingError


def test_a_layout_is_its_named_axes():
    mesh = Layout(d1=2, d2=4)
    assert (mesh.names, mesh.shape, mesh.size, mesh["d2"]) == (("d1", "d2"), (2, 4), 8, 4)
    assert mesh == Layout({"d1": 2, "d2": 4}) and hash(mesh) == hash(Layout([("d1", 2), ("d2", 4)]))
    assert mesh != Layout(d2=4, d1=2) and mesh != Layout(x=2, y=4)  # order and names are the layout
    assert (mesh.label, str(mesh)) == ("2x4", "d1=2,d2=4")
    assert Layout.of_label("2x4", ("d1", "d2")) == mesh and Layout.of_label("2x4x1", ("d1", "d2")) is None
    assert Layout.from_json(json.loads(json.dumps(mesh.to_json()))) == mesh
    assert Layout.from_json([2, 4], ("d1", "d2")) == mesh  # a bare list: on the writer's axes
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    with pytest.raises(AttributeError):
        mesh.x = 1
    for bad in ({}, {"a": 0}, {"a": True}):
        with pytest.raises(ModelingError):
            Layout(bad)
    with pytest.raises(KeyError, match="has no axis 'z'"):
        mesh["z"]


@pytest.mark.parametrize("name, text, tp, want", [
    ("megatron", None, 8, Layout(tp=8)), ("atp", "2,4", 8, Layout(d1=2, d2=4)),
    ("3d", None, 8, Layout(x=2, y=2, z=2)), ("3d", None, 27, Layout(x=3, y=3, z=3))])
def test_each_record_parses_its_layout_and_offers_it(name, text, tp, want):
    rec = BACKENDS[name]
    assert rec.parse_layout(text, tp) == want and want.names == rec.layout_axes and want.size == tp
    assert want in rec.layouts(tp) and rec.layout_refusal(want, tp) == ""
    assert rec.layout_of_label(rec.label(want, tp)) == want


@pytest.mark.parametrize("name, text, tp, words", [
    ("atp", None, 8, "^--tp-backend atp needs --atp-mesh D1,D2"),
    ("atp", "2,2", 8, "^--atp-mesh 2,2: d1 x d2 = 4 must equal --tensor-model-parallel-size 8"),
    ("atp", "x", 8, "^--atp-mesh must be D1,D2"),
    ("atp", "0,8", 8, "^--atp-mesh 0,8: both mesh axes must be >= 1"),
    ("megatron", "2,4", 8, "^--atp-mesh needs --tp-backend atp$"),
    ("3d", "2,4", 8, "^--atp-mesh needs --tp-backend atp$"),
    ("3d", None, 4, "^--tp-backend 3d: 3-D tensor parallelism needs --tensor-model-parallel-size = p\\^3")])
def test_each_record_refuses_what_it_cannot_run_in_the_trainers_words(name, text, tp, words):
    with pytest.raises(ModelingError, match=words):
        BACKENDS[name].parse_layout(text, tp)


def test_a_record_refuses_another_records_layout():
    assert BACKENDS["megatron"].layout_refusal(Layout(d1=2, d2=4), 8)
    assert BACKENDS["3d"].layout_refusal(Layout(a=2, b=2, c=2), 8)
    assert BACKENDS["atp"].layout_refusal(Layout(x=2, y=4), 8).startswith("--atp-mesh must be two sizes")


def _plan(tmp_path, argv):
    from megatron_oases.plan.plan_cli import build_parser, make_plan
    from megatron_oases.plan.plan_file import write_plan

    out = tmp_path / "plan.json"
    a = build_parser().parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
                                   "--seq-length", "16", "--micro-batch-size", "4", "--vocab-size", "128",
                                   "--global-batch-size", "8", "--topology", "dgx-a100", "--sub-batches", "1",
                                   "--out", str(out), *argv])
    data = make_plan(a)[0]
    write_plan(out, data)
    return out, json.loads(out.read_text())


@pytest.mark.parametrize("argv, flags", [
    (["--tensor-model-parallel-size", "8", "--families", "atp", "--degrees", "8"],
     {"--tp-backend": "atp", "--atp-mesh": None}),
    (["--tensor-model-parallel-size", "8", "--families", "3d"], {"--tp-backend": "3d"})])
def test_a_plan_file_written_before_layouts_were_stored_still_launches_the_same_run(tmp_path, argv, flags):
    """Yesterday's file has no ``layouts``: ATP's mesh is only the 2-tuple in its label
    (``atp4x2``), the cube its TP size (``3d8``); both read back to the flags today's file gives."""
    from megatron_oases.plan.plan_file import plan_launch_flags, whole_model_backend

    out, today = _plan(tmp_path, argv)
    stored = next(iter(today["layouts"].values()))
    assert Layout.from_json(stored["layout"]) in BACKENDS[stored["tp_backend"]].layouts(8)
    yesterday = {k: v for k, v in today.items() if k != "layouts"}
    assert whole_model_backend(yesterday) == whole_model_backend(today)
    assert plan_launch_flags(yesterday, str(out)) == plan_launch_flags(today, str(out))
    got = whole_model_backend(yesterday)
    assert got["--tp-backend"] == flags["--tp-backend"] and set(got) == set(flags)


def test_a_plan_files_stored_layout_is_what_launches(tmp_path):
    """The stored layout, not the label, is read when present: the run is the one the file says."""
    from megatron_oases.plan.plan_file import whole_model_backend

    _, data = _plan(tmp_path, ["--tensor-model-parallel-size", "8", "--families", "atp"])
    label = data["strategies"][0]
    flags = whole_model_backend(data)
    d1, d2 = map(int, flags["--atp-mesh"].split(","))
    assert data["layouts"][label]["layout"] == {"d1": d1, "d2": d2}
    broken = dict(data, layouts={label: {"tp_backend": "atp", "layout": "2,4"}})
    from megatron_oases.errors import ConfigError

    with pytest.raises(ConfigError, match=f"plan strategy '{label}': a layout is a JSON object"):
        whole_model_backend(broken)
