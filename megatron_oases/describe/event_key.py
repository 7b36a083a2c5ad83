"""The key that names a layer's events in profiles (simulator and planner alike)."""
from __future__ import annotations

from typing import Union


def layer_event_tag(hidden_dropout: float, attention_dropout: float, chains: int, backend: str = "megatron"
                    ) -> tuple[str, tuple[tuple[str, Union[int, str, float]], ...]]:
    """Key suffix and dims a Megatron 1-D layer event's work also depends on (the profiler runs
    it on a real layer, ``sim.layer_workloads``): the dropout rates, and the executor (``oases``:
    a sub-batch through the Oases executor; ``stock``: Megatron's forward / backward). Other
    backends' events run synthetic ops that depend on neither: no tag. The planner tags its
    events with this function too."""
    if backend != "megatron":
        return "", ()
    drop = f"_hd{hidden_dropout:g}ad{attention_dropout:g}" if hidden_dropout or attention_dropout else ""
    executor = "oases" if chains > 1 else "stock"
    return (drop + ("_oases" if chains > 1 else ""),
            (("hd", float(hidden_dropout)), ("ad", float(attention_dropout)), ("exec", executor)))
