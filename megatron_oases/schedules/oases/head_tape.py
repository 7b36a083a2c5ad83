"""The GPT head's TP collectives in the Oases executor, one per sub-batch.

Stock Megatron runs the embedding's forward all-reduce (reduce-scatter under sequence
parallelism without learned positions) and the output layer's input-gradient all-reduce
(all-gather / reduce-scatter under sequence parallelism) on the whole micro-batch, with nothing
to overlap. Here they become steps of two more tapes that the executor runs like a layer's, so
each sub-batch's collective overlaps the other sub-batch's work:

* the *entry* tape (first pipeline stage), ahead of the first layer::

      embedding.g   emb_p (the lookup's vocab-parallel partial sums) all-reduced -> emb
      embedding     emb -> x      Megatron's LanguageModelEmbedding after its lookup: positions,
                                  [b s h] -> [s b h], fp32, the SP chunk, dropout

  The lookup itself stays outside the stage, on the whole micro-batch (its weight gradient is
  then stock's, and the tied output weight's DDP hook fires once): ``OasesEmbeddingMixin``
  returns a stock-shaped placeholder carrying the partial sums, which the block runs.
* the *exit* tape (last pipeline stage), after the last layer::

      final_norm    y -> final    the block's final norm
      output.f.bwd  grad(final) all-reduced in backward (SP: ``output.ag`` gathers ``final_s``)
      output        final -> logits   Megatron's output layer, its collectives switched off

  The block returns a placeholder carrying the logits, which ``OasesOutputMixin`` hands back
  to ``GPTModel`` in place of its output layer's; the loss stays Megatron's, on the whole
  micro-batch. The output weight's gradient goes back through the stage's autograd edge
  (``LayerTape.stage_params``).

Both tapes keep their graphs (no recompute), as stock keeps the embedding's and the logits'.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from megatron_oases.schedules.oases.dropout import SubBatchDropout
from megatron_oases.schedules.oases.steps import (BackwardAllReduce, ForwardAllReduce, GatherSequence, LayerTape,
                                                  Local, ReduceScatterSequence)
from megatron_oases.schedules.oases.tape import _explicit_comm, _trainable

EMBEDDING_SITE = ("embedding",)
"""The embedding dropout's site among the micro-batch's masks (layers use (index, name))."""


@dataclasses.dataclass(frozen=True)
class PendingEmbedding:
    """What the first stage's block needs to finish the embedding per sub-batch."""

    partial: torch.Tensor
    """The lookup's vocab-parallel partial sums: ``[b, s, h]``, or ``[s, b, h]`` when the
    embedding reduce-scatters (sequence parallelism without learned positions)."""
    position_ids: object


def placeholder(shape, dtype, device, **carried) -> torch.Tensor:
    """A tensor of stock's ``shape`` that holds no memory and carries ``carried`` as attributes:
    what passes between Megatron's ``GPTModel`` code and the Oases block in place of the
    embedding's output and of the final hidden states (``GPTModel`` reads only their shape)."""
    out = torch.empty((), dtype=dtype, device=device).expand(*shape)
    for name, value in carried.items():
        setattr(out, name, value)
    return out


@contextlib.contextmanager
def _vocab_reduce_off():
    """``VocabParallelEmbedding`` returns its partial sums: its reduce (or reduce-scatter) is
    the executor's, per sub-batch."""
    from megatron.core.tensor_parallel import layers

    names = ("reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region")
    saved = [getattr(layers, n) for n in names]
    for n in names:
        setattr(layers, n, lambda input_, *args, **kwargs: input_)
    try:
        yield
    finally:
        for n, f in zip(names, saved):
            setattr(layers, n, f)


@contextlib.contextmanager
def _returning(module, value):
    """``module(...)`` returns ``value`` (Megatron's embedding then runs its tail on it)."""
    module.forward = lambda *args, **kwargs: value
    try:
        yield
    finally:
        del module.forward


class OasesEmbeddingMixin:
    """Training forward of ``LanguageModelEmbedding`` under the Oases block: the lookup only."""

    def forward(self, input_ids, position_ids, tokentype_ids=None):
        if not (self.training and torch.is_grad_enabled()) or tokentype_ids is not None:
            return super().forward(input_ids, position_ids, tokentype_ids)
        with _vocab_reduce_off():
            partial = self.word_embeddings(input_ids)
        b, s = input_ids.shape
        if self.config.sequence_parallel:
            s //= self.tp_group.size()
        dtype = torch.float32 if self.config.fp32_residual_connection else partial.dtype
        return placeholder((s, b, self.config.hidden_size), dtype, partial.device,
                           oases_entry=PendingEmbedding(partial, position_ids))


class OasesOutputMixin:
    """The output layer of a model whose Oases block computed the logits (``oases_logits``)."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        logits = getattr(input_, "oases_logits", None)
        if logits is None:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if runtime_gather_output:
            raise RuntimeError("--schedule oases: the training forward keeps the logits vocab-parallel")
        return logits, None


def entry_tape(embedding) -> LayerTape:
    """The embedding after its lookup, per sub-batch (see the module docstring)."""
    rs = embedding.reduce_scatter_embeddings
    collective = (ReduceScatterSequence("embedding.rs", "emb_p", "emb") if rs
                  else ForwardAllReduce("embedding.g", "emb_p", "emb"))
    if isinstance(embedding.embedding_dropout, torch.nn.Dropout):
        embedding.embedding_dropout = SubBatchDropout(embedding.embedding_dropout.p, EMBEDDING_SITE,
                                                      batch_dim=1)
    tail = super(OasesEmbeddingMixin, embedding).forward

    def finish(t, inp):
        with _returning(embedding.word_embeddings, t["emb"]):
            return {"x": tail(input_ids=None, position_ids=inp.position_ids)}

    params = [p for n, p in embedding.named_parameters() if not n.startswith("word_embeddings.")]
    return LayerTape(steps=(collective, Local("embedding", ("emb",), ("x",), finish)),
                     group=embedding.word_embeddings.tp_group, params=_trainable(params),
                     collectives_off=contextlib.nullcontext, input="emb_p", output="x",
                     recompute=False, in_batch_dim=1 if rs else 0)


def exit_tape(model, block) -> LayerTape:
    """The final norm and the output layer, per sub-batch (see the module docstring)."""
    out = model.output_layer
    sp = out.sequence_parallel
    normed = "final_s" if sp else "final"
    if model.share_embeddings_and_output_weights:
        weight = model.shared_embedding_or_output_weight
    else:
        def weight():
            return out.weight

    def final_norm(t, inp):
        return {normed: block.final_layernorm(t["y"])}

    def logits(t, inp):
        return {"logits": out(t["final"], weight=weight())[0]}

    enter = (GatherSequence("output.ag", "final_s", "final") if sp
             else BackwardAllReduce("output.f.bwd", "final"))
    steps = (Local("final_norm", ("y",), (normed,), final_norm), enter,
             Local("output", ("final",), ("logits",), logits))
    return LayerTape(steps=steps, group=out.tp_group,
                     params=_trainable(block.final_layernorm.parameters()),
                     collectives_off=_explicit_comm((out,), (weight,)), input="y", output="logits",
                     recompute=False, stage_params=(("output", weight),))


def head_tapes(model, block, skip_collectives: bool) -> tuple[LayerTape | None, LayerTape | None]:
    """(entry, exit) tapes of ``model``'s head on this stage, or None where it runs stock: not a
    GPT model's block, a one-rank TP group, ``--oases-skip-tp-collectives`` (the head keeps its
    collectives there), multi-token prediction, token types or an outer SP scatter."""
    from megatron.core.models.common.embeddings.language_model_embedding import \
        LanguageModelEmbedding
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if block is model or skip_collectives or getattr(model.config, "mtp_num_layers", None):
        return None, None
    embedding = getattr(model, "embedding", None) if block.pre_process else None
    entry = None
    if (isinstance(embedding, LanguageModelEmbedding) and embedding.tokentype_embeddings is None
            and embedding.scatter_to_sequence_parallel
            and embedding.word_embeddings.tp_group.size() > 1):
        _swap_class(embedding, OasesEmbeddingMixin)
        entry = entry_tape(embedding)
    out = getattr(model, "output_layer", None) if block.post_process else None
    exit_ = None
    if (isinstance(out, ColumnParallelLinear) and block.final_layernorm is not None
            and not out.gather_output and out.tp_group.size() > 1):
        _swap_class(out, OasesOutputMixin)
        exit_ = exit_tape(model, block)
    return entry, exit_


_CLASSES: dict = {}


def _swap_class(module, mixin) -> None:
    """Give ``module`` the class ``mixin`` + its own (parameters and state-dict keys unchanged)."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    if (cls, mixin) not in _CLASSES:
        _CLASSES[(cls, mixin)] = type(f"Oases{cls.__name__}", (mixin, cls), {})
    module.__class__ = _CLASSES[(cls, mixin)]
