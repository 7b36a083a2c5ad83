"""How the model is split and scheduled (``Strategy``), and whether a model fits that split.

The simulator's one description of a parallel layout: TP / PP / DP, the pipeline schedule, the TP
backend and its layout, recompute, the executor (``schedule``, default or Oases), a per-block plan and the DDP overlap flags.
``Strategy.__post_init__`` refuses what needs no model (the backend and its layout read from
``describe``); ``check`` what needs the model (layer and batch splits, divisibility by TP).
"""
from __future__ import annotations

import dataclasses

from ...describe.backends import backend as record
from ...describe.layout import Layout
from ...describe.megatron_1d import sequence_parallel_refusal
from ...describe.registry import BACKENDS
from ...describe.shapes import GPTShape
from ...describe.split import oases_splits, split_refusal, sub_batches_at, unsplit_refusal
from ...pricing.device_model import SimError
from ...run_config import SCHEDULES
from .moe import moe_check

PIPELINE_SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """How the model is split and scheduled."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    num_microbatches: int = 1
    pipeline_schedule: str = "1f1b"
    """gpipe | 1f1b (interleaved 1F1B when ``virtual_stages`` > 1)."""
    virtual_stages: int = 1
    """Model chunks per device (Megatron's virtual pipeline size)."""
    recompute: bool = False
    """Full recompute: each layer's forward is rerun before its backward."""
    recompute_layers: int = 0
    """With ``recompute``: 0 recomputes every layer (Megatron's uniform method); k > 0 only the first
    k layers of each chunk (block method)."""
    selective_recompute: bool = False
    """Megatron's ``--recompute-granularity selective`` (``recompute_modules`` core_attn): each
    layer's core attention (scores, softmax, dropout, attention over V) is rerun before its
    backward and keeps none of its s^2 tensors (Megatron 1-D, stock schedule, no full recompute)."""
    schedule: str = "default"
    """The TP executor, as the trainer's ``--schedule`` (``run_config.SCHEDULES``): default (Megatron's:
    compute waits on each collective) | oases (two sub-batches cross-overlap, where
    :attr:`oases_runs`; elsewhere priced as default, whose layers the trainer runs)."""
    fine_grained_recompute: bool = True
    """Oases with recompute: forward all-reduce outputs are saved, so recompute issues no collective."""
    backend: str = "megatron"
    """TP layer: a ``describe.backends`` record (megatron 1-D, atp 2-D mesh, 3d cube)."""
    layout: Layout | None = None
    """The backend's layout of the TP group (``describe.layout``: ``{"d1": 2, "d2": 4}``); None:
    the record's layout at ``tp`` (``Backend.default_layout``; ATP needs one)."""
    distributed_optimizer: bool = False
    """Optimizer states (fp32 master + Adam moments) sharded over DP."""
    optimizer_step: bool = True
    """Model the step's tail: grad-norm all-reduce over TP x PP and Adam."""
    clip_grad: bool = True
    """``--clip-grad`` > 0 (Megatron's default 1.0): the step computes the gradients' total norm
    (per-tensor norms, their all-reduce over TP x PP) and scales them; at 0 Megatron's optimizer
    skips both."""
    block_degrees: tuple[int, ...] | None = None
    """A per-block plan (``--oases-plan``): the TP degree of layer 0's attention, layer 0's MLP,
    layer 1's attention, ...; None runs every block at ``tp``."""
    overlap_grad_reduce: bool = False
    """``--overlap-grad-reduce``: the DP reduction runs per bucket, each launched when the last
    micro-batch's backward has produced its gradients (Megatron-Core DDP's backward hooks)."""
    overlap_param_gather: bool = False
    """``--overlap-param-gather`` (distributed optimizer): the updated parameters are all-gathered
    per bucket ahead of the next forward, each bucket's gather prefetched during the previous one's."""
    ddp_bucket_size: int = 0
    """``--ddp-bucket-size`` (parameters per bucket); 0: Megatron-Core's default (``bucket_params``)."""
    sequence_parallel: bool = False
    """``--sequence-parallel`` (Megatron 1-D only): the layers' and the head's SP collectives
    (``describe.megatron_1d.sp_layer``, ``describe.head``); norms and residual on s/t tokens."""
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    """Megatron-Core's ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``:
    the first / last pipeline stage holds this many layers (0: an even share), the other stages
    split the rest evenly (no virtual stages, no ``--oases-plan``)."""
    loop_overhead: bool = False
    """The reference trainer's host work outside the layer events (``describe.ops.LOOP_EVENTS``):
    one ``loop.microbatch`` and one ``loop.layer`` per layer at the start of each chunk's forward,
    per micro-batch (``sim --predict`` sets it; measured by its profile, else priced 0)."""
    tp_comm_overlap: bool = False
    """``--tp-comm-overlap`` (Transformer Engine userbuffers, needs ``sequence_parallel``): each
    layer's SP all-gather / reduce-scatter is pipelined with the GEMM beside it and exposes only
    what that GEMM cannot hide (``Event.hidden_by``)."""
    scatter_gather_pipeline: bool = False
    """``--scatter-gather-tensors-in-pipeline``: each TP rank sends only its 1/TP slice of the
    activation between stages and the receiving stage all-gathers it over TP (Megatron-LM before
    Megatron-Core, where it was the default, and DeepSpeed's pipeline engine, which partitions a
    stage's output whenever TP > 1); ``sim.core.timeline.pipeline_send_ms`` prices it. Megatron-Core
    sends the whole tensor (the default here)."""

    async_dgrad: bool = True
    """Megatron's column-parallel linears all-reduce (under SP: reduce-scatter) the input gradient
    beside the weight-gradient GEMM (``describe.megatron_1d.STOCK_ASYNC_DGRAD``), as every
    Megatron-LM since NVIDIA/Megatron-LM cf7efd4 (2021-08-30) and every megatron-core. False:
    ``--no-async-tensor-model-parallel-allreduce``, a Megatron-LM before it (v2.6 and older),
    where the all-reduce follows the whole backward of the linear."""
    ep: int = 1
    """``--expert-model-parallel-size``: the experts of an MoE model split over EP data-parallel
    replicas (``describe.moe``; the experts' TP is TP's, Megatron's default)."""

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp", "num_microbatches", "virtual_stages", "ep"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise SimError(f"strategy {f} must be a positive integer (got {getattr(self, f)!r})")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise SimError(f"pipeline schedule must be one of {', '.join(PIPELINE_SCHEDULES)} (got {self.pipeline_schedule!r})")
        if self.schedule not in SCHEDULES:
            raise SimError(f"schedule must be one of {', '.join(SCHEDULES)} (got {self.schedule!r})")
        if self.backend not in BACKENDS:
            raise SimError(f"backend must be one of {', '.join(BACKENDS)} (got {self.backend!r})")
        self._check_layout()
        if self.recompute_layers < 0:
            raise SimError(f"recompute_layers must be >= 0 (got {self.recompute_layers})")
        if self.selective_recompute:
            self._check_selective()
        if self.block_degrees is not None:
            self._check_plan()
        if self.sequence_parallel and self.tp == 1:  # the trainer's check, in its words
            raise SimError(sequence_parallel_refusal(self.tp, 1))
        if self.sequence_parallel and (not record(self.backend).sequence_parallel or self.block_degrees is not None):
            raise SimError("--sequence-parallel is modeled for --tp-backend megatron without --oases-plan only")
        if self.tp_comm_overlap and (not self.sequence_parallel or self.schedule != "default"):
            raise SimError("--tp-comm-overlap needs --sequence-parallel and the stock schedule (as Megatron-LM)")
        self._check_ddp_overlap()
        if not self.fine_grained_recompute and self.schedule == "oases" and not self.oases_runs:
            raise SimError(unsplit_refusal("--no-oases-fine-grained-recompute"))  # the trainer's check

    @property
    def oases_runs(self) -> bool:
        """Whether the Oases executor runs the layers (``describe.split.oases_splits`` at the whole
        TP group, the trainer's ``options.oases_runs``): ``schedule`` oases at TP > 1, or at EP > 1
        (an MoE model's all-to-alls; :func:`check` refuses EP > 1 without MoE layers). A dense
        model at TP 1 runs stock layers under ``--schedule oases``, and is priced as the default
        schedule prices it: one sub-batch, Megatron's recompute."""
        return oases_splits(self.tp, oases=self.schedule == "oases", expert_parallel=self.ep)

    def _check_layout(self) -> None:
        """The record's layout rule; a strategy without a layout takes the record's at ``tp``
        (a TP size the record has none for is refused by :func:`check`, with the model)."""
        rec = record(self.backend)
        layout = self.layout if self.layout is not None else rec.default_layout(self.tp)
        if layout is not None or rec.layout_flag:
            refused = rec.layout_refusal(layout, self.tp)
            if refused:
                raise SimError(refused)
        object.__setattr__(self, "layout", layout)

    def _check_selective(self) -> None:
        """Where Megatron's selective recompute takes effect (as the trainer refuses the rest)."""
        if self.recompute:
            raise SimError("--recompute-granularity is selective or full, not both")
        if not selective_recompute_applies(self.backend, self.schedule, planned=self.block_degrees is not None):
            raise SimError("--recompute-granularity selective is modeled for --tp-backend megatron on the stock "
                           "schedule without --oases-plan only (the Oases schedule recomputes by its own rules)")

    def _check_ddp_overlap(self) -> None:
        """Megatron-LM's own limits on the DDP overlap flags (``megatron/training/arguments.py``)."""
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise SimError("--overlap-param-gather needs --use-distributed-optimizer (Megatron all-gathers "
                           "parameters only under the distributed optimizer)")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise SimError("--overlap-param-gather needs --overlap-grad-reduce (as Megatron-LM)")
        if not isinstance(self.ddp_bucket_size, int) or self.ddp_bucket_size < 0:
            raise SimError(f"--ddp-bucket-size must be a positive integer (got {self.ddp_bucket_size!r})")

    @property
    def bucket_params(self) -> int:
        """Parameters per DP bucket: ``--ddp-bucket-size``, else Megatron-Core's default
        max(40M, 1M x DP) (``DistributedDataParallel.__init__``: larger DP, larger buckets, so the
        collectives do not become latency-bound)."""
        return self.ddp_bucket_size or max(40_000_000, 1_000_000 * self.dp)

    def _check_plan(self) -> None:
        """The runtime's limits on ``--oases-plan`` that do not depend on the model."""
        object.__setattr__(self, "block_degrees", tuple(int(d) for d in self.block_degrees))
        bad = [d for d in self.block_degrees if d < 1 or self.tp % d or d & (d - 1)]
        if bad:
            raise SimError(f"--oases-plan: degree {bad[0]} is not a power of two dividing TP {self.tp}")
        if not record(self.backend).per_block_plans:
            raise SimError(f"--oases-plan runs Megatron 1-D TP sub-groups, not backend {self.backend!r}")
        if self.recompute:
            raise SimError("--oases-plan with --recompute-granularity full is not modeled by the simulator yet")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def label(self) -> str:
        """Short name: ``tp8.pp8.dp48`` + backend / pipeline schedule / executor / recompute markers."""
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        tag = record(self.backend).tag(self.layout)  # atp2x4, 3d; Megatron's none
        if tag:
            parts.append(tag)
        if self.virtual_stages > 1:
            parts.append(f"vp{self.virtual_stages}")
        if self.pipeline_schedule == "gpipe":
            parts.append("gpipe")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.schedule == "oases":
            parts.append("oases")
        if self.block_degrees is not None:
            parts.append("plan")
        if self.recompute:
            parts.append(f"rc{self.recompute_layers}" if self.recompute_layers else "rc")
        if self.selective_recompute:
            parts.append("sel")
        return ".".join(parts)

    def rank(self, *, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Megatron's default order: TP fastest, then DP, then PP."""
        return tp + self.tp * (dp + self.dp * pp)


def selective_recompute_applies(backend: str, schedule: str, *, planned: bool = False) -> bool:
    """Whether Megatron's selective recompute does something: Megatron's own attention module
    (backend megatron) on the stock schedule (Oases recomputes whole layers), without a per-block
    plan."""
    return record(backend).megatron_modules and schedule == "default" and not planned


def check(model: GPTShape, strategy: Strategy, world_size: int) -> None:
    """Validate the split; one line naming the whole product."""
    s, m = strategy, model
    if s.world_size != world_size:
        raise SimError(f"TP {s.tp} x PP {s.pp} x DP {s.dp} = {s.world_size} != {world_size} GPUs")
    if s.first_stage_layers or s.last_stage_layers:
        if s.pp < 2 or s.virtual_stages > 1 or s.block_degrees is not None:
            raise SimError("uneven first / last pipeline stages need PP > 1, no virtual stages and no --oases-plan")
        stage_layer_counts(m, s)
    elif m.num_layers % s.pp:
        raise SimError(f"{m.num_layers} layers are not divisible by PP {s.pp}")
    if s.virtual_stages > 1:
        if s.pp == 1 or s.pipeline_schedule != "1f1b":
            raise SimError(f"virtual stages {s.virtual_stages} need the 1f1b schedule with PP > 1 (interleaved)")
        if m.num_layers % (s.pp * s.virtual_stages):
            raise SimError(f"{m.num_layers} layers are not divisible by PP {s.pp} x virtual stages "
                           f"{s.virtual_stages}")
        if s.num_microbatches % s.pp:
            raise SimError(f"interleaved 1F1B needs micro-batches ({s.num_microbatches}) to be a multiple "
                           f"of PP {s.pp}")
    if s.oases_runs and split_refusal(m.micro_batch_size):  # at TP 1 (dense) nothing splits
        raise SimError(split_refusal(m.micro_batch_size))
    if s.schedule == "oases" and not record(s.backend).oases_tape:
        taped = " and ".join(name for name in BACKENDS if record(name).oases_tape)
        raise SimError(f"--schedule oases runs the {taped} TP backends (the runtime has no Oases "
                       f"tape for {s.backend}); use --schedule default with backend {s.backend}")
    if m.hidden_size % s.tp or m.num_attention_heads % s.tp or m.ffn_hidden_size % s.tp or m.padded_vocab_size % s.tp:
        raise SimError(f"hidden {m.hidden_size}, heads {m.num_attention_heads}, ffn {m.ffn_hidden_size}, "
                       f"vocab {m.padded_vocab_size} must be divisible by TP {s.tp}")
    if s.sequence_parallel and sequence_parallel_refusal(s.tp, m.seq_length):  # the trainer's check
        raise SimError(sequence_parallel_refusal(s.tp, m.seq_length))
    # the backend's own split (the trainer's and the planner's rule, in their words); under a plan
    # the key/value groups divide by each attention block's degree instead (plan.graph)
    groups = None if s.block_degrees is not None else m.variant.query_groups or m.num_attention_heads
    refused = record(s.backend).refusal(tp=s.tp, layout=s.layout, hidden=m.hidden_size, heads=m.num_attention_heads,
                                        ffn=m.ffn_hidden_size, micro_batch=m.micro_batch_size, query_groups=groups)
    if refused:
        raise SimError(refused)
    if s.block_degrees is not None:
        _check_plan(m, s)
    moe_check(m, s)


def stage_layer_counts(m: GPTShape, s: Strategy) -> tuple[int, ...]:
    """Layers per model chunk of each stage: an even split, or Megatron-Core's uneven first / last
    stage (``first_stage_layers`` / ``last_stage_layers``) with the rest split evenly."""
    per = m.num_layers // (s.pp * s.virtual_stages)
    if not (s.first_stage_layers or s.last_stage_layers):
        return (per,) * s.pp
    first, last = s.first_stage_layers, s.last_stage_layers
    middle = s.pp - (1 if first else 0) - (1 if last else 0)
    rest = m.num_layers - first - last
    if rest < 0 or (middle and (rest % middle or rest // middle < 1)) or (not middle and rest):
        raise SimError(f"{m.num_layers} layers do not split as first {first or 'even'}, last {last or 'even'} "
                       f"and the rest evenly over {middle} stages of PP {s.pp}")
    even = rest // middle if middle else 0
    counts = [even] * s.pp
    if first:
        counts[0] = first
    if last:
        counts[-1] = last
    if min(counts) < 1:
        raise SimError(f"every pipeline stage needs a layer (counts {counts})")
    return tuple(counts)


def _check_plan(m: GPTShape, s: Strategy) -> None:
    """A plan's block count and the batch split of each degree (replicas, then Oases sub-batches)."""
    if len(s.block_degrees) != 2 * m.num_layers:
        raise SimError(f"--oases-plan has {len(s.block_degrees)} block degrees; {m.num_layers} layers need "
                       f"{2 * m.num_layers} (attention, mlp per layer)")
    for d in set(s.block_degrees):
        need = s.tp // d * block_sub_batches(s, d)
        if m.micro_batch_size % need:
            raise SimError(f"--oases-plan: degree-{d} blocks split the micro-batch {m.micro_batch_size} into {need} "
                           f"(replicas x sub-batches); --micro-batch-size must be a multiple of {need}")


def block_sub_batches(s: Strategy, degree: int | None = None) -> int:
    """Sub-batches of the Oases split a block at ``degree`` runs (``describe.split.sub_batches_at``;
    None: the stage's whole TP group ``s.tp``, no plan); the timeline runs them as that many chains."""
    return sub_batches_at(s.tp if degree is None else degree, oases=s.schedule == "oases", expert_parallel=s.ep)
