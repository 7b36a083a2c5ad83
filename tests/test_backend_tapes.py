"""The Oases tape is looked up by the layer's TP backend (``schedules/oases/backend_tapes.py``)."""
import pytest

from megatron_oases.schedules.oases.backend_tapes import TAPES, layer_backend, layer_tape
from megatron_oases.schedules.oases.tape import UnsupportedLayer, megatron_layer_tape
from megatron_oases.train_args import build_parser


def test_tapes_are_keyed_by_the_trainers_backend_names():
    choices = next(a.choices for a in build_parser()._actions if a.dest == "tp_backend")
    assert set(TAPES) <= set(choices)
    assert TAPES["megatron"] is megatron_layer_tape


def test_the_backends_with_a_tape_are_the_records_that_say_so():
    """The runtime's tapes and ``describe.backends``' ``oases_tape`` (which the simulator, the
    planner and the trainer's validation read) name the same backends."""
    from megatron_oases.describe.backends import BACKENDS

    assert set(TAPES) == {name for name, b in BACKENDS.items() if b.oases_tape}


def test_a_layer_without_a_backend_name_is_megatrons():
    assert layer_backend(object()) == "megatron"


def test_a_backend_without_a_tape_is_refused_by_name():
    class CubeLayer:
        tp_backend = "3d"

    with pytest.raises(UnsupportedLayer, match=r"^--schedule oases: layer 3: --tp-backend 3d has no "
                                               r"tape .*; tapes exist for megatron, atp$"):
        layer_tape(CubeLayer(), 3)
