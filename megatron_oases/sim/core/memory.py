"""Memory per device: model states + the activations the schedule keeps alive (DistSim's
feasibility check; sizes follow Megatron's mixed-precision DDP + Adam).

* Model states per parameter (``describe.optimizer``, the planner's too): weights (e bytes), fp32
  gradient buffer (4), Adam in fp32 (m, v: 8) plus fp32 master weights when the weights are 2-byte
  (4): 18 bytes with bf16, 16 with fp32. The distributed optimizer shards master weights and
  moments over DP.
* Activations per micro-batch and layer (``describe.registry.layer_activation_bytes``; dropout
  masks only where dropout is on); the Oases schedule without recompute keeps its two step
  boundaries on top (``describe.saved.oases_kept_beyond_stock``); with recompute a recomputed
  layer keeps only its input, or under Oases fine-grained recompute its input plus the two
  forward all-reduce outputs (3 [s, b, h] tensors instead of 1; at TP 1, where an MoE run's
  executor runs one-rank all-reduces, only its input), under Oases with dropout also a generator
  state per dropout site (``describe.saved.redraw_state_bytes``), and a recomputed MoE layer what
  ``describe.moe_oases`` says the executor keeps for the whole layer; while a recomputed layer runs
  its backward, one layer's full activations exist on top (the working set). Under selective
  recompute each layer keeps its inventory without the core attention's s^2 tensors, which one
  layer at a time has again while its backward runs. A fused core attention
  (``GPTShape.core_attention``: ``--use-flash-attn``, ``--attention-backend flash|fused|auto``,
  Transformer Engine) keeps no s x s tensor: the same inventory functions leave those terms out
  (``describe.saved.core_attention_bytes``), so the planner's memory constraint sees the same bytes.
* Under a per-block plan (``--oases-plan``, without recompute) each block keeps its inventory at
  its degree on its replica's share, and under Oases its step boundary
  (``describe.planned.planned_block_saved_bytes``, the planner's too; was: the uniform degree's),
  and under Oases each change of degree the reshard's output (``reshard_saved_bytes``).
* The last stage also keeps the logits (e bytes) and the fp32 softmax of the vocab-parallel loss.
* How many micro-batches are alive comes from the stage's op order (GPipe: all of them; 1F1B:
  ``pp - stage``; interleaved: Megatron's warm-up), walked op by op.
"""
from __future__ import annotations

import dataclasses
import itertools

from ...describe.head import head_saved_bytes
from ...describe.optimizer import state_bytes_per_param
from ...describe.planned import planned_block_saved_bytes, reshard_saved_bytes
from ...describe.registry import layer_activation_bytes, layer_input_bytes
from ...describe.saved import (BLOCKS, checkpoint_rng_state_bytes, layer_saved_bytes, oases_kept_beyond_stock,
                               redraw_state_bytes)
from ...describe.split import recompute_boundaries
from ...describe.shapes import GPTShape
from .events import ChunkEvents, StageEvents, stage_layers
from .moe import layer_expert_params, moe_block_delta, moe_oases_kept, moe_saved_delta
from .strategy import Strategy

GiB = float(1 << 30)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Peak bytes on one device of a stage."""

    stage: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    """Peak activation bytes over the schedule (including the recompute working set)."""
    in_flight: int
    """Most micro-batches (summed over chunks) alive at once."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def model_state_bytes(params: int, model: GPTShape, strategy: Strategy) -> tuple[float, float, float]:
    """(weights, gradient buffer, optimizer states) bytes of ``params`` parameters on one rank
    (``describe.optimizer``, as the planner)."""
    shard = strategy.dp if strategy.distributed_optimizer else 1
    per = state_bytes_per_param(bytes_per_element=model.bytes_per_element,
                                grad_reduce_bytes=model.grad_reduce_bytes, shard=shard)
    return tuple(b * params for b in per)


def chunk_activation_bytes(model: GPTShape, strategy: Strategy, chunk: ChunkEvents) -> tuple[float, float]:
    """(bytes kept per micro-batch in flight, working set while a recomputed layer runs backward)."""
    m, s = model, strategy
    if s.block_degrees is not None and not (s.recompute or s.selective_recompute):
        return _planned_layers_bytes(m, s, chunk) + _head_bytes(m, s, chunk), 0.0
    kw = dict(b=m.micro_batch_size, s=m.seq_length, h=m.hidden_size, e=m.bytes_per_element, layout=s.layout)
    layer_kw = dict(a=m.num_attention_heads, f=m.ffn_hidden_size, t=s.tp, hidden_dropout=m.hidden_dropout > 0,
                    attention_dropout=m.attention_dropout > 0, variant=m.variant,
                    core_attention=m.core_attention, **kw)
    full = layer_activation_bytes(s.backend, **layer_kw)
    if s.selective_recompute:  # a layer keeps no s^2 tensor; one layer's core attention exists at a time
        if s.sequence_parallel:
            full, _, kept = _sp_layer_bytes(m, s)
        else:
            kept = layer_activation_bytes(s.backend, recompute_core_attention=True, **layer_kw)
        return chunk.layers * kept + _head_bytes(m, s, chunk) + _moe_bytes(m, s, chunk, 0), full - kept
    inp = layer_input_bytes(s.backend, t=s.tp, **kw)
    n = chunk.layers
    n_rc = 0 if not s.recompute else min(s.recompute_layers, n) if s.recompute_layers else n
    oases = s.oases_runs
    # Fine-grained recompute keeps the outputs of the layer's TP collectives (describe.split)
    saved = inp * recompute_boundaries(fine_grained=oases and s.fine_grained_recompute, tp=s.tp)
    if oases:  # and the generator states its recompute redraws the dropout masks from (describe.saved)
        saved += redraw_state_bytes(BLOCKS, hidden_dropout=m.hidden_dropout > 0,
                                    attention_dropout=m.attention_dropout > 0, core_attention=m.core_attention)
    else:  # Megatron's checkpoint keeps its snapshot of the generators (describe.saved)
        saved += checkpoint_rng_state_bytes(sequence_parallel=False, attention_dropout=m.attention_dropout > 0,
                                            core_attention=m.core_attention)
    # Without recompute the Oases executor keeps its step boundaries on top of stock's inventory.
    beyond = oases_kept_beyond_stock(inp, s=m.seq_length, h=m.hidden_size, a=m.num_attention_heads,
                                     e=m.bytes_per_element, variant=m.variant, core_attention=m.core_attention,
                                     attention_dropout=m.attention_dropout > 0)
    kept = full + (beyond if oases else 0.0)
    if s.sequence_parallel:
        full, saved, kept = _sp_layer_bytes(m, s)
    per_mb = n_rc * saved + (n - n_rc) * kept + _head_bytes(m, s, chunk)
    if m.moe is not None:  # a recomputed MoE layer's working set is its own inventory
        full += max(0.0, moe_block_delta(m, s))
    kept_rc = moe_oases_kept(m, s) - saved if oases and s.fine_grained_recompute and m.moe is not None else 0.0
    return per_mb + _moe_bytes(m, s, chunk, n_rc, kept_rc), (full if n_rc else 0.0)


def _moe_bytes(m: GPTShape, s: Strategy, chunk: ChunkEvents, recomputed: int, kept_rc: float = 0.0) -> float:
    """What the chunk's MoE layers keep beyond the same layers dense (``sim.core.moe``); a recomputed
    one ``kept_rc`` more (under Oases fine-grained recompute: its own forward collectives' outputs
    in place of the dense layer's)."""
    if m.moe is None:
        return 0.0
    n = chunk.layers
    layers = stage_layers(m, s, chunk.stage)[chunk.chunk * n:(chunk.chunk + 1) * n]
    return moe_saved_delta(m, s, layers, recomputed=recomputed, kept_rc=kept_rc)


def _planned_layers_bytes(m: GPTShape, s: Strategy, chunk: ChunkEvents) -> float:
    """What a chunk's layers keep per micro-batch under a per-block plan (no recompute): each
    block at its degree on its replica's share (``describe.planned.planned_block_saved_bytes``, the
    planner's too), and under Oases each change of degree its reshard's output
    (``describe.planned.reshard_saved_bytes``, from the whole TP group into the chunk's first
    block); the chunk's blocks as ``events`` reads them from the plan."""
    g = chunk.chunk * s.pp + chunk.stage
    degrees = s.block_degrees[2 * g * chunk.layers:2 * (g + 1) * chunk.layers]
    edges = sum(reshard_saved_bytes(a, b, tp=s.tp, micro_batch=m.micro_batch_size, seq=m.seq_length,
                                    hidden=m.hidden_size, bytes_per_element=m.bytes_per_element,
                                    oases=s.oases_runs)
                for a, b in zip((s.tp, *degrees[:-1]), degrees))
    return edges + sum(planned_block_saved_bytes(
        kind, samples=m.micro_batch_size * d // s.tp, degree=d, tp=s.tp, seq=m.seq_length, hidden=m.hidden_size,
        heads=m.num_attention_heads, ffn=m.ffn_hidden_size, bytes_per_element=m.bytes_per_element,
        oases=s.oases_runs, variant=m.variant, hidden_dropout=m.hidden_dropout > 0,
        attention_dropout=m.attention_dropout > 0, core_attention=m.core_attention)
        for kind, d in zip(("attention", "mlp") * chunk.layers, degrees))


def _head_bytes(m: GPTShape, s: Strategy, chunk: ChunkEvents) -> float:
    """What the chunk's part of the head (embedding, output layer and loss) keeps per micro-batch."""
    g = chunk.chunk * s.pp + chunk.stage
    return head_saved_bytes(b=m.micro_batch_size, s=m.seq_length, h=m.hidden_size, v=m.padded_vocab_size, t=s.tp,
                            e=m.bytes_per_element, first=g == 0,
                            last=g == s.pp * s.virtual_stages - 1, hidden_dropout=m.hidden_dropout > 0)


def _sp_layer_bytes(m: GPTShape, s: Strategy) -> tuple[float, float, float]:
    """(stock inventory, kept under recompute, kept without) of one Megatron 1-D layer under
    sequence parallelism (``describe.saved.layer_saved_bytes``, CUDA kernels)."""
    kw = dict(b=m.micro_batch_size, s=m.seq_length, h=m.hidden_size, a=m.num_attention_heads, f=m.ffn_hidden_size,
              t=s.tp, e=m.bytes_per_element,
              hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0,
              variant=m.variant, sequence_parallel=True, core_attention=m.core_attention)
    schedule = "oases" if s.oases_runs else "stock"
    if s.selective_recompute:  # (stock inventory, -, kept with the core attention checkpointed)
        return layer_saved_bytes(**kw), 0.0, layer_saved_bytes(recompute_core_attention=True, **kw)
    return (layer_saved_bytes(**kw), layer_saved_bytes(schedule=schedule, recompute=True,
                                                       fine_grained=s.fine_grained_recompute, **kw),
            layer_saved_bytes(schedule=schedule, **kw))


def stage_memory(model: GPTShape, strategy: Strategy, stage: StageEvents,
                 order: list[tuple[str, int, int]]) -> StageMemory:
    w, g, o = model_state_bytes(stage.params_per_rank, model, strategy)
    if model.moe is not None and strategy.distributed_optimizer:  # experts' states sharded over DP / EP only
        experts = sum(layer_expert_params(model, strategy, x) for x in stage_layers(model, strategy, stage.stage))
        o += experts * (strategy.ep - 1) * model_state_bytes(1, model, strategy)[2]
    per = [chunk_activation_bytes(model, strategy, ch) for ch in stage.chunks]
    # running sums over the order (a forward stores its chunk's activations, a backward frees
    # them): the peak of the bytes held and of the micro-batches in flight; accumulate keeps the
    # loop in C (searches walk thousands of long orders)
    steps = [1 if phase == "F" else -1 for phase, _, _ in order]
    held = [per[c][0] if phase == "F" else -per[c][0] for phase, c, _ in order]
    most = max(0, max(itertools.accumulate(steps), default=0))
    peak = max(0.0, max(itertools.accumulate(held), default=0.0))
    working = max((wk for _, wk in per), default=0.0)
    return StageMemory(stage=stage.stage, weights=w, grads=g, optimizer=o, activations=peak + working,
                       in_flight=most)
