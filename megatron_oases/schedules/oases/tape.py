"""A TP layer as the executor runs it: local steps on named tensors, separated by collectives.

This is the runtime face of ``describe/megatron_1d.py``: the same segments and collectives (a test
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

With ``--sequence-parallel`` the residual stream ``x, h1, y`` is this rank's sequence chunk
``[s/t, b, h]``; each f becomes ``GatherSequence`` (the norm's chunk ``ln1_s`` all-gathered into
``ln1``; backward reduce-scatter) and each g ``ReduceScatterSequence`` (``attn_p`` reduce-scattered
into ``attn_sum``; backward all-gather), as Megatron's column / row linears do inside.

ATP layers have their own tape (``atp_tape.py``); ``backend_tapes.layer_tape`` picks the builder
by the layer's TP backend.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import torch

from megatron_oases.schedules.oases.dropout import SubBatchDropout, dropout, kernel_rng
from megatron_oases.schedules.oases.steps import (BackwardAllReduce, ForwardAllReduce, GatherSequence, LayerTape,
                                                  Local, ReduceScatterSequence, Step, UnsupportedLayer, require)
from megatron_oases.schedules.oases.steps import BlockInputs  # noqa: F401 - sim.calibrate and tests import it here


def megatron_layer_tape(layer, index: int) -> LayerTape:
    """The tape of a Megatron-Core ``TransformerLayer`` built from the local (or TE-free) spec."""
    steps, linears = _megatron_steps(layer, index, split=False)
    return LayerTape(steps=steps, group=linears[1].tp_group, params=_trainable(layer.parameters()),
                     collectives_off=_explicit_comm(linears))


def megatron_block_tapes(layer, index: int) -> tuple[LayerTape, LayerTape]:
    """A Megatron layer as two tapes, attention block ``x -> h1`` and MLP block ``h1 -> y``
    (pre-MLP norm + MLP), each on its own linears' TP group: for a planned layer whose blocks run
    at different TP degrees, so the executor can reshard ``h1`` between them."""
    from megatron_oases.layers.planned_layer import MLP_BLOCK_PREFIXES

    steps, (qkv, proj, fc1, fc2) = _megatron_steps(layer, index, split=True)
    cut = next(i for i, s in enumerate(steps) if s.name == "attention_bda") + 1
    named = list(layer.named_parameters())
    mlp_params = _trainable(p for n, p in named if n.startswith(MLP_BLOCK_PREFIXES))
    attn_params = _trainable(p for n, p in named if not n.startswith(MLP_BLOCK_PREFIXES))
    return (LayerTape(steps=steps[:cut], group=proj.tp_group, params=attn_params,
                      collectives_off=_explicit_comm((qkv, proj)), input="x", output="h1"),
            LayerTape(steps=steps[cut:], group=fc2.tp_group, params=mlp_params,
                      collectives_off=_explicit_comm((fc1, fc2)), input="h1", output="y"))


def _trainable(params) -> tuple[torch.nn.Parameter, ...]:
    return tuple(p for p in params if p.requires_grad)


def _explicit_comm(linears, weights=None):
    """Context in which ``linears`` issue no collective. ``explicit_expert_comm`` is Megatron's
    own switch for "the caller communicates": the column linear then skips its dgrad all-reduce
    and the row linear its output reduce. Their weight gradients accumulate into ``main_grad``
    inside the GEMM meanwhile (``wgrad.accumulate_in_gemm``; ``weights``: each linear's weight
    getter, default its own)."""
    from megatron_oases.schedules.oases.wgrad import accumulate_in_gemm

    weights = weights or [functools.partial(getattr, m, "weight") for m in linears]

    @contextlib.contextmanager
    def collectives_off():
        saved = [m.explicit_expert_comm for m in linears]
        for m in linears:
            m.explicit_expert_comm = True
        try:
            with accumulate_in_gemm(linears, weights):
                yield
        finally:
            for m, s in zip(linears, saved):
                m.explicit_expert_comm = s

    return collectives_off


def _megatron_steps(layer, index: int, *, split: bool) -> tuple[tuple[Step, ...], tuple]:
    """The steps of a Megatron 1-D layer and its four linears (qkv, proj, fc1, fc2). ``split``:
    the attention block's bias-dropout-add and the pre-MLP norm are separate steps
    (``attention_bda``, ``ln2``), so the tape can be cut between them."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP

    mlp = layer.mlp
    require(isinstance(mlp, MLP), f"layer {index}: the MLP must be Megatron's dense MLP (no MoE)")
    require(isinstance(mlp.linear_fc1, ColumnParallelLinear)
             and isinstance(mlp.linear_fc2, RowParallelLinear),
             "the linears must be Megatron's Column/RowParallelLinear (local spec; TE layers "
             "fuse their own collectives)")
    require(mlp.linear_fc2.skip_bias_add, "row-parallel linears must return their bias (skip_bias_add)")
    part = attention_part(layer, index, split=split)
    fc2_bias = mlp.linear_fc2.bias

    def mlp_fn(t, inp):  # Megatron's MLP: GeLU or SwiGLU, with or without bias
        return {"mlp_p": mlp(t["ln2"])[0]}

    def bda_out(t, inp):
        return {"y": part.bda(t["mlp_sum"], fc2_bias, t["h1"], "mlp_bda")}

    steps = (
        *part.steps,
        part.enter("mlp", "ln2"),
        Local("mlp", ("ln2",), ("mlp_p",), mlp_fn),
        part.leave("mlp", "mlp_p", "mlp_sum"),
        Local("bda", ("mlp_sum", "h1"), ("y",), bda_out),
    )
    return steps, (*part.linears, mlp.linear_fc1, mlp.linear_fc2)


@dataclasses.dataclass(frozen=True)
class AttentionPart:
    """A Megatron layer's steps up to its pre-MLP norm (``x -> h1, ln2``), shared by the dense
    tape and the MoE tape (``moe_tape.py``)."""

    steps: tuple
    linears: tuple
    """(qkv, proj): the linears whose collectives the executor issues."""
    ln2: str
    """The pre-MLP norm's output: ``ln2``, or this rank's sequence chunk ``ln2_s`` under SP."""
    bda: Callable
    """``bda(x, bias, residual, site)``: Megatron's unfused bias-dropout-add with the micro-batch's
    dropout mask."""
    enter: Callable
    """``enter(block, normed)``: Megatron's f before a column-parallel linear."""
    leave: Callable
    """``leave(block, partial, total)``: Megatron's g after a row-parallel linear."""


def attention_part(layer, index: int, *, split: bool) -> AttentionPart:
    """The attention block of a Megatron 1-D layer as steps, then its pre-MLP norm (``split``:
    ``attention_bda`` and ``ln2`` separate, else one ``bda_ln2`` step)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp

    attn = layer.self_attention
    require(isinstance(attn, SelfAttention), f"layer {index}: self_attention must be SelfAttention")
    require(isinstance(layer.cross_attention, IdentityOp), "cross-attention is not supported")
    linears = (attn.linear_qkv, attn.linear_proj)
    require(isinstance(linears[0], ColumnParallelLinear) and isinstance(linears[1], RowParallelLinear),
             "the linears must be Megatron's Column/RowParallelLinear (local spec; TE layers "
             "fuse their own collectives)")
    require(attn.linear_proj.skip_bias_add, "row-parallel linears must return their bias (skip_bias_add)")
    sub_batch_attention_dropout(attn.core_attention, index)

    p = layer.hidden_dropout
    proj_bias = attn.linear_proj.bias
    from megatron_oases.layers.planned_layer import replica_batch_shard

    shards = {"attention_bda": replica_batch_shard(layer, "attention"),
              "mlp_bda": replica_batch_shard(layer, "mlp")}

    def bda(x, bias, residual, site):
        """Megatron's unfused bias-dropout-add with the micro-batch's dropout mask (a planned
        block's replica keeps its slice of the whole batch's mask)."""
        if bias is not None:
            x = x + bias
        return residual + dropout(x, p, layer.training, (index, site), batch_dim=1,
                                  batch_shard=shards[site])

    # Sequence parallelism: the norms run on this rank's sequence chunk (``ln1_s``, ``ln2_s``),
    # gathered before the column linears and reduce-scattered after the row linears.
    sp = layer.config.sequence_parallel
    n1, n2 = ("ln1_s", "ln2_s") if sp else ("ln1", "ln2")

    def enter(block, normed):  # Megatron's f before a column-parallel linear
        if sp:
            return GatherSequence(f"{block}.ag", f"{normed}_s", normed)
        return BackwardAllReduce(f"{block}.f.bwd", normed)

    def leave(block, partial, total):  # Megatron's g after a row-parallel linear
        if sp:
            return ReduceScatterSequence(f"{block}.rs", partial, total)
        return ForwardAllReduce(f"{block}.g", partial, total)

    def ln1(t, inp):
        return {n1: layer.input_layernorm(t["x"])}

    def attention(t, inp):
        # Megatron's own attention: GQA, QK-norm and RoPE (the block's rotary embeddings).
        return {"attn_p": attn(t["ln1"], attention_mask=inp.attention_mask,
                               rotary_pos_emb=inp.rotary_pos_emb)[0]}

    def attention_bda(t, inp):
        return {"h1": bda(t["attn_sum"], proj_bias, t["x"], "attention_bda")}

    def ln2(t, inp):
        return {n2: layer.pre_mlp_layernorm(t["h1"])}

    def bda_ln2(t, inp):
        h1 = attention_bda(t, inp)["h1"]
        return {"h1": h1, n2: layer.pre_mlp_layernorm(h1)}

    if split:
        middle = (Local("attention_bda", ("attn_sum", "x"), ("h1",), attention_bda),
                  Local("ln2", ("h1",), (n2,), ln2))
    else:
        middle = (Local("bda_ln2", ("attn_sum", "x"), ("h1", n2), bda_ln2),)
    steps = (
        Local("ln1", ("x",), (n1,), ln1),
        enter("attention", "ln1"),
        Local("attention", ("ln1",), ("attn_p",), attention),
        leave("attention", "attn_p", "attn_sum"),
        *middle,
    )
    return AttentionPart(steps, linears, n2, bda, enter, leave)


def sub_batch_attention_dropout(core, index: int) -> None:
    """Attention dropout of layer ``index``'s core attention under the executor: Megatron's
    ``DotProductAttention`` (``--attention-backend local``) applies the micro-batch's shared mask
    (``SubBatchDropout``, stock's bits); the SDPA core draws per sub-batch inside its kernel and
    replays each draw in recompute (``kernel_rng``)."""
    site = (index, "attention")
    if isinstance(getattr(core, "attention_dropout", None), torch.nn.Dropout):
        core.attention_dropout = SubBatchDropout(core.attention_dropout.p, site)
    elif hasattr(core, "dropout_rng"):
        core.dropout_rng = functools.partial(kernel_rng, site)
    elif getattr(getattr(core, "config", None), "attention_dropout", 0.0):
        raise UnsupportedLayer(f"layer {index}: attention dropout of {type(core).__name__} cannot "
                               "be replayed in recompute; use --attention-backend local or auto")
