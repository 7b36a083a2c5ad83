"""One layer's sizes and options, as every backend's description reads them.

``registry.layer_description`` builds one and hands it to the backend's record
(``backends.Backend.layer``); each backend takes the fields its layer depends on."""
from __future__ import annotations

import dataclasses

from .layout import Layout
from .ops import GPT2, LayerVariant


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerQuery:
    """What to describe: the (sub-)batch, the model's sizes, the TP degree and the backend's layout
    (``describe.layout``), and the options only some backends describe
    (``registry.layer_description`` names which)."""

    layout: Layout | None
    micro_batch: int
    seq: int
    hidden: int
    heads: int
    ffn: int
    tp: int
    bytes_per_element: int
    variant: LayerVariant = GPT2
    sequence_parallel: bool = False
    schedule: str = "stock"
    attention_dropout: bool = False
    hidden_dropout: bool = False
    recompute_core_attention: bool = False
    core_attention: str = "local"
