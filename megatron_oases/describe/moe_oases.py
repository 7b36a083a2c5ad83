"""What an MoE layer keeps for its recompute under the Oases executor's fine-grained recompute.

The executor's MoE tape (``schedules/oases/moe_tape.py``) keeps, per sub-batch, its input and the
output of every forward collective step (``LayerTape.saved_boundaries``), so recompute issues no
collective, and the routing metadata its dispatcher computed in forward (recompute reuses it
instead of gathering the counts again). Measured per layer with ``runtime.saved_tensors`` on the
trainer (``tests/test_moe_description.py``'s Oases rows, fp32, TP 1 x EP 2 and TP 2 x EP 2 with
SP, the ranks' mean); the simulator's memory (``sim.core.moe.moe_oases_kept``) and the planner's
MoE block (``plan.moe_blocks.moe_memory``) read :func:`oases_moe_layer_kept_bytes`.
"""
from __future__ import annotations

from .megatron_1d import megatron_1d_gpt_layer
from .moe import MoEShape, moe_layer
from .ops import LayerDescription, LayerVariant
from .saved import redraw_state_bytes
from .split import SUB_BATCHES, sub_batch_sizes

COUNTS = "moe.ag.counts"
"""The token counts' gather: the dispatcher keeps slices of its output, not the output
(:func:`dispatcher_kept_bytes`)."""


def oases_moe_layer_kept_bytes(*, micro_batch: int, seq: int, hidden: int, heads: int, ffn: int, moe: MoEShape,
                               tp: int, ep: int, bytes_per_element: int, variant: LayerVariant,
                               sequence_parallel: bool, hidden_dropout: bool = False,
                               attention_dropout: bool = False, core_attention: str = "local") -> float:
    """Bytes one MoE layer keeps per micro-batch for its recompute under fine-grained recompute:
    per sub-batch (``describe.split``) :func:`oases_recompute_kept_bytes` of the Oases layer
    (``describe.moe.moe_layer(oases=True)``) and :func:`dispatcher_kept_bytes`; per layer the
    dispatcher's two index maps, with the load-balancing loss the micro-batch's counts per expert
    (int64), and with dropout the generator states of its sites (``describe.saved.redraw_state_bytes``:
    the attention block's and the MoE block's hidden dropout, the attention dropout)."""
    sp = sequence_parallel and tp > 1
    sub = sub_batch_sizes(micro_batch)[0]
    e = bytes_per_element
    kw = dict(micro_batch=sub, seq=seq, hidden=hidden, tp=tp, bytes_per_element=e, variant=variant)
    dense = megatron_1d_gpt_layer(heads=heads, ffn=ffn, sequence_parallel=sp, keeps_gathered_input=True, **kw)
    layer = moe_layer(dense, moe=moe, ep=ep, oases=True, **kw)
    tokens = sub * seq // tp  # this rank's tokens of the sub-batch (its sequence chunk under SP)
    per_sub = oases_recompute_kept_bytes(layer, tokens * hidden * e) + dispatcher_kept_bytes(tokens, moe, tp, ep, e)
    index_maps = 2 * 8 * tp * moe.num_experts  # sort / restore by local experts, int64
    states = redraw_state_bytes(("attention", "moe"), hidden_dropout=hidden_dropout,
                                attention_dropout=attention_dropout, core_attention=core_attention)
    return SUB_BATCHES * per_sub + index_maps + (8 * moe.num_experts if moe.aux_loss else 0) + states


def dispatcher_kept_bytes(tokens: int, moe: MoEShape, tp: int, ep: int, e: int) -> float:
    """The alltoall dispatcher's routing metadata one sub-batch keeps from forward to recompute and
    backward: the routing map (a byte a token and expert), the probabilities over all experts
    (``e`` bytes each), the inverse permutation (int64 a routed copy), its local experts' columns
    of the gathered counts (TP x EP x E / EP, int64) and their sum (E / EP); with the load-balancing
    loss the sub-batch's counts per expert (E, int64)."""
    E, local = moe.num_experts, moe.num_experts // ep
    return (tokens * E * (1 + e) + 8 * tokens * moe.topk + 8 * (tp * ep * local + local)
            + (8 * E if moe.aux_loss else 0))


def oases_recompute_kept_bytes(layer: LayerDescription, input_bytes: float) -> float:
    """Bytes a layer keeps between its forward and its recompute under the Oases executor's
    fine-grained recompute, for the sub-batch ``layer`` describes: its input and the output of every
    forward collective (recompute then issues none; ``LayerTape.saved_boundaries``): for an MoE
    layer the dispatch and combine all-to-alls' received copies and probabilities, the experts' TP
    gathers and reduce-scatter, and under SP the attention's gathered input and scattered output
    (the token counts' gather aside: :func:`dispatcher_kept_bytes`)."""
    return input_bytes + sum(c.output_bytes for c in layer.collectives("forward") if c.name != COUNTS)
