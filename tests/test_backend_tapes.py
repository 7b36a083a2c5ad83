"""The Oases tape is looked up by the layer's TP backend (``schedules/oases/backend_tapes.py``)."""
import pytest

from megatron_oases.describe.backends import BACKENDS, resolve
from megatron_oases.schedules.oases.backend_tapes import layer_backend, layer_tape
from megatron_oases.schedules.oases.tape import UnsupportedLayer, megatron_layer_tape


def test_the_records_name_tape_builders_that_exist():
    """Each record's ``oases_tape`` (which the simulator, the planner and the trainer's validation
    read as "the Oases executor runs it") resolves to the runtime's builder."""
    from megatron_oases.schedules.oases.atp_tape import atp_layer_tape

    tapes = {name: resolve(b.oases_tape) for name, b in BACKENDS.items() if b.oases_tape}
    assert tapes == {"megatron": megatron_layer_tape, "atp": atp_layer_tape}


def test_a_layer_without_a_backend_name_is_megatrons():
    assert layer_backend(object()) == "megatron"


def test_a_backend_without_a_tape_is_refused_by_name():
    class CubeLayer:
        tp_backend = "3d"

    with pytest.raises(UnsupportedLayer, match=r"^--schedule oases: layer 3: --tp-backend 3d has no "
                                               r"tape .*; tapes exist for megatron, atp$"):
        layer_tape(CubeLayer(), 3)
