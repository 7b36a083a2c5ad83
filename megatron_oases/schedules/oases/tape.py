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

ATP layers (``layers/atp_spec.py``) get ``atp_layer_tape``: every collective runs on its own
mesh-axis group, the head split / gather are all-gather steps, and the norms' statistic sums are
steps too, so fine-grained recompute replays an ATP layer without any collective.
``layer_tape`` picks the builder per layer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Union

import torch

from megatron_oases.schedules.oases.dropout import SubBatchDropout, dropout, kernel_rng


@dataclasses.dataclass(frozen=True)
class BlockInputs:
    """What a step reads besides its named tensors: its sub-batch's attention mask and the
    block's batch-independent arguments (rotary embeddings ``[s, 1, 1, d]``, the same for every
    sub-batch and for recompute)."""

    attention_mask: object = None
    rotary_pos_emb: object = None


@dataclasses.dataclass(frozen=True)
class Local:
    """Local compute: ``fn(tensors, inputs: BlockInputs) -> {name: tensor}``."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn: Callable


@dataclasses.dataclass(frozen=True)
class ForwardAllReduce:
    """``dst = all_reduce(src)`` in forward; in backward grad(src) = grad(dst) (Oases Eq. 1).

    ``group``: None runs it on the tape's group. ``reduce_grad``: the backward all-reduces the
    gradient too (a statistic every rank's output depends on, as ATP's norm sums)."""

    name: str
    src: str
    dst: str
    group: object = None
    reduce_grad: bool = False


@dataclasses.dataclass(frozen=True)
class BackwardAllReduce:
    """Identity in forward; the gradient of ``tensor`` is all-reduced in backward.

    ``tensor`` must be the input of a linear only, so its gradient is a fresh tensor the
    executor may reduce in place."""

    name: str
    tensor: str
    group: object = None


@dataclasses.dataclass(frozen=True)
class ForwardAllGather:
    """``dst`` = all-gather of ``src`` along ``dim`` over ``group``; backward keeps this rank's
    chunk of grad(dst) (the gathered tensor's consumers are replicated on ``group``)."""

    name: str
    src: str
    dst: str
    dim: int
    group: object


@dataclasses.dataclass(frozen=True)
class BackwardAllGather:
    """``dst`` = this rank's chunk of ``src`` along ``dim`` (``src`` replicated on ``group``);
    backward all-gathers grad(dst) into grad(src)."""

    name: str
    src: str
    dst: str
    dim: int
    group: object


@dataclasses.dataclass(frozen=True)
class GatherSequence:
    """Sequence parallelism's entry to a column-parallel linear: ``dst`` = all-gather of ``src``
    along ``dim`` (the sequence); backward reduce-scatters grad(dst) into grad(src), since the
    linear's input gradient is partial per rank (Megatron's gather_from_sequence_parallel_region).
    ``group``: None runs it on the tape's group."""

    name: str
    src: str
    dst: str
    dim: int = 0
    group: object = None


@dataclasses.dataclass(frozen=True)
class ReduceScatterSequence:
    """Sequence parallelism's exit from a row-parallel linear: ``dst`` = this rank's sequence
    chunk of the sum of the partial outputs ``src``; backward all-gathers grad(dst) into
    grad(src) (Megatron's reduce_scatter_to_sequence_parallel_region)."""

    name: str
    src: str
    dst: str
    dim: int = 0
    group: object = None


Step = Union[Local, ForwardAllReduce, BackwardAllReduce, ForwardAllGather, BackwardAllGather,
             GatherSequence, ReduceScatterSequence]
FORWARD_COLLECTIVES = (ForwardAllReduce, ForwardAllGather, GatherSequence, ReduceScatterSequence)
"""Steps that communicate in forward: recompute must repeat them unless their output is saved."""


@dataclasses.dataclass(frozen=True)
class LayerTape:
    steps: tuple[Step, ...]
    group: object
    """The process group of every collective step that names none (None: each step names one)."""
    params: tuple[torch.nn.Parameter, ...]
    collectives_off: Callable[[], contextlib.AbstractContextManager]
    """Context in which the layer's linears issue no collective."""
    input: str = "x"
    output: str = "y"

    def group_of(self, step: Step) -> object:
        """The group a collective step runs on: its own, else the tape's."""
        return self.group if getattr(step, "group", None) is None else step.group

    @property
    def recompute_steps(self) -> tuple[Step, ...]:
        """The steps recompute replays: up to the last local one (a trailing forward collective,
        e.g. ATP's gather at a block's end, has a local backward and needs no replay)."""
        last = max(i for i, s in enumerate(self.steps) if isinstance(s, Local))
        return self.steps[:last + 1]

    def saved_boundaries(self, fine_grained: bool) -> tuple[str, ...]:
        """Tensors the forward keeps per layer for recompute: the input, and with fine-grained
        recompute the output of every forward collective recompute would otherwise repeat (for a
        Megatron 1-D layer, ``describe.split.recompute_boundaries`` hidden states)."""
        outs = tuple(s.dst for s in self.recompute_steps if isinstance(s, FORWARD_COLLECTIVES))
        return (self.input,) + (outs if fine_grained else ())


class UnsupportedLayer(ValueError):
    """The layer's structure is not one the Oases executor can split into segments."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise UnsupportedLayer(f"--schedule oases: {what}")


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


def _explicit_comm(linears):
    """Context in which ``linears`` issue no collective. ``explicit_expert_comm`` is Megatron's
    own switch for "the caller communicates": the column linear then skips its dgrad all-reduce
    and the row linear its output reduce."""

    @contextlib.contextmanager
    def collectives_off():
        saved = [m.explicit_expert_comm for m in linears]
        for m in linears:
            m.explicit_expert_comm = True
        try:
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
    sub_batch_attention_dropout(attn.core_attention, index)

    p = layer.hidden_dropout
    proj_bias, fc2_bias = attn.linear_proj.bias, mlp.linear_fc2.bias
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

    def mlp_fn(t, inp):  # Megatron's MLP: GeLU or SwiGLU, with or without bias
        return {"mlp_p": mlp(t["ln2"])[0]}

    def bda_out(t, inp):
        return {"y": bda(t["mlp_sum"], fc2_bias, t["h1"], "mlp_bda")}

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
        enter("mlp", "ln2"),
        Local("mlp", ("ln2",), ("mlp_p",), mlp_fn),
        leave("mlp", "mlp_p", "mlp_sum"),
        Local("bda", ("mlp_sum", "h1"), ("y",), bda_out),
    )
    return steps, linears


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


def layer_tape(layer, index: int) -> LayerTape:
    """The tape of a ``TransformerLayer`` of any supported TP backend (ATP or Megatron 1-D)."""
    from megatron_oases.layers.atp_spec import ATPTransformerLayer

    if isinstance(layer, ATPTransformerLayer):
        return atp_layer_tape(layer, index)
    return megatron_layer_tape(layer, index)


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
    _require(isinstance(attn, ATPSelfAttention) and isinstance(mlp, ATPMLP)
             and isinstance(layer.input_layernorm, ATPNorm)
             and isinstance(layer.pre_mlp_layernorm, ATPNorm),
             f"layer {index}: an ATP layer must use ATPSelfAttention, ATPMLP and ATPNorm")
    _require(isinstance(layer.cross_attention, IdentityOp), "cross-attention is not supported")
    qkv, proj, fc1, fc2 = attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2
    _require(all(m.chunks == 1 for m in (qkv, proj, fc1, fc2)),
             "--atp-chunks > 1 (the ATP linears' own overlap) cannot be combined with it")
    _require(proj.skip_bias_add and fc2.skip_bias_add,
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

    x = "x_s" if layer.atp_enter else "x"
    y = "y_s" if layer.atp_leave else "y"
    steps = [BackwardAllGather("enter", "x", "x_s", -1, axis2)] if layer.atp_enter else []
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
    if layer.atp_leave:
        steps.append(ForwardAllGather("leave", "y_s", "y", -1, axis2))
    params = tuple(prm for prm in layer.parameters() if prm.requires_grad)
    return LayerTape(steps=tuple(steps), group=None, params=params,
                     collectives_off=contextlib.nullcontext)
