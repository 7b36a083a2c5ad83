"""The executor's vocabulary: a layer as named steps (``LayerTape``), the step kinds, and what a
step reads besides its tensors (``BlockInputs``).

A tape is a tuple of steps on named tensors: ``Local`` steps (pure local compute, their TP
collectives switched off) separated by collective steps, which the executor launches itself,
async (``comm_steps.py``), so it can switch to the other sub-batch meanwhile. The builders that
turn a model's layers into tapes are ``tape.py`` (Megatron's layers), ``moe_tape.py``,
``atp_tape.py`` and ``head_tape.py``; ``executor.py`` runs them.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Union

import torch


@dataclasses.dataclass(frozen=True)
class BlockInputs:
    """What a step reads besides its named tensors: its sub-batch's attention mask and the
    block's batch-independent arguments (rotary embeddings ``[s, 1, 1, d]``, the same for every
    sub-batch and for recompute)."""

    attention_mask: object = None
    rotary_pos_emb: object = None
    position_ids: object = None
    """The sub-batch's ``[b, s]`` position ids (the embedding's tail, ``head_tape.py``)."""
    sub_batch: int = 0
    """Which sub-batch of the micro-batch the steps run on."""
    scratch: dict | None = None
    """One dict per micro-batch, shared by its sub-batches and kept until its backward ends: what
    a step computes in forward and its recompute and backward reuse (an MoE layer's routing
    metadata, ``moe_tape.py``). Never on the shared module, since 1F1B has several micro-batches
    in flight."""


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
class _ChunkCollective:
    """The fields of the two gather / chunk steps over ``group`` along ``dim`` (distinct classes,
    as the executor tells their directions apart)."""

    name: str
    src: str
    dst: str
    dim: int
    group: object


@dataclasses.dataclass(frozen=True)
class ForwardAllGather(_ChunkCollective):
    """``dst`` = all-gather of ``src`` along ``dim`` over ``group``; backward keeps this rank's
    chunk of grad(dst) (the gathered tensor's consumers are replicated on ``group``)."""


@dataclasses.dataclass(frozen=True)
class BackwardAllGather(_ChunkCollective):
    """``dst`` = this rank's chunk of ``src`` along ``dim`` (``src`` replicated on ``group``);
    backward all-gathers grad(dst) into grad(src)."""


@dataclasses.dataclass(frozen=True)
class _SequenceCollective:
    """The fields of sequence parallelism's two collectives. ``group``: None runs it on the
    tape's group. ``sizes``: ``sizes(inputs)`` gives each rank's rows along dim 0 when they
    differ (an MoE layer's routed tokens; None: equal chunks)."""

    name: str
    src: str
    dst: str
    dim: int = 0
    group: object = None
    sizes: Callable | None = None


@dataclasses.dataclass(frozen=True)
class GatherSequence(_SequenceCollective):
    """Sequence parallelism's entry to a column-parallel linear: ``dst`` = all-gather of ``src``
    along ``dim`` (the sequence); backward reduce-scatters grad(dst) into grad(src), since the
    linear's input gradient is partial per rank (Megatron's gather_from_sequence_parallel_region)."""


@dataclasses.dataclass(frozen=True)
class ReduceScatterSequence(_SequenceCollective):
    """Sequence parallelism's exit from a row-parallel linear: ``dst`` = this rank's sequence
    chunk of the sum of the partial outputs ``src``; backward all-gathers grad(dst) into
    grad(src) (Megatron's reduce_scatter_to_sequence_parallel_region)."""


@dataclasses.dataclass(frozen=True)
class AllToAll:
    """``dst`` = all-to-all of ``src``'s rows over ``group``, ``splits(inputs)`` giving (output
    splits, input splits) per rank; backward: the all-to-all of grad(dst) with the splits swapped
    (an MoE layer's dispatch and combine, ``moe_tape.py``)."""

    name: str
    src: str
    dst: str
    splits: Callable
    group: object = None


@dataclasses.dataclass(frozen=True)
class Barrier:
    """Forward only: wait until every sub-batch of the micro-batch reached this step (a step
    after it reads what all of them computed, e.g. an MoE router's token counts). Recompute and
    backward pass it by (what it waited for is kept in ``BlockInputs.scratch``)."""

    name: str


Step = Union[Local, ForwardAllReduce, BackwardAllReduce, ForwardAllGather, BackwardAllGather,
             GatherSequence, ReduceScatterSequence, AllToAll, Barrier]
FORWARD_COLLECTIVES = (ForwardAllReduce, ForwardAllGather, GatherSequence, ReduceScatterSequence,
                       AllToAll)
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
    recompute: bool = True
    """Recompute this tape's local steps in backward when the run recomputes (the head's tapes
    keep their graphs, as stock keeps the embedding's and the output layer's)."""
    in_batch_dim: int = 1
    """The batch dim of ``input`` (0 for the word embedding's ``[b, s, h]`` partial sums)."""
    stage_params: tuple = ()
    """(step name, getter) of parameters whose gradient the executor returns through the stage's
    autograd edge instead of delivering it (the output weight, shared with the embedding)."""

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
        Megatron 1-D layer, ``describe.split.recompute_boundaries`` hidden states). A collective
        on a one-rank group (the attention's all-reduce of an MoE layer at TP 1, which the
        executor runs for its all-to-alls) moves nothing, so its output is not kept."""
        outs = tuple(s.dst for s in self.recompute_steps
                     if isinstance(s, FORWARD_COLLECTIVES) and _ranks(self.group_of(s)) > 1)
        return (self.input,) + (outs if fine_grained else ())


def _ranks(group) -> int:
    """Ranks of ``group`` (2 when unknown: no process group, as in a test of the tape alone)."""
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() else 2


class UnsupportedLayer(ValueError):
    """The layer's structure is not one the Oases executor can split into segments."""


def require(cond: bool, what: str) -> None:
    """Refuse a layer the tape builders cannot describe, naming the schedule."""
    if not cond:
        raise UnsupportedLayer(f"--schedule oases: {what}")
