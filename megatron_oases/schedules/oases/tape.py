"""A TP layer as the executor runs it: local steps on named tensors, separated by collectives.

This is the runtime face of ``layers/description.py``: the same segments and collectives (a test
checks that the names and passes agree), but as callables on a real Megatron-Core layer. Each
``Local`` is pure local compute (its TP collectives switched off); the executor launches every
collective itself, async, so it can switch to the other sub-batch meanwhile.

Megatron 1-D TP layer (local spec)::

    ln1          x                -> ln1            input_layernorm
    f            grad(ln1) all-reduced in backward  (ColumnParallelLinear's f)
    attention    ln1              -> attn_p         QKV, core attention, proj without reduce
    g            attn_p all-reduced -> attn_sum     (RowParallelLinear's g; identity backward)
    bda_ln2      attn_sum, x      -> h1, ln2        proj bias + dropout + residual, pre-MLP norm
    f            grad(ln2) all-reduced in backward
    mlp          ln2              -> mlp_p          fc1, activation, fc2 without reduce
    g            mlp_p all-reduced -> mlp_sum
    bda          mlp_sum, h1      -> y              fc2 bias + dropout + residual
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Union

import torch

from megatron_oases.schedules.oases.dropout import SubBatchDropout, dropout


@dataclasses.dataclass(frozen=True)
class Local:
    """Local compute: ``fn(tensors, attention_mask) -> {name: tensor}``."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn: Callable


@dataclasses.dataclass(frozen=True)
class ForwardAllReduce:
    """``dst = all_reduce(src)`` in forward; in backward grad(src) = grad(dst) (Oases Eq. 1)."""

    name: str
    src: str
    dst: str


@dataclasses.dataclass(frozen=True)
class BackwardAllReduce:
    """Identity in forward; the gradient of ``tensor`` is all-reduced in backward."""

    name: str
    tensor: str


Step = Union[Local, ForwardAllReduce, BackwardAllReduce]


@dataclasses.dataclass(frozen=True)
class LayerTape:
    steps: tuple[Step, ...]
    group: object
    """The process group every collective of this layer runs on."""
    params: tuple[torch.nn.Parameter, ...]
    collectives_off: Callable[[], contextlib.AbstractContextManager]
    """Context in which the layer's linears issue no collective."""
    input: str = "x"
    output: str = "y"

    def saved_boundaries(self, fine_grained: bool) -> tuple[str, ...]:
        """Tensors the forward keeps per layer for recompute: the input, and with fine-grained
        recompute the output of every forward collective (recompute starts after it)."""
        outs = tuple(s.dst for s in self.steps if isinstance(s, ForwardAllReduce))
        return (self.input,) + (outs if fine_grained else ())


class UnsupportedLayer(ValueError):
    """The layer's structure is not one the Oases executor can split into segments."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise UnsupportedLayer(f"--schedule oases: {what}")


def megatron_layer_tape(layer, index: int) -> LayerTape:
    """The tape of a Megatron-Core ``TransformerLayer`` built from the local (or TE-free) spec."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP

    attn, mlp = layer.self_attention, layer.mlp
    _require(isinstance(attn, SelfAttention), f"layer {index}: self_attention must be SelfAttention")
    _require(isinstance(mlp, MLP), f"layer {index}: the MLP must be Megatron's dense MLP (no MoE)")
    _require(isinstance(layer.cross_attention, IdentityOp), "cross-attention is not supported")
    linears = (attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2)
    _require(all(isinstance(m, ColumnParallelLinear) for m in linears[0::2])
             and all(isinstance(m, RowParallelLinear) for m in linears[1::2]),
             "the linears must be Megatron's Column/RowParallelLinear (local spec; TE layers "
             "fuse their own collectives)")
    _require(attn.linear_proj.skip_bias_add and mlp.linear_fc2.skip_bias_add,
             "row-parallel linears must return their bias (skip_bias_add)")
    _require(not layer.config.sequence_parallel, "sequence parallelism is not supported")
    core = attn.core_attention
    if isinstance(getattr(core, "attention_dropout", None), torch.nn.Dropout):
        core.attention_dropout = SubBatchDropout(core.attention_dropout.p, (index, "attention"))

    p = layer.hidden_dropout
    proj_bias, fc2_bias = attn.linear_proj.bias, mlp.linear_fc2.bias

    def bda(x, bias, residual, site):
        """Megatron's unfused bias-dropout-add with the micro-batch's dropout mask."""
        if bias is not None:
            x = x + bias
        return residual + dropout(x, p, layer.training, (index, site), batch_dim=1)

    def ln1(t, mask):
        return {"ln1": layer.input_layernorm(t["x"])}

    def attention(t, mask):
        return {"attn_p": attn(t["ln1"], attention_mask=mask)[0]}

    def bda_ln2(t, mask):
        h1 = bda(t["attn_sum"], proj_bias, t["x"], "attention_bda")
        return {"h1": h1, "ln2": layer.pre_mlp_layernorm(h1)}

    def mlp_fn(t, mask):
        return {"mlp_p": mlp(t["ln2"])[0]}

    def bda_out(t, mask):
        return {"y": bda(t["mlp_sum"], fc2_bias, t["h1"], "mlp_bda")}

    steps = (
        Local("ln1", ("x",), ("ln1",), ln1),
        BackwardAllReduce("attention.f.bwd", "ln1"),
        Local("attention", ("ln1",), ("attn_p",), attention),
        ForwardAllReduce("attention.g", "attn_p", "attn_sum"),
        Local("bda_ln2", ("attn_sum", "x"), ("h1", "ln2"), bda_ln2),
        BackwardAllReduce("mlp.f.bwd", "ln2"),
        Local("mlp", ("ln2",), ("mlp_p",), mlp_fn),
        ForwardAllReduce("mlp.g", "mlp_p", "mlp_sum"),
        Local("bda", ("mlp_sum", "h1"), ("y",), bda_out),
    )

    @contextlib.contextmanager
    def collectives_off():
        # explicit_expert_comm is Megatron's own switch for "the caller communicates": the
        # column linear then skips its dgrad all-reduce and the row linear its output reduce.
        saved = [m.explicit_expert_comm for m in linears]
        for m in linears:
            m.explicit_expert_comm = True
        try:
            yield
        finally:
            for m, s in zip(linears, saved):
                m.explicit_expert_comm = s

    params = tuple(prm for prm in layer.parameters() if prm.requires_grad)
    return LayerTape(steps=steps, group=attn.linear_proj.tp_group, params=params,
                     collectives_off=collectives_off)
