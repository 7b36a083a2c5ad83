"""The key that names a layer's events in profiles (simulator and planner alike)."""
from __future__ import annotations

from typing import Union

from .backends import backend as record
from .core_attention import attention_kernels_refusal
from .layout import Layout
from .ops import GPT2, LayerVariant


def attention_tag(core_attention: str, kernels: str = "auto") -> tuple[str, tuple[tuple[str, str], ...]]:
    """Key suffix and dims naming the layer's core attention (``describe.core_attention``): an
    SDPA kernel (``fused``, ``unfused``) costs other times than Megatron's local
    ``DotProductAttention``, and a fused one restricted to flash or to cuDNN / memory-efficient
    kernels (``kernels``, ``SDPA_CHOICES``) other times than torch's choice, so their events must
    never share a key (a profile measured with one must not price a run with the other). Megatron's
    local attention keeps no tag, and torch's choice no kernel tag: profiles taken before the kind
    (or the kernels) were named were timings of those, and their keys keep meaning that."""
    if attention_kernels_refusal(core_attention, kernels):
        raise ValueError(attention_kernels_refusal(core_attention, kernels))
    if core_attention == "local":
        return "", ()
    if kernels != "auto":
        return f"_{core_attention}attn_{kernels}", (("attn", core_attention), ("sdpa", kernels))
    return f"_{core_attention}attn", (("attn", core_attention),)


def layer_event_tag(hidden_dropout: float, attention_dropout: float, chains: int, backend: str = "megatron"
                    ) -> tuple[str, tuple[tuple[str, Union[int, str, float]], ...]]:
    """Key suffix and dims a Megatron 1-D layer event's work also depends on (the profiler runs
    it on a real layer, ``sim.calibrate.layer_workloads``): the dropout rates, and the executor as the trainer's ``--schedule`` names it (``oases``:
    a sub-batch through the Oases executor; ``default``: Megatron's forward / backward; the keys keep
    their text, only ``_oases`` names it). Other
    backends' events (``Backend.real_layer_events`` False) run synthetic ops that depend on
    neither: no tag. The planner tags its events with this function too."""
    if not record(backend).real_layer_events:
        return "", ()
    drop = f"_hd{hidden_dropout:g}ad{attention_dropout:g}" if hidden_dropout or attention_dropout else ""
    executor = "oases" if chains > 1 else "default"
    return (drop + ("_oases" if chains > 1 else ""),
            (("hd", float(hidden_dropout)), ("ad", float(attention_dropout)), ("exec", executor)))


def layer_shape(*, b: int, s: int, h: int, a: int, f: int, t: int, v: int, dtype: str, backend: str,
                layout: Layout | None, hidden_dropout: float, attention_dropout: float,
                chains: int, variant: LayerVariant = GPT2, sequence_parallel: bool = False,
                core_attention: str = "local", attention_kernels: str = "auto"
                ) -> tuple[str, tuple[tuple[str, Union[int, str, float]], ...]]:
    """(shape, dims) naming one layer's events in profiles, the one spelling of the simulator and
    the planner: ``b`` samples per (sub-)batch, model sizes, TP degree, the backend's layout tag
    and dims (``Backend.event_tag``, ``Backend.dims``: the ATP mesh, the cube),
    dtype, and ``layer_event_tag``'s dropout and executor; ``dims`` are the same sizes as data.
    Sequence parallelism (norms and residual work on s/t tokens) adds ``_sp`` and ``("sp", 1)``;
    an SDPA core attention (``core_attention`` fused or unfused, every backend: the ATP and 3-D
    layers take it too) ``attention_tag``'s suffix and ``("attn", kind)`` (and its kernels,
    ``attention_kernels``, where not torch's choice); other layers keep their keys."""
    mesh_tag = record(backend).event_tag(layout)  # the ATP mesh or the cube
    tag, tag_dims = layer_event_tag(hidden_dropout, attention_dropout, chains, backend)
    dims = (("b", b), ("s", s), ("h", h), ("a", a), ("f", f), ("t", t), *record(backend).dims(t, layout),
            ("v", v), ("dtype", dtype)) + tag_dims
    if not variant.is_default:  # GPT-2's layer keeps its keys and dims
        dims += (("groups", variant.query_groups or a), ("gated", int(variant.gated)),
                 ("norm", variant.normalization), ("bias", int(variant.bias)))
        if variant.rotary or variant.qk_norm:  # earlier Llama profiles keep their dims
            dims += (("rope", variant.rotary_percent if variant.rotary else 0.0), ("qkn", int(variant.qk_norm)))
    attn_tag, attn_dims = attention_tag(core_attention, attention_kernels)
    sp = sequence_parallel and t > 1
    dims += attn_dims + ((("sp", 1),) if sp else ())
    return f"b{b}s{s}h{h}a{a}f{f}t{t}{mesh_tag}_{dtype}{variant.key()}{tag}{attn_tag}{'_sp' if sp else ''}", dims
