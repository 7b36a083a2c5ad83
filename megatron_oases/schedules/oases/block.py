"""Selecting the Oases schedule on a Megatron-Core model: ``enable_oases_schedule(model, options)``.

The hook is the model's ``TransformerBlock``: its class is swapped for a subclass whose training
forward runs the stage's layers through ``OasesStage``; parameters, state-dict keys, checkpoints,
eval forward and everything outside the block stay Megatron's. A Megatron-LM model provider calls
it right after building ``GPTModel`` (the trainer does so in ``specs.build_gpt_model``).
"""
from __future__ import annotations

import dataclasses

from megatron_oases.describe.split import sub_batches_at
from megatron_oases.schedules.oases.backend_tapes import layer_tape
from megatron_oases.schedules.oases.executor import OasesRunner, OasesStage
from megatron_oases.schedules.oases.options import OasesOptions
from megatron_oases.schedules.oases.release import Placeholders
from megatron_oases.schedules.oases.steps import BlockInputs, UnsupportedLayer
from megatron_oases.schedules.oases.tape import megatron_block_tapes

_UNSUPPORTED_KWARGS = ("context", "context_mask", "rotary_pos_cos",
                       "rotary_pos_sin", "rotary_pos_cos_sin", "attention_bias",
                       "inference_context", "packed_seq_params", "sequence_len_offset",
                       "padding_mask", "inference_params")


class OasesBlockMixin:
    """Training forward of a ``TransformerBlock`` through the Oases executor."""

    oases_segments: list
    oases_head: tuple[bool, bool] = (False, False)
    """Whether the executor runs the head's (entry, exit) tapes (``head_tape.py``)."""

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        import torch
        from megatron.core.utils import make_viewless_tensor

        if not (self.training and torch.is_grad_enabled()):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        used = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
        if args or used:
            raise UnsupportedLayer(f"the Oases schedule does not support {used or 'positional'} "
                                   f"block arguments (e.g. cross-attention context) yet")
        entry, exit_ = self.oases_head
        inputs = BlockInputs(attention_mask=attention_mask, rotary_pos_emb=kwargs.get("rotary_pos_emb"))
        if entry:  # the embedding's lookup ran outside (head_tape.OasesEmbeddingMixin)
            pending = getattr(hidden_states, "oases_entry", None)
            if pending is None:
                raise UnsupportedLayer("--schedule oases: the block expected the embedding's "
                                       "partial sums (its lookup ran without OasesEmbeddingMixin)")
            stock_shape, stage_input = hidden_states.shape, pending.partial
            inputs = dataclasses.replace(inputs, position_ids=pending.position_ids)
            batch = stock_shape[1]
        else:
            if not self.pre_process:
                hidden_states = self.input_tensor  # set by set_input_tensor (pipeline stages)
            stage_input = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
            stock_shape, batch = stage_input.shape, stage_input.shape[1]
        hidden_states = stage_input
        if len(self.layers):
            with _rng_context(self.config):
                hidden_states = _run_segments(self.oases_segments, stage_input, inputs, batch,
                                              back_to_full=not exit_)
        if exit_:  # the executor ran the final norm and the output layer (OasesOutputMixin)
            from megatron_oases.schedules.oases.head_tape import placeholder

            return placeholder(stock_shape, self.final_layernorm.weight.dtype, hidden_states.device,
                               oases_logits=hidden_states)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True,
                                                 keep_graph=True)
        elif not self.pre_process and not len(self.layers):
            hidden_states = hidden_states.clone()
        return hidden_states


def _rng_context(config):
    """Stock ``TransformerBlock.forward`` runs its layers inside the model-parallel RNG-tracker
    fork under sequence parallelism (each TP rank's sequence chunk draws its own dropout mask);
    the Oases forward does the same so its masks equal stock's."""
    import contextlib

    from megatron.core import tensor_parallel

    if config.sequence_parallel:
        return tensor_parallel.get_cuda_rng_tracker().fork()
    return contextlib.nullcontext()


_SUBCLASSES: dict = {}


def _oases_class(cls):
    if issubclass(cls, OasesBlockMixin):
        return cls
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Oases{cls.__name__}", (OasesBlockMixin, cls), {})
    return _SUBCLASSES[cls]


def enable_oases_schedule(model, options: OasesOptions):
    """Run ``model``'s transformer block(s) with the Oases schedule; returns ``model``.

    ``model`` is a ``GPTModel`` (its ``decoder``) or a ``TransformerBlock``. The config's own
    recompute must be off (Oases recomputes itself, per ``options``)."""
    from megatron_oases.schedules.oases.head_tape import head_tapes

    block = getattr(model, "decoder", model)
    if block.config.recompute_granularity is not None:
        raise UnsupportedLayer("leave TransformerConfig.recompute_granularity unset with the "
                               "Oases schedule; OasesOptions.recompute selects its recompute")
    offset = _layer_offset(block)
    units = [u for i, layer in enumerate(block.layers) for u in _units(layer, offset + i)]
    entry, exit_ = head_tapes(model, block, options.skip_collectives) if units else (None, None)
    if units:  # the head runs on the whole TP group (a plan's full degree)
        groups = units[0][1]
        full = groups.tp_size if groups is not None else None
        units = ([(full, groups, entry)] if entry else []) + units + ([(full, groups, exit_)] if exit_ else [])
    cfg = block.config  # the rule's inputs where a unit has no plan's degree: the stage's TP and EP
    block.oases_segments = _segments(units, options, tp=cfg.tensor_model_parallel_size,
                                     ep=cfg.expert_model_parallel_size if cfg.num_moe_experts else 1)
    block.oases_head = (entry is not None, exit_ is not None)
    block.__class__ = _oases_class(type(block))
    return model


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Consecutive layers (or attention / MLP blocks) at one TP degree (all of a stage's layers
    without ``--oases-plan``): one ``OasesStage``. Between segments the hidden states are resharded to the next degree,
    a collective the two sub-batches do not overlap (the planner's Eq. 4 edge cost)."""

    runner: OasesRunner
    degree: int | None = None
    groups: object = None


def _units(layer, index: int) -> list[tuple]:
    """(degree, degree groups, tape) of each part of ``layer`` the executor runs at one degree:
    the whole layer, or its attention and MLP blocks when a plan gives them different degrees
    (the hidden states are resharded between the two, like between layers)."""
    degree = getattr(layer, "tp_degree", None)
    groups = getattr(layer, "degree_groups", None)
    mlp_degree = getattr(layer, "mlp_degree", degree)
    if mlp_degree == degree:
        return [(degree, groups, layer_tape(layer, index))]
    attention, mlp = megatron_block_tapes(layer, index)
    return [(degree, groups, attention), (mlp_degree, groups, mlp)]


def _segments(units, options: OasesOptions, *, tp: int, ep: int) -> list[_Segment]:
    """The units grouped into segments of one degree, each with its runner; a unit without a
    plan's degree (None) runs at the stage's TP size ``tp``, its MoE layers over EP ``ep``."""
    out: list[tuple[int | None, object, list]] = []
    for degree, groups, tape in units:
        if out and out[-1][0] == degree:
            out[-1][2].append(tape)
        else:
            out.append((degree, groups, [tape]))
    # A degree-1 block of a plan issues no collective: nothing to overlap, so its replica's slice
    # is not split into sub-batches (describe.split.sub_batches_at; the planner prices it that
    # way too); the whole group at TP 1 splits only for an MoE model's all-to-alls (EP > 1).
    # The segments share one placeholder element (release.Placeholders): one per runner kept an
    # element per change of degree that no description prices (issue 47: 8 bytes a layer).
    shared = Placeholders()
    return [_Segment(OasesRunner(t, dataclasses.replace(
        options, sub_batches=sub_batches_at(tp if d is None else d, expert_parallel=ep)), shared), d, g)
            for d, g, t in out]


def _run_segments(segments, hidden_states, inputs: BlockInputs, batch: int, back_to_full: bool):
    """The segments in turn, resharding between degrees; ``back_to_full``: the result at the
    whole TP group (not when the last segment ends in the logits)."""
    from megatron_oases.parallel.degree_groups import narrow_batch_mask, reshard_batch

    degree, groups = None, None
    for seg in segments:
        seg_inputs = inputs
        if seg.groups is not None:
            groups = seg.groups
            hidden_states = reshard_batch(hidden_states, groups, degree or groups.tp_size, seg.degree)
            seg_inputs = dataclasses.replace(inputs, attention_mask=narrow_batch_mask(
                inputs.attention_mask, groups, seg.degree, batch))
        degree = seg.degree
        hidden_states = OasesStage.apply(hidden_states, seg.runner, seg_inputs,
                                         *seg.runner.stage_params())
    if groups is not None and back_to_full:
        hidden_states = reshard_batch(hidden_states, groups, degree, groups.tp_size)
    return hidden_states


def _layer_offset(block) -> int:
    """Global index of the block's first layer (dropout sites must not collide across chunks)."""
    return block.layers[0].layer_number - 1 if len(block.layers) else 0


def oases_saved_bytes(model_chunks) -> int | None:
    """Bytes the Oases blocks of ``model_chunks`` kept for backward in their last forward
    (one micro-batch per chunk); None when no chunk runs the Oases schedule."""
    found = [seg.runner.saved_bytes() for chunk in model_chunks for m in chunk.modules()
             if isinstance(m, OasesBlockMixin) for seg in m.oases_segments]
    return sum(found) if found else None
