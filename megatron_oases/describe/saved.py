"""What one Megatron 1-D layer keeps for backward, per micro-batch, per schedule and recompute
mode: the inventory of tensors Megatron-Core's local layer (torch norms) saves, counted by
storage, for each core attention (``describe.core_attention``; the first paragraphs are
Megatron's local ``DotProductAttention``, the SDPA ones follow).

Per token, a layer keeps: each norm's input (e h) and statistics (LayerNorm mean and rstd,
RMSNorm rstd; on CPU RMSNorm also its normalised input), the QKV and fc1 inputs (e h each), Q,
K, V and the proj input (4 e h / t), the GeLU and fc2 inputs (2 e f / t); per sample the softmax
output (e a s^2 / t) and a causal mask built per call (s^2 bools, per micro-batch). Dropout,
where on, adds its mask: a hidden one per block (h per token) and the attention one (a s^2 / t
per sample), plus the dropped-out probabilities the attention-over-V GEMM then saves instead of
the softmax output (e a s^2 / t). Megatron runs the softmax in fp32 by default
(``attention_softmax_in_fp32``): with 2-byte elements its output is 4 bytes, and the GEMM keeps
a 2-byte copy. With e = 2, CUDA kernels, dropout on and f = 4h this is Korthikanti et al.
2022's sbh(10 + 24/t) + 5as^2b/t plus what they leave out (norm statistics, the causal mask, the
fp32 softmax output).

What depends on the device's kernels is in ``Kernels``: CUDA's fused dropout keeps a 1-byte
mask and CUDA norms fp32 statistics; CPU dropout keeps its scaled noise, CPU norms their
statistics in the input's dtype, and CPU RMSNorm also its normalised input. The Oases schedule draws its own ``bool`` masks on every device.

Under Megatron's selective recompute (``--recompute-granularity selective``) the checkpointed
core attention keeps none of its s^2 tensors nor the causal mask it builds, only its inputs (Q,
K, V: under GQA QKV's smaller output instead of the heads' copies) and a 4-byte mask-type
tensor (Korthikanti et al.'s sbh(10 + 24/t) then, plus norm statistics).

The Oases schedule without recompute keeps stock's inventory plus one causal mask (and RoPE's
tables) per further sub-batch (its step boundaries are freed where backward does not read them); with recompute, the layer input (and with fine-grained recompute the two
all-reduce outputs) plus, per dropout site, the generator state for the redraw.
Grouped-query attention keeps the same 3 h / t of Q, K, V (the query copy and the keys and
values repeated to their heads replace QKV's smaller output); SwiGLU keeps 5 f / t instead of
GeLU's 2 f / t; linears without bias keep the same.

RoPE, QK-norm and each core attention kernel (local, SDPA fused and math): ``describe.saved_attention``;
the device-dependent sizes: ``describe.saved_kernels``. ``tests/test_saved_bytes_budget.py`` checks
every number against saved-tensor hooks, for each of these kernels.
"""
from __future__ import annotations

import dataclasses

from .core_attention import attention_kernel, draws_in_kernel
from .ops import GPT2, LayerVariant
from .saved_attention import (SELECTIVE_MASK_TYPE_BYTES, checkpoint_inputs_bytes, core_attention_bytes,
                              per_call_bytes, rope_table_bytes)
from .saved_kernels import CPU_KERNELS, CUDA_KERNELS, Kernels, norm_beyond_input  # noqa: F401 (CPU_KERNELS: for callers)
from .split import SUB_BATCHES, oases_splits, recompute_boundaries


BLOCKS = ("attention", "mlp")
SCHEDULES = ("stock", "oases")


def block_saved_bytes(block: str, *, b: int, s: int, h: int, a: int, f: int, t: int, e: int,
                      hidden_dropout: bool = True, attention_dropout: bool = True,
                      softmax_in_fp32: bool = True, kernels: Kernels = CUDA_KERNELS,
                      variant: LayerVariant = GPT2, sequence_parallel: bool = False,
                      gathered_input: bool = False, recompute_core_attention: bool = False,
                      core_attention: str = "local") -> float:
    """Bytes the ``block`` (``"attention"``: input norm to the proj all-reduce's dropout-add;
    ``"mlp"``: pre-MLP norm to the fc2 all-reduce's dropout-add) of a TP-``t`` layer keeps for
    backward without recompute (stock schedule).

    ``core_attention``: Megatron's local attention, SDPA's math kernel or a fused kernel
    (``describe.core_attention``; ``core_attention_bytes``).

    ``sequence_parallel``: the norm (input, statistics), the column linear's input and the hidden
    dropout mask are on this rank's s/t tokens; ``gathered_input``: the column linear keeps its
    all-gathered input (all s tokens: the Oases tape) instead of its chunk (stock).

    ``recompute_core_attention`` (``--recompute-granularity selective``): Megatron checkpoints
    the core attention, which then keeps only its inputs (Q, K, V: ``checkpoint_inputs_bytes``)
    and the attention-mask type as a 4-byte tensor, and its checkpoint the generator states
    (``checkpoint_rng_state_bytes``); the softmax output, the dropout mask and probabilities and
    the causal mask built inside it are not kept (measured)."""
    if block not in BLOCKS:
        raise ValueError(f"block {block!r} is not one of {BLOCKS}")
    tok = b * s
    chunk = tok / t if sequence_parallel and t > 1 else tok  # tokens on the residual side
    mask = e if kernels.dropout_mask is None else kernels.dropout_mask
    norm = chunk * e * h + norm_beyond_input(chunk, h, e=e, kernels=kernels, variant=variant)
    column_input = (tok if gathered_input else chunk) * e * h
    hidden_mask = chunk * h * mask if hidden_dropout else 0
    if block == "mlp":
        return norm + column_input + tok * e * variant.mlp_saved_per_ffn * f / t + hidden_mask
    if recompute_core_attention:
        attention = (rope_table_bytes(s=s, h=h, a=a, e=e, variant=variant) + SELECTIVE_MASK_TYPE_BYTES
                     + checkpoint_rng_state_bytes(sequence_parallel=sequence_parallel and t > 1, kernels=kernels,
                                                  attention_dropout=attention_dropout, core_attention=core_attention))
        qkv = checkpoint_inputs_bytes(tok=tok, h=h, a=a, t=t, e=e, kernels=kernels, variant=variant)
    else:
        qkv, attention = core_attention_bytes(b=b, s=s, h=h, a=a, t=t, e=e, attention_dropout=attention_dropout,
                                              softmax_in_fp32=softmax_in_fp32, kernels=kernels, variant=variant,
                                              core_attention=core_attention)
    return norm + column_input + qkv + tok * e * h / t + attention + hidden_mask  # + proj's input


def mesh_norm_bytes(*, rows: float, width: float, e: int, weight_copy: float = 0) -> float:
    """What ATP's and 3-D's norms (``ATPNorm``, ``LayerNorm3D``: torch ops whatever the device,
    statistics in fp32 so their sums can be all-reduced) keep on ``rows`` vectors of ``width``
    features (measured on CPU, fp32): the fp32 input (LayerNorm: centred) that the statistic's
    square and the scale's product keep, the fp32 reciprocal root per row, the normalised
    activation in e bytes that the weight's product keeps, and ``weight_copy`` more elements (the
    3-D norm's expanded diagonal weight, e bytes). Stock Megatron's norms keep the input and
    recompute the normalised activation instead (``norm_beyond_input``)."""
    return rows * (width * (4 + e) + 4) + e * weight_copy


def mesh_layer_saved_bytes(*, b: int, s: int, h: int, a: int, f: int, e: int, residual_split: int,
                           norm_width: float, norm_weight_copy: float = 0, heads_split: int,
                           context_split: int, ffn_split: int, hidden_dropout: bool, attention_dropout: bool,
                           kernels: Kernels = CUDA_KERNELS, variant: LayerVariant = GPT2,
                           core_attention: str = "local") -> float:
    """What one ATP or 3-D layer keeps for backward per micro-batch (stock schedule, no
    recompute), the inventory of their modules (measured on CPU; ``describe.atp_2d``,
    ``describe.cube_3d`` name the splits):

    * per norm (two): ``mesh_norm_bytes`` on the rank's share of the residual stream
      (``residual_split`` ways, rows of ``norm_width`` features);
    * the QKV and fc1 inputs (the norms' outputs, e bytes, same share);
    * the core attention on the rank's ``a / heads_split`` heads, as Megatron's at that degree
      (``core_attention_bytes``);
    * the proj input, the context on ``h / context_split`` features; where it is gathered from the
      heads' own (``context_split != heads_split``: ATP with d2 > 1), a fused kernel also keeps its
      own output, the context of its heads;
    * the MLP on ffn / ``ffn_split`` features: GeLU's input and output (2), or SwiGLU's fc1 output
      (gate and up, views of it), silu(gate) and their product (4: ``torch.chunk`` then
      ``act(gate) * up``; Megatron's layer keeps 5, ``LayerVariant.mlp_saved_per_ffn``);
    * with hidden dropout, one mask per block on the residual share (the kernel's bytes, as
      Megatron's ``bias_dropout_add``: assumed, the grid runs without dropout)."""
    tok = b * s
    share = tok * h / residual_split
    norm = mesh_norm_bytes(rows=share / norm_width, width=norm_width, e=e, weight_copy=norm_weight_copy)
    qkv, attention = core_attention_bytes(b=b, s=s, h=h, a=a, t=heads_split, e=e, attention_dropout=attention_dropout,
                                          kernels=kernels, variant=variant, core_attention=core_attention)
    kernel = attention_kernel(core_attention, attention_dropout=attention_dropout,
                              fused_dropout=kernels.fused_attention_dropout)
    own_context = e * tok * h / heads_split if kernel == "fused" and context_split != heads_split else 0
    mask = e if kernels.dropout_mask is None else kernels.dropout_mask
    return (2 * norm + 2 * e * share + qkv + attention + e * tok * h / context_split + own_context
            + e * tok * MESH_MLP_SAVED_PER_FFN[variant.gated] * f / ffn_split
            + (2 * share * mask if hidden_dropout else 0))


MESH_MLP_SAVED_PER_FFN = {False: 2, True: 4}
"""Activations of width ffn the ATP and 3-D MLPs keep per token (``ATPMLP.activate``,
``TP3DMLP.forward``; measured on CPU), GeLU's and SwiGLU's."""


def layer_saved_bytes(*, schedule: str = "stock", recompute: bool = False,
                      fine_grained: bool = True, sub_batches: int = SUB_BATCHES, b: int, s: int, h: int,
                      a: int, f: int, t: int, e: int, hidden_dropout: bool = True,
                      attention_dropout: bool = True, kernels: Kernels = CUDA_KERNELS,
                      variant: LayerVariant = GPT2, sequence_parallel: bool = False,
                      recompute_core_attention: bool = False, core_attention: str = "local",
                      expert_parallel: int = 1) -> float:
    """Bytes one layer keeps between its forward and its backward, per micro-batch.

    ``recompute``: Megatron's full uniform recompute (stock) or the Oases schedule's own
    (``fine_grained``: also keep the forward collectives' outputs so recompute issues no
    collective; ``describe.split.recompute_boundaries``). ``sequence_parallel``: the residual side is s/t tokens.
    ``recompute_core_attention``: Megatron's selective recompute (stock schedule only).
    ``core_attention``: ``describe.core_attention.CORE_ATTENTIONS`` (``core_attention_bytes``).
    ``expert_parallel``: the EP of an MoE run the layer belongs to (``describe.split.oases_splits``:
    at TP 1 under the Oases schedule the executor runs it, split, when EP > 1; else stock layers)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    hidden = b * s * h * e
    oases = oases_splits(t, oases=schedule == "oases", expert_parallel=expert_parallel)
    if recompute_core_attention and (recompute or schedule == "oases"):
        raise ValueError("selective recompute (the core attention) is Megatron's, on the stock schedule "
                         "without full recompute")
    sp = sequence_parallel and t > 1
    if recompute:  # the boundaries per recompute mode: describe.split
        kept = hidden * recompute_boundaries(fine_grained=oases and fine_grained, sequence_parallel=sp, tp=t)
        if oases:  # one generator state per dropout site, for the redraw
            kept += redraw_state_bytes(BLOCKS, hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
                                       core_attention=core_attention, sub_batches=sub_batches, kernels=kernels)
        else:  # Megatron's checkpoint snapshots the generators
            kept += checkpoint_rng_state_bytes(sequence_parallel=sp, attention_dropout=attention_dropout,
                                               core_attention=core_attention, kernels=kernels)
        return kept
    # The Oases schedule draws bool masks itself, whatever the device's dropout kernel keeps.
    k = dataclasses.replace(kernels, dropout_mask=1) if oases else kernels
    kw = dict(b=b, s=s, h=h, a=a, f=f, t=t, e=e, hidden_dropout=hidden_dropout,
              attention_dropout=attention_dropout, kernels=k, variant=variant,
              sequence_parallel=sp, gathered_input=sp and oases)
    kw_attn = dict(kw, recompute_core_attention=recompute_core_attention, core_attention=core_attention)
    kept = block_saved_bytes("attention", **kw_attn) + block_saved_bytes("mlp", **kw)
    extra = oases_kept_beyond_stock(hidden, s=s, h=h, a=a, e=e, variant=variant, sub_batches=sub_batches,
                                    core_attention=core_attention, attention_dropout=attention_dropout, kernels=k)
    return kept + (extra if oases else 0)


def checkpoint_rng_state_bytes(*, sequence_parallel: bool, attention_dropout: bool, core_attention: str = "local",
                               kernels: Kernels = CUDA_KERNELS) -> float:
    """Bytes of the generator states Megatron's checkpoint keeps per checkpointed layer under full
    recompute, or per core attention under selective recompute
    (``tensor_parallel.CheckpointFunction``'s ``ctx.rng_states``, whatever the dropout): the CPU
    generator's (``Kernels.host_rng_state``), the device's, and each RNG-tracker state the layer
    forks after the snapshot (the fork stores a new state, so the snapshot's is the checkpoint's
    alone; an unforked tracker's is the tracker's own, shared). The layer forks the
    model-parallel tracker for the attention dropout outside sequence parallelism: Megatron's
    local attention always (``DotProductAttention``, whatever the probability), SDPA, ATP's and
    the cube's attention when it is > 0. Measured per layer on CPU with the trainer's ledger
    (``runtime.saved_tensors``) at TP 1 and 2, local and SDPA, with and without SP and dropout,
    and for ATP 1 x 4, the cube 8, an MoE run at EP 2 and --schedule oases at TP 1 (stock layers),
    and under selective recompute (``tests/test_saved_bytes_budget.py``): 2 or 3 states of 5,056
    bytes. The Oases executor's own recompute keeps none of these
    (``redraw_state_bytes`` instead). Read by ``block_saved_bytes``, ``layer_saved_bytes``,
    ``sim.core.memory`` and ``plan.memory`` (``tests/test_description_contract.py`` pins trainer =
    description = sim)."""
    forked = not sequence_parallel and (attention_dropout or core_attention == "local")
    return kernels.host_rng_state + kernels.rng_state * (1 + forked)


REDRAWN_BLOCKS = ("attention", "mlp", "moe")
"""The blocks :func:`redraw_state_bytes` knows: each ends in a hidden dropout-add; the attention
block also draws the attention dropout."""


def redraw_state_bytes(blocks: tuple[str, ...], *, hidden_dropout: bool, attention_dropout: bool,
                       core_attention: str = "local", sub_batches: int = SUB_BATCHES,
                       kernels: Kernels = CUDA_KERNELS) -> float:
    """Bytes of the generator states the Oases executor keeps, under its recompute (fine-grained
    or not), for ``blocks`` of one layer (``REDRAWN_BLOCKS``; an MoE layer's are attention and
    moe) to redraw their dropout masks in recompute (``schedules/oases/dropout.MicroBatchMasks``):
    one state per dropout site, the attention dropout's once per sub-batch where the kernel draws
    it (SDPA: ``draws_in_kernel``). Measured with dropout on at TP 2 (``tests/test_saved_bytes_budget.py``)
    and at TP 1 x EP 2 for an MoE run's dense and MoE layers (``tests/test_moe_description.py``);
    ``layer_saved_bytes``, ``sim.core.memory``, ``plan.memory`` and ``describe.moe_oases`` read it."""
    unknown = [b for b in blocks if b not in REDRAWN_BLOCKS]
    if unknown:
        raise ValueError(f"block {unknown[0]!r} is not one of {REDRAWN_BLOCKS}")
    draws = sub_batches if draws_in_kernel(core_attention) else 1
    sites = len(blocks) * hidden_dropout + ("attention" in blocks) * attention_dropout * draws
    return kernels.rng_state * sites


def oases_kept_beyond_stock(hidden_state_bytes: float, *, s: int, h: int, a: int, e: int,
                            variant: LayerVariant = GPT2, sub_batches: int = SUB_BATCHES, core_attention: str = "local",
                            attention_dropout: bool = False, kernels: Kernels = CUDA_KERNELS) -> float:
    """What one layer under the Oases schedule without recompute keeps beyond stock's inventory:
    per further sub-batch, what each attention call builds anew (``per_call_bytes``: the causal
    mask, RoPE's tables; under ``core_attention`` and ``attention_dropout``'s kernel). The step
    boundaries at its collectives (the all-reduces' outputs, partial sums, residuals) are not
    kept: the executor frees what its graphs' backward does not read
    (``schedules/oases/release.py``), so ``hidden_state_bytes`` (a hidden state's bytes, which
    the callers still pass) adds nothing; measured per layer by ``tests/test_round_trip.py``."""
    del hidden_state_bytes
    kernel = attention_kernel(core_attention, attention_dropout=attention_dropout,
                              fused_dropout=kernels.fused_attention_dropout)
    return (sub_batches - 1) * per_call_bytes(
        s=s, h=h, a=a, e=e, variant=variant, core_attention=kernel, kernels=kernels)
