"""Which tape builder describes a layer, looked up by the layer's TP backend (``--tp-backend``).

Layers that convert Megatron's layout at their block's edges (``layers/boundary.py``) name their
backend in ``tp_backend``; Megatron-Core's own ``TransformerLayer`` (and the planned layer, which
is one on TP sub-groups) has none and is ``"megatron"``. A backend whose layers are not described
as steps has no row and is refused with the backends that have one.
"""
from __future__ import annotations

from megatron_oases.schedules.oases.atp_tape import atp_layer_tape
from megatron_oases.schedules.oases.tape import LayerTape, UnsupportedLayer, megatron_layer_tape

TAPES = {"megatron": megatron_layer_tape, "atp": atp_layer_tape}
"""``--tp-backend`` name -> builder of the tape of one of its layers."""


def layer_backend(layer) -> str:
    """The TP backend ``layer`` belongs to (``"megatron"`` for Megatron-Core's layers)."""
    return getattr(layer, "tp_backend", "megatron")


def layer_tape(layer, index: int) -> LayerTape:
    """The tape of layer ``index`` of a block, built by its backend's row of ``TAPES``."""
    backend = layer_backend(layer)
    build = TAPES.get(backend)
    if build is None:
        raise UnsupportedLayer(f"--schedule oases: layer {index}: --tp-backend {backend} has no "
                               f"tape (its layers are not described as steps); tapes exist for "
                               f"{', '.join(TAPES)}")
    return build(layer, index)
