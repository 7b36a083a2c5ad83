"""The Oases tape of an ATP layer (``layers/atp_spec.py``): ``atp_layer_tape``.

Every collective runs on its own mesh-axis group, the head split / gather are all-gather steps,
and the norms' statistic sums are steps too, so fine-grained recompute replays an ATP layer
without any collective.
"""
from __future__ import annotations

import contextlib

from megatron_oases.schedules.oases.dropout import dropout
from megatron_oases.schedules.oases.steps import (BackwardAllGather, BackwardAllReduce, ForwardAllGather,
                                                  ForwardAllReduce, LayerTape, Local, require)
from megatron_oases.schedules.oases.tape import sub_batch_attention_dropout


def _atp_norm_steps(prefix: str, norm, src: str, dst: str, group) -> list:
    """``dst = norm(src)`` for an ``ATPNorm``: its local stages, with the axis-2 sums of its
    statistics as collective steps (all-reduced in forward and backward), so fine-grained
    recompute saves the tiny ``[s, b, 1]`` sums and replays the norm without any collective."""
    p1, t1 = f"{prefix}.partial", f"{prefix}.sum"
    steps = [Local(f"{prefix}.stat", (src,), (p1,), lambda t, m: {p1: norm.first_partial(t[src])}),
             ForwardAllReduce(f"{prefix}.stat.sum", p1, t1, group, reduce_grad=True)]
    if norm.kind == "LayerNorm":
        xc, p2, t2 = f"{prefix}.centred", f"{prefix}.partial_sq", f"{prefix}.sum_sq"

        def centre(t, m):
            c, part = norm.centre(t[src], t[t1])
            return {xc: c, p2: part}

        steps += [Local(f"{prefix}.centre", (src, t1), (xc, p2), centre),
                  ForwardAllReduce(f"{prefix}.var.sum", p2, t2, group, reduce_grad=True),
                  Local(f"{prefix}.scale", (src, xc, t2), (dst,),
                        lambda t, m: {dst: norm.normalize(t[src], t[xc], t[t2])})]
    else:
        steps.append(Local(f"{prefix}.scale", (src, t1), (dst,),
                           lambda t, m: {dst: norm.normalize(t[src], t[src].float(), t[t1])}))
    return steps


def atp_layer_tape(layer, index: int) -> LayerTape:
    """The tape of an ``ATPTransformerLayer`` (``layers/atp_spec.py``) on a ``d1 x d2`` mesh.

    The local steps call the ATP modules' own local math (``ATPNorm`` stages, the linears'
    ``partial`` GEMM, ``ATPSelfAttention.core``); every mesh collective is a step, so the
    executor overlaps it with the other sub-batch. Residual stream ``[s, b, h/d2]``::

        enter        x -> x_s          keep own axis-2 chunk (first layer of a block; bwd AG)
        ln1.*        x_s -> ln1        ATPNorm stages, statistic sums on axis 2 (fwd+bwd AR)
        qkv.f.bwd    grad(ln1) all-reduced on axis 1
        qkv          ln1 -> qkv_p      column-first GEMM
        qkv.g        all-reduce on axis 2 (f1) -> qkv_sum, + bias -> qkv
        heads.split  qkv -> qkv_own    own heads (bwd: all-gather on axis 2)
        core         qkv_own -> ctx_own  the core attention (--attention-backend)
        heads.gather ctx_own -> ctx    all-gather on axis 2 (bwd: own chunk)
        proj.f.bwd   grad(ctx) all-reduced on axis 2
        proj         ctx -> proj_p     row-first GEMM; proj.g: all-reduce on axis 1 (f2)
        bda          proj_sum, x_s -> h1   bias + dropout (full-hidden mask, own chunk) + residual
        ln2.*, fc1.f.bwd (axis 1), fc1, fc1.g (axis 2, f3), act, fc2.f.bwd (axis 2), fc2,
        fc2.g (axis 1, f4), bda -> y_s
        leave        y_s -> y          all-gather on axis 2 (last layer of a block; bwd own chunk)
    """
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_oases.layers.atp_attention import ATPSelfAttention
    from megatron_oases.layers.atp_mlp import ATPMLP
    from megatron_oases.layers.atp_norm import ATPNorm

    attn, mlp = layer.self_attention, layer.mlp
    require(isinstance(attn, ATPSelfAttention) and isinstance(mlp, ATPMLP)
             and isinstance(layer.input_layernorm, ATPNorm)
             and isinstance(layer.pre_mlp_layernorm, ATPNorm),
             f"layer {index}: an ATP layer must use ATPSelfAttention, ATPMLP and ATPNorm")
    require(isinstance(layer.cross_attention, IdentityOp), "cross-attention is not supported")
    qkv, proj, fc1, fc2 = attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2
    require(all(m.chunks == 1 for m in (qkv, proj, fc1, fc2)),
             "--atp-chunks > 1 (the ATP linears' own overlap) cannot be combined with it")
    require(proj.skip_bias_add and fc2.skip_bias_add,
             "row-first linears must return their bias (skip_bias_add)")
    mg = layer.mesh_groups
    axis2, d2, j = mg.group(2), mg.mesh.d2, mg.index(2)
    sub_batch_attention_dropout(attn.core_attention, index)
    p = layer.hidden_dropout

    def bda(x, bias, residual, site):
        """ATP's bias-dropout-add: the mask of the full hidden dim, this rank's axis-2 chunk."""
        if bias is not None:
            x = x + bias
        return residual + dropout(x, p, layer.training, (index, site), batch_dim=1,
                                  last_dim_shard=(d2, j))

    def gemm(lin, src, dst):
        return Local(dst, (src,), (dst,), lambda t, m: {dst: lin.partial(t[src])})

    def fwd_reduce(lin, src, dst):  # sum the GEMM's partials over the axis that splits ``in``
        return ForwardAllReduce(f"{dst}.g", src, dst, mg.group(lin.in_axis))

    def bwd_reduce(lin, tensor):  # sum dX over the axis that splits ``out``
        return BackwardAllReduce(f"{tensor}.f.bwd", tensor, mg.group(lin.out_axis))

    x = "x_s" if layer.enters_layout else "x"
    y = "y_s" if layer.leaves_layout else "y"
    # the block edge's one cut (layers/boundary.py): the hidden dim on axis 2, when d2 > 1
    edge = layer.layout.cuts[0] if layer.layout.cuts else None
    steps = [BackwardAllGather("enter", "x", "x_s", *edge)] if layer.enters_layout else []
    steps += _atp_norm_steps("ln1", layer.input_layernorm, x, "ln1", axis2)
    qkv_out = "qkv_sum" if qkv.bias is not None else "qkv"
    steps += [bwd_reduce(qkv, "ln1"), gemm(qkv, "ln1", "qkv_p"), fwd_reduce(qkv, "qkv_p", qkv_out)]
    if qkv.bias is not None:
        steps.append(Local("qkv_bias", ("qkv_sum",), ("qkv",),
                           lambda t, m: {"qkv": t["qkv_sum"] + qkv.bias}))
    steps += [
        BackwardAllGather("heads.split", "qkv", "qkv_own", -1, axis2),
        Local("core", ("qkv_own",), ("ctx_own",),
              lambda t, m: {"ctx_own": attn.core(t["qkv_own"], m.attention_mask, None,
                                                 m.rotary_pos_emb)}),
        ForwardAllGather("heads.gather", "ctx_own", "ctx", -1, axis2),
        bwd_reduce(proj, "ctx"), gemm(proj, "ctx", "proj_p"), fwd_reduce(proj, "proj_p", "proj_sum"),
        Local("attention_bda", ("proj_sum", x), ("h1",),
              lambda t, m: {"h1": bda(t["proj_sum"], proj.bias, t[x], "attention_bda")}),
    ]
    steps += _atp_norm_steps("ln2", layer.pre_mlp_layernorm, "h1", "ln2", axis2)

    def act(t, m):
        h = t["fc1_sum"]
        return {"act": mlp.activate(h + fc1.bias if fc1.bias is not None else h)}

    steps += [
        bwd_reduce(fc1, "ln2"), gemm(fc1, "ln2", "fc1_p"), fwd_reduce(fc1, "fc1_p", "fc1_sum"),
        Local("act", ("fc1_sum",), ("act",), act),
        bwd_reduce(fc2, "act"), gemm(fc2, "act", "fc2_p"), fwd_reduce(fc2, "fc2_p", "fc2_sum"),
        Local("mlp_bda", ("fc2_sum", "h1"), (y,),
              lambda t, m: {y: bda(t["fc2_sum"], fc2.bias, t["h1"], "mlp_bda")}),
    ]
    if layer.leaves_layout:
        steps.append(ForwardAllGather("leave", "y_s", "y", *edge))
    params = tuple(prm for prm in layer.parameters() if prm.requires_grad)
    return LayerTape(steps=tuple(steps), group=None, params=params,
                     collectives_off=contextlib.nullcontext)
