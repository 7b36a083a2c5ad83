"""The GPT model head around the transformer layers: Megatron's vocab-parallel embedding on the
first pipeline stage, the final norm and the vocab-parallel output layer + cross-entropy on the
last. Every backend runs Megatron's own head, at the whole TP group, so one description serves
all of them; the simulator (events, memory) and the planner (memory constant) read it. Under the
Oases schedule (``sub_batches`` > 1) the head's large TP collectives run per sub-batch inside the
executor (``schedules/oases/head_tape.py``), beside the layers' sub-batch chains; its compute and
the loss stay on the whole micro-batch.
"""
from __future__ import annotations

import dataclasses

from .megatron_1d import output_wgrad
from .ops import GPT2, Collective, Compute, LayerVariant, backward_gemms


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadOps:
    """The head's work on one stage, per micro-batch: before / after the layers in forward
    (``pre_forward``, ``post_forward``) and in backward (``pre_backward``: the logits' backward and
    its input-gradient all-reduce, ``post_backward``: the embedding's); ``output_wgrad``: the
    output layer's weight gradient, which Megatron runs beside that all-reduce. The ``split_*``
    fields hold the collectives that run once per sub-batch (one sub-batch's payload) at the
    same places, in the layers' sub-batch chains: empty without the Oases split."""

    pre_forward: tuple = ()
    post_forward: tuple = ()
    pre_backward: tuple = ()
    post_backward: tuple = ()
    output_wgrad: Compute | None = None
    split_pre_forward: tuple = ()
    split_post_forward: tuple = ()
    split_pre_backward: tuple = ()
    split_post_backward: tuple = ()


def head_ops(*, b: int, s: int, h: int, v: int, t: int, e: int, first: bool, last: bool,
             sequence_parallel: bool = False, learned_positions: bool = True,
             sub_batches: int = 1) -> HeadOps:
    """The head's segments and collectives (FLOPs count a multiply-add as 2; ``v`` padded).

    ``sequence_parallel`` (Megatron-Core's ``LanguageModelEmbedding`` and SP output layer): with
    learned positions the embedding all-reduces, then keeps its chunk (backward: all-gather of
    the gradient); without (RoPE) it reduce-scatters instead (backward the same all-gather); the
    output layer all-gathers its input, and in backward re-gathers it for the weight gradient
    and reduce-scatters the input gradient beside it.

    ``sub_batches`` (the Oases split, ``describe.split``): the embedding's collective (forward;
    under SP also its backward all-gather) and the output layer's (its input-gradient
    all-reduce; under SP its input all-gather and its gradient's reduce-scatter, with no
    backward re-gather: the executor keeps the gathered input) move to the ``split_*`` fields,
    per sub-batch."""
    act = b * s * h * e
    if sub_batches > 1 and t > 1:
        return _split_head(head_ops(b=b, s=s, h=h, v=v, t=t, e=e, first=first, last=last,
                                    sequence_parallel=sequence_parallel,
                                    learned_positions=learned_positions), sub_batches)
    if sequence_parallel and t > 1:
        return _sp_head(head_ops(b=b, s=s, h=h, v=v, t=t, e=e, first=first, last=last), act=act, t=t,
                        learned_positions=learned_positions)

    def tp(c: Collective) -> tuple:  # a collective on one rank issues nothing
        return (c,) if t > 1 else ()

    ops: dict = {}
    if first:  # lookup, then the all-reduce of the vocab-parallel partial sums
        ops["pre_forward"] = (Compute(name="embedding", gemm_flops=0.0, elementwise_bytes=3 * act),
                              *tp(Collective(name="embedding.ar", kind="all_reduce", axis="tp",
                                             group_size=t, payload_bytes=act)))
        ops["post_backward"] = (Compute(name="embedding.bwd", gemm_flops=0.0, elementwise_bytes=3 * act),)
    if last:  # final norm, logits, vocab-parallel cross-entropy (3 fp32 reductions per token)
        logits_flops = 2 * b * s * h * v / t
        ce_fwd, ce_bwd = (n * b * s * (v // t) for n in cross_entropy_bytes_per_logit(e))
        ops["post_forward"] = (
            Compute(name="logits", gemm_flops=logits_flops, elementwise_bytes=2 * act + ce_fwd,
                    gemms=((b * s, v // t, h),)),
            *tp(Collective(name="loss.ar", kind="all_reduce", axis="tp", group_size=t,
                           payload_bytes=3 * b * s * 4)))
        ops["pre_backward"] = (
            Compute(name="logits.bwd", gemm_flops=2 * logits_flops, elementwise_bytes=2 * act + ce_bwd,
                    gemms=backward_gemms(((b * s, v // t, h),))),
            *tp(Collective(name="logits.f.bwd", kind="all_reduce", axis="tp", group_size=t,
                           payload_bytes=act)))
        ops["output_wgrad"] = output_wgrad(b=b, s=s, h=h, v=v, t=t, e=e)
    return HeadOps(**ops)


def cross_entropy_bytes_per_logit(e: int) -> tuple[int, int]:
    """HBM bytes Megatron's unfused vocab-parallel cross-entropy moves per logit of the rank's
    vocabulary shard, (forward, backward), for logits of ``e`` bytes. Counted from
    ``megatron.core.tensor_parallel.cross_entropy`` (the same code in Megatron-Core 0.8 and 0.19),
    one kernel per line, none fused: forward ``logits.float()`` (read e, write 4; no copy in
    fp32), ``max`` (read 4), in-place ``-= max`` (4 + 4), in-place ``exp`` (4 + 4), ``sum``
    (read 4), in-place ``div_`` to the softmax it saves (4 + 4); backward ``mul_`` by the
    loss gradient (4 + 4) and autograd's cast of that fp32 gradient back to the logits' dtype
    (read 4, write e; none in fp32). bf16: 38 / 14 bytes, fp32: 32 / 8. The per-token work
    (target gather, log, the label's ``-= 1``) is negligible beside it. Checked against the
    logits events measured on an H100 and an H200 (docs/sim_validation.md, "Cross-entropy")."""
    cast = e + 4 if e != 4 else 0
    return cast + 4 + 8 + 8 + 4 + 8, 8 + (4 + e if e != 4 else 0)


def _sp_head(ops: HeadOps, *, act: int, t: int, learned_positions: bool) -> HeadOps:
    """``ops`` (the head without SP) with sequence parallelism's collectives."""
    def op(name, kind):
        return Collective(name=name, kind=kind, axis="tp", group_size=t, payload_bytes=act)
    out = {}
    if ops.pre_forward:
        emb = ops.pre_forward[0]
        out["pre_forward"] = ((emb, op("embedding.ar", "all_reduce")) if learned_positions
                              else (emb, op("embedding.rs", "reduce_scatter")))
        out["post_backward"] = (op("embedding.scatter.bwd", "all_gather"), *ops.post_backward)
    if ops.post_forward:
        logits, loss = ops.post_forward
        out["post_forward"] = (op("logits.ag", "all_gather"), logits, loss)
        out["pre_backward"] = (op("logits.ag.wgrad", "all_gather"), ops.pre_backward[0],
                               op("logits.ag.bwd", "reduce_scatter"))
    return dataclasses.replace(ops, **out)


_WHOLE = ("loss.ar",)
"""The head's collectives that stay on the whole micro-batch under the Oases split."""
_DROPPED = ("logits.ag.wgrad",)
"""... and the one the executor does not issue (it keeps the output layer's gathered input)."""


def _split_head(ops: HeadOps, n: int) -> HeadOps:
    """``ops`` (the stock head) with its TP collectives per sub-batch (``n`` of them)."""
    def compute(seq):
        return tuple(o for o in seq if not isinstance(o, Collective) or o.name in _WHOLE)

    def per_sub(seq):
        return tuple(dataclasses.replace(o, payload_bytes=o.payload_bytes // n) for o in seq
                     if isinstance(o, Collective) and o.name not in _WHOLE + _DROPPED)

    return dataclasses.replace(
        ops, pre_forward=compute(ops.pre_forward), post_forward=compute(ops.post_forward),
        pre_backward=compute(ops.pre_backward), post_backward=compute(ops.post_backward),
        split_pre_forward=per_sub(ops.pre_forward), split_post_forward=per_sub(ops.post_forward),
        split_pre_backward=per_sub(ops.pre_backward), split_post_backward=per_sub(ops.post_backward))


def head_param_tensors(*, v: int, h: int, seq: int, t: int, first: bool, last: bool,
                       output_copy: bool, variant: LayerVariant = GPT2) -> tuple[int, ...]:
    """Parameter tensors of the head on one rank: the word embedding (and learned positions, none
    under RoPE) on the first stage; the final norm (weight, and bias for LayerNorm) and, where
    ``output_copy`` (untied, or tied across pipeline stages), the output layer on the last."""
    emb = v * h // t
    out: tuple[int, ...] = ()
    if first:
        positions = variant.position_params(seq, h)
        out += (emb, positions) if positions else (emb,)
    if last:
        out += (h, h) if variant.normalization == "LayerNorm" else (h,)
        if output_copy:
            out += (emb,)
    return out


def head_saved_bytes(*, b: int, s: int, h: int, v: int, t: int, e: int, first: bool, last: bool,
                     hidden_dropout: bool) -> float:
    """What the head keeps for backward per micro-batch: the embedding's dropout mask (1 byte a
    value, CUDA) on the first stage; the logits (e bytes) and the fp32 softmax of the
    vocab-parallel loss on the last."""
    kept = b * s * h if first and hidden_dropout else 0
    if last:
        kept += b * s * (v // t) * (e + 4)
    return kept
