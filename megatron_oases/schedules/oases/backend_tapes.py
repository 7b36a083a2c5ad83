"""Which tape builder describes a layer, looked up by the layer's TP backend (``--tp-backend``).

Layers that convert Megatron's layout at their block's edges (``layers/boundary.py``) name their
backend in ``tp_backend``; Megatron-Core's own ``TransformerLayer`` (and the planned layer, which
is one on TP sub-groups) has none and is ``"megatron"``. The backend's record
(``describe.backends``) names its tape builder (``Backend.oases_tape``); a backend whose layers
are not described as steps names none and is refused with the backends that have one.
"""
from __future__ import annotations

from megatron_oases.describe.backends import BACKENDS, backend, resolve
from megatron_oases.schedules.oases.steps import LayerTape, UnsupportedLayer


def layer_backend(layer) -> str:
    """The TP backend ``layer`` belongs to (``"megatron"`` for Megatron-Core's layers)."""
    return getattr(layer, "tp_backend", "megatron")


def layer_tape(layer, index: int) -> LayerTape:
    """The tape of layer ``index`` of a block, built by its backend record's ``oases_tape``; a
    Megatron layer whose MLP is an ``MoELayer`` by ``moe_tape.moe_layer_tape``."""
    from megatron_oases.schedules.oases.moe_tape import is_moe_layer, moe_layer_tape

    name = layer_backend(layer)
    if name == "megatron" and is_moe_layer(layer):
        return moe_layer_tape(layer, index)
    ref = backend(name).oases_tape
    if ref is None:
        taped = ", ".join(n for n, b in BACKENDS.items() if b.oases_tape)
        raise UnsupportedLayer(f"--schedule oases: layer {index}: --tp-backend {name} has no "
                               f"tape (its layers are not described as steps); tapes exist for {taped}")
    return resolve(ref)(layer, index)
