"""The Oases planner's model graph (paper §4.1): blocks, and the strategies a block can take.

A block is one computation sequence plus the communication op that ends it. Megatron's 1-D TP
layer (``describe/megatron_1d.py``) is ``[LN, QKV, core, proj] g [LN, fc1, act, fc2] g``, so one
TransformerLayer is **two blocks**: attention and MLP. (Table 6 of the paper lists one degree per
layer; ``granularity="layer"`` ties a layer's two blocks to one strategy to reproduce that.)

Strategies. The TP group has ``T`` ranks (``--tensor-model-parallel-size``). A block at degree
``d`` (a power of two dividing ``T``) runs as ``T / d`` replicas of a ``d``-way TP block, each on
``d`` consecutive ranks and on ``d / T`` of the micro-batch; so per rank its GEMM FLOPs equal the
degree-``T`` block's, its all-reduce moves ``d / T`` of the bytes on a smaller (often faster)
group, and it holds ``T / d`` times the weights. The cost model only sees ``BlockStrategy`` objects:
a family (``megatron`` 1-D; ``atp``, ATP's 2-D mesh ``d1 x d2 = T`` over the whole TP group,
every divisor pair, d2 = 1 too: ``describe/atp_meshes.py``, :func:`_atp_layouts`)
that describes the layer on its share of the batch, splits it into the two blocks, names the
group ranks of each collective axis, reshards between two strategies and counts parameters and
saved bytes. A family the runtime cannot place next to another (``mixes=False``: ATP layers run
as a whole-model backend, ``--tp-backend atp``) gets infinite edges to every other strategy, so
a plan either uses it for every block or not at all.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from megatron_oases.describe.atp_2d import atp_layout
from megatron_oases.describe.atp_meshes import atp_meshes
from megatron_oases.describe.backends import BACKENDS, backend
from megatron_oases.describe.layer_query import LayerQuery
from megatron_oases.describe.layout import Layout
from megatron_oases.describe.ops import Collective, Compute, LayerDescription, ModelingError
from megatron_oases.describe.plan_degrees import degree_refusal, micro_batch_multiple, plan_degrees
from megatron_oases.describe.split import split_refusal
from megatron_oases.describe.planned import degree_reshard, split_at
from megatron_oases.describe.registry import (axis_ranks, block_edges, block_param_tensors, layer_activation_bytes,
                                                layer_input_bytes, layer_param_tensors)

from .memory import block_activation_bytes, block_memory, recomputed_block_bytes
from .model import BLOCK_KINDS, DTYPES, PlanError, PlanModel, model_from_mapping  # noqa: F401
from .moe_blocks import MOE_KIND, moe_plan_refusal

# ---- strategies --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockStrategy:
    """How one block is partitioned inside the TP group of ``T`` ranks."""

    degree: int
    """Ranks that shard one replica of the block; ``T / degree`` replicas split the batch."""
    family: str = "megatron"
    """A backend record (``describe.backends``): megatron (1-D TP at any degree) | atp | 3d."""
    layout: Layout | None = None
    """The record's layout of the ``degree`` ranks (ATP's ``{"d1": 4, "d2": 2}``; None: the
    record's at that degree)."""

    @property
    def label(self) -> str:
        """``tp4`` for a per-block degree; else the family and its layout's label (``atp4x2``,
        ``3d8``): the names plan files store (:func:`strategy_of_label` reads them back)."""
        rec = backend(self.family)
        if rec.per_block_plans:
            return f"tp{self.degree}"
        return f"{self.family}{rec.label(self.layout, self.degree)}"

    def replicas(self, tp: int) -> int:
        return tp // self.degree


def strategy_of_label(label: str) -> BlockStrategy | None:
    """The strategy a :attr:`BlockStrategy.label` names (``tp4``, ``atp4x2``, ``3d8``), None if
    the label is not one (the record reads its layout's part: ``Backend.layout_of_label``)."""
    if label.startswith("tp") and label[2:].isdigit():
        return BlockStrategy(degree=int(label[2:]))
    for name, rec in BACKENDS.items():
        layout = (rec.layout_of_label(label[len(name):])
                  if not rec.per_block_plans and label.startswith(name) else None)
        if layout is not None:
            return BlockStrategy(degree=layout.size, family=name, layout=layout)
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockOps:
    """One block of a layer description: its forward and backward compute and collectives."""

    kind: str
    fwd_compute: tuple[Compute, ...]
    fwd_comm: tuple[Collective, ...]
    bwd_compute: tuple[Compute, ...]
    bwd_comm: tuple[Collective, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reshard:
    """Collectives that convert one block's output layout into the next block's input layout."""

    forward: Collective | None
    backward: Collective | None
    ranks_forward: tuple[int, ...] = ()
    ranks_backward: tuple[int, ...] = ()
    more_forward: tuple[tuple[Collective, tuple[int, ...]], ...] = ()
    """Further (collective, ranks) steps after ``forward`` (3-D leaves the cube in three)."""
    more_backward: tuple[tuple[Collective, tuple[int, ...]], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """What a strategy family must provide to the cost model."""

    describe: Callable[[BlockStrategy, PlanModel, int], LayerDescription]
    """(strategy, model, samples per replica) -> the layer as one replica's rank runs it."""
    group_ranks: Callable[[BlockStrategy, str], tuple[int, ...]]
    """(strategy, collective axis) -> the ranks of the group containing TP rank 0."""
    reshard: Callable[[BlockStrategy, BlockStrategy, PlanModel], Reshard]
    """(src, dst, model) -> the collectives of one sub-batch between a src and a dst block."""
    params: Callable[[BlockStrategy, PlanModel, str], int]
    """(strategy, model, block kind) -> parameters of the block on one rank."""
    memory: Callable[[BlockStrategy, PlanModel, str, int], tuple[float, float]]
    """(strategy, model, block kind, samples of the replica) -> (saved bytes per micro-batch,
    backward working set)."""
    split: Callable[[LayerDescription], list["BlockOps"]] = None  # type: ignore[assignment]
    """The layer description -> its attention and MLP blocks (default ``split_blocks``)."""
    mixes: bool = True
    """Whether the runtime can put this family's blocks next to another strategy's."""
    layouts: Callable[[int], tuple[Layout, ...]] | None = None
    """(TP size) -> the layouts the planner offers (None: the record's, ``Backend.layouts``)."""


def describe_layer(s: BlockStrategy, m: PlanModel, samples: int) -> LayerDescription:
    """The layer of ``s``'s backend record (``describe.backends``) on one replica's ``samples``;
    under Oases (``sub_batches`` > 1) Megatron's tape keeps the gathered column inputs."""
    return backend(s.family).layer(LayerQuery(
        layout=s.layout, micro_batch=samples, seq=m.seq_length, hidden=m.hidden_size, heads=m.num_attention_heads,
        ffn=m.ffn_hidden_size, tp=s.degree, bytes_per_element=m.bytes_per_element, variant=m.variant,
        sequence_parallel=m.sequence_parallel, schedule="oases" if m.sub_batches > 1 else "stock",
        attention_dropout=m.attention_dropout > 0, hidden_dropout=m.hidden_dropout > 0,
        core_attention=m.core_attention, recompute_core_attention=m.selective_recompute))


def _megatron_ranks(s: BlockStrategy, axis: str) -> tuple[int, ...]:
    if axis != "tp":
        raise PlanError(f"strategy {s.label}: unknown collective axis {axis!r}")
    return tuple(range(s.degree))


def _megatron_reshard(src: BlockStrategy, dst: BlockStrategy, m: PlanModel) -> Reshard:
    """The batch reshard between two degrees (``describe.planned.degree_reshard``): the whole
    micro-batch share at once, as the runtime runs it outside the Oases executor."""
    r = degree_reshard(src.degree, dst.degree, tp=m.tp, micro_batch=m.micro_batch_size, seq=m.seq_length,
                       hidden=m.hidden_size, bytes_per_element=m.bytes_per_element)
    return Reshard(forward=r.forward, backward=r.backward, ranks_forward=r.ranks if r.forward else (),
                   ranks_backward=r.ranks if r.backward else ())


def block_params(s: BlockStrategy, m: PlanModel, kind: str) -> int:
    """Weights + biases + norm of one block on one rank: the family's layer parameters
    (``describe.registry.layer_param_tensors``) that belong to the block."""
    tensors = layer_param_tensors(s.family, m.hidden_size, m.ffn_hidden_size, s.degree, s.layout,
                                  heads=m.num_attention_heads, variant=m.variant)
    return sum(block_param_tensors(kind, tensors))


def _megatron_memory(s: BlockStrategy, m: PlanModel, kind: str, samples: int) -> tuple[float, float]:
    return block_memory(m, kind, samples, s.degree)


# ---- ATP (paper 004): the 2-D mesh d1 x d2 over the whole TP group ------------------------------

def _split_named(mlp_first: str | tuple[str, ...], attention_first_bwd: str | tuple[str, ...]) -> Callable[[LayerDescription], list["BlockOps"]]:
    """A split for layers with many small segments (ATP, 3-D: norm statistics, gathers): the
    attention block is everything before ``mlp_first`` (the pre-MLP norm, forward) and from
    ``attention_first_bwd`` (the proj backward) on."""
    def split(desc: LayerDescription) -> list[BlockOps]:
        attn_f, mlp_f = split_at(desc.forward, mlp_first)
        mlp_b, attn_b = split_at(desc.backward, attention_first_bwd)
        return [block_ops("attention", attn_f, attn_b), block_ops("mlp", mlp_f, mlp_b)]

    return split


def block_ops(kind: str, ops_f, ops_b) -> BlockOps:
    """A block of kind ``kind`` from its forward and backward ops, in order."""
    return BlockOps(kind=kind, fwd_compute=tuple(o for o in ops_f if isinstance(o, Compute)),
                    fwd_comm=tuple(o for o in ops_f if isinstance(o, Collective)),
                    bwd_compute=tuple(o for o in ops_b if isinstance(o, Compute)),
                    bwd_comm=tuple(o for o in ops_b if isinstance(o, Collective)))




def _whole_group_ranks(s: BlockStrategy, axis: str) -> tuple[int, ...]:
    """TP rank 0's group on a mesh axis or a line of the cube, as the simulator places it
    (``describe.registry.axis_ranks``)."""
    try:
        return axis_ranks(axis, tuple(range(s.degree)), s.layout)
    except ModelingError:
        raise PlanError(f"strategy {s.label}: unknown collective axis {axis!r}") from None


def _edge_reshard(src: BlockStrategy, dst: BlockStrategy, m: PlanModel) -> Reshard:
    """A whole-group backend (ATP, 3-D) converts at the edges of its run of layers
    (``describe.registry.block_edges``, one sub-batch): ATP keeps ``[s, b, h/d2]`` and leaving
    all-gathers over axis 2 (entering splits, its backward all-gathers); the cube leaves with
    all-gathers in z, y and x. Only edges to the degree-T embedding / logits and between equal
    strategies are used (``mixes=False``)."""
    if src == dst:
        return Reshard(forward=None, backward=None)
    edge = src if not family_of(src).mixes else dst
    leave, enter_b = block_edges(backend=edge.family, layout=edge.layout, micro_batch=m.micro_batch_size // m.sub_batches,
                                 seq=m.seq_length, hidden=m.hidden_size, tp=edge.degree,
                                 bytes_per_element=m.bytes_per_element)
    steps = tuple((op, _whole_group_ranks(edge, op.axis)) for op in (leave if src is edge else enter_b))
    if not steps:
        return Reshard(forward=None, backward=None)
    (first, first_ranks), rest = steps[0], steps[1:]
    if src is edge:
        return Reshard(forward=first, backward=None, ranks_forward=first_ranks, more_forward=rest)
    return Reshard(forward=None, backward=first, ranks_backward=first_ranks, more_backward=rest)


def _saved_flags(m: PlanModel) -> dict:
    """What a layer's saved bytes depend on beyond its sizes, as the simulator passes it
    (``sim.core.memory``): the dropout masks only where the dropout is on, the core attention's kind
    (``GPTShape.core_attention``: no s x s tensor under a fused kernel) and the variant."""
    return {"hidden_dropout": m.hidden_dropout > 0, "attention_dropout": m.attention_dropout > 0,
            "core_attention": m.core_attention, "variant": m.variant}


def _atp_memory(s: BlockStrategy, m: PlanModel, kind: str, samples: int) -> tuple[float, float]:
    """Hidden states are ``[s, b, h/d2]``. Full recompute keeps the layer input
    (``memory.recomputed_block_bytes``); the Oases fine-grained one keeps the block input and the
    outputs of its forward collectives (attention: QKV sum 3h/d1, gathered context h/d1, proj sum
    h/d2; MLP: fc1 sum f/d1, fc2 sum h/d2); without recompute the block's share of ATP's full
    activations (``describe.registry.layer_activation_bytes``, split in proportion to Megatron's)."""
    d1, d2 = s.layout["d1"], s.layout["d2"]
    e, h, f, tok = m.bytes_per_element, m.hidden_size, m.ffn_hidden_size, samples * m.seq_length
    layer = layer_activation_bytes(s.family, b=samples, s=m.seq_length, h=h, a=m.num_attention_heads, f=f,
                                   t=s.degree, e=e, layout=s.layout, **_saved_flags(m))
    both = {k: block_activation_bytes(m, k, samples, s.degree) for k in ("attention", "mlp")}
    full = layer * both[kind] / sum(both.values())
    grads = 2 * e * tok * h / d2
    if not m.recompute:
        return full, grads
    if not m.fine_grained:  # the layer input, as a rank holds it
        block_input = layer_input_bytes(s.family, b=samples, s=m.seq_length, h=h, e=e, t=s.degree, layout=s.layout)
        return recomputed_block_bytes(m, kind, block_input, s.degree), full + grads
    qkv, fc1 = m.variant.qkv_rows(h, m.num_attention_heads), m.variant.fc1_rows(f)
    saved = e * tok * ((h / d2 + qkv / d1 + h / d1 + h / d2) if kind == "attention" else (fc1 / d1 + h / d2))
    return saved, full + grads


# ---- any other whole-group backend (the 3-D cube p x p x p = T, paper 002) -----------------------

def _whole_group_memory(s: BlockStrategy, m: PlanModel, kind: str, samples: int) -> tuple[float, float]:
    """The record's saved bytes (``layer_activation_bytes``), split between the blocks in
    proportion to Megatron's; with recompute the layer keeps its input as a rank holds it
    (``layer_input_bytes``: the cube's own block, 1/T; ``memory.recomputed_block_bytes``) and runs
    the stock executor's full recompute; backward's working set adds two such hidden states."""
    kw = dict(b=samples, s=m.seq_length, h=m.hidden_size, e=m.bytes_per_element, layout=s.layout)
    layer = layer_activation_bytes(s.family, a=m.num_attention_heads, f=m.ffn_hidden_size, t=s.degree,
                                   **kw, **_saved_flags(m))
    both = {k: block_activation_bytes(m, k, samples, 1) for k in ("attention", "mlp")}
    full = layer * both[kind] / sum(both.values())
    block_input = layer_input_bytes(s.family, t=s.degree, **kw)
    if not m.recompute:
        return full, 2 * block_input
    return recomputed_block_bytes(m, kind, block_input, s.degree), full + 2 * block_input


def _atp_layouts(tp: int) -> tuple[Layout, ...]:
    """Every mesh d1 x d2 = T, d2 = 1 too (``atp_meshes(with_1d=True)``): ``--tp-backend atp
    --atp-mesh T,1`` runs ATP's layers, whose norms keep more than Megatron's
    (``describe.saved.mesh_norm_bytes``), so the megatron family's degree-T strategy is not that
    launch; offered, an ATP plan prices the layer it trains (its record's saved bytes and
    collectives). The simulator's search leaves d2 = 1 to its megatron backend
    (``Backend.layouts``)."""
    return tuple(atp_layout(d1, d2) for d1, d2 in atp_meshes(tp, with_1d=True))


def _whole_group_family(name: str) -> Family:
    """The planner's pricing of a record without its own entry in ``FAMILIES``: its layer over
    the whole TP group, entered and left at its block edges, cut into blocks where its record
    says (``Backend.block_split``), with :func:`_whole_group_memory`."""
    return Family(describe=describe_layer, group_ranks=_whole_group_ranks, reshard=_edge_reshard,
                  params=block_params, memory=_whole_group_memory,
                  split=_split_named(*backend(name).block_split), mixes=False)


FAMILIES: dict[str, Family] = {
    "megatron": Family(describe=describe_layer, group_ranks=_megatron_ranks, reshard=_megatron_reshard,
                       params=block_params, memory=_megatron_memory,
                       split=_split_named(*backend("megatron").block_split)),
    "atp": Family(describe=describe_layer, group_ranks=_whole_group_ranks, reshard=_edge_reshard,
                  params=block_params, memory=_atp_memory, split=_split_named(*backend("atp").block_split),
                  mixes=False, layouts=_atp_layouts),
}
"""The planner's own pricing of some records' layers (``describe.backends``): Megatron's per-block
degrees and their reshards, ATP's fine-grained recompute. The families offered are the records
(:func:`family_names`); a record without an entry here is priced as a whole-group backend
(:func:`_whole_group_family`: the 3-D cube, a new backend)."""


def family_of(s: BlockStrategy) -> Family:
    if s.family in FAMILIES:
        return FAMILIES[s.family]
    if s.family in BACKENDS:
        return _whole_group_family(s.family)
    raise PlanError(f"strategy family {s.family!r} is not supported by the planner "
                    f"(known: {', '.join(BACKENDS)})")


def split_blocks(desc: LayerDescription) -> list[BlockOps]:
    """Blocks of a layer: each compute segment (local work between collectives) opens a block and
    the collectives after it end it (at TP 1 a block has none).
    Backward runs the blocks in reverse; block i's backward is matched to forward block i."""
    def runs(ops) -> list[tuple[list[Compute], list[Collective]]]:
        out: list[tuple[list[Compute], list[Collective]]] = []
        for op in ops:
            if isinstance(op, Compute):
                out.append(([op], []))
            else:
                if not out:
                    raise PlanError(f"{desc.backend} layer description starts with collective {op.name!r}")
                out[-1][1].append(op)
        return out

    fwd, bwd = runs(desc.forward), runs(desc.backward)[::-1]
    if len(fwd) != len(BLOCK_KINDS) or len(bwd) != len(fwd):
        raise PlanError(f"{desc.backend} layer description has {len(fwd)} forward / {len(bwd)} backward "
                        f"blocks; the planner expects {len(BLOCK_KINDS)} ({', '.join(BLOCK_KINDS)})")
    return [BlockOps(kind=k, fwd_compute=tuple(fc), fwd_comm=tuple(fm), bwd_compute=tuple(bc), bwd_comm=tuple(bm))
            for k, (fc, fm), (bc, bm) in zip(BLOCK_KINDS, fwd, bwd)]


def feasible(s: BlockStrategy, m: PlanModel) -> str:
    """Why ``s`` cannot run ``m`` (empty string: it can): the backend record's divisibility check
    (``describe.backends``), the Oases split (``describe.split``), and where its blocks run."""
    if family_of(s).mixes:
        return _megatron_feasible(s, m)
    refused = backend(s.family).layout_refusal(s.layout, m.tp)  # the layout's own rule (ATP: d1 x d2 = T)
    if refused:
        return refused
    if s.degree != m.tp:
        return f"a {s.family} block covers the whole TP group: degree {s.degree} must be T={m.tp}"
    refused = backend(s.family).run_refusal(_run_flags(m))  # the trainer's words (train_args.validate_layout)
    if refused:
        return refused
    refused = _record_refusal(s, m, query_groups=m.variant.query_groups)
    if refused:
        return refused
    if m.selective_recompute and not backend(s.family).megatron_modules:  # train_args.check_selective_recompute
        return (f"--recompute-granularity selective checkpoints Megatron's core attention, which --tp-backend "
                f"{s.family} does not run: plan with --recompute-granularity full or none")
    if m.sub_batches > 1 and not backend(s.family).oases_tape:
        return f"--tp-backend {s.family} runs the stock executor (no Oases tape): plan with --schedule default"
    return split_refusal(m.micro_batch_size, m.sub_batches)  # describe.split


def _run_flags(m: PlanModel):
    """The trainer's config with ``m``'s flags that a record's ``run_refusal`` reads (sequence
    parallelism, SwiGLU, linear biases), the rest at the trainer's defaults."""
    from megatron_oases.run_config import DEFAULTS

    return dataclasses.replace(DEFAULTS, sequence_parallel=m.sequence_parallel, swiglu=m.variant.gated,
                               add_bias_linear=m.variant.bias)


def _megatron_feasible(s: BlockStrategy, m: PlanModel) -> str:
    """A Megatron 1-D block at a degree dividing T, on its replica's share of the micro-batch
    (its key/value groups: :func:`attention_fits`, attention blocks only)."""
    d = s.degree
    refused = degree_refusal(d, m.tp) or _record_refusal(s, m, query_groups=None)  # describe.plan_degrees
    if refused:
        return refused
    need, _ = micro_batch_multiple((d,), tp=m.tp, oases=m.sub_batches > 1)
    if m.micro_batch_size % need:
        share = m.micro_batch_size * d / m.tp
        if share != int(share):
            return f"micro-batch {m.micro_batch_size} does not split over {m.tp // d} replicas"
        return f"a replica's {int(share)} sample(s) do not split into {m.sub_batches} sub-batches"
    return ""


def _record_refusal(s: BlockStrategy, m: PlanModel, *, query_groups: int | None) -> str:
    """The record's one divisibility check for ``m`` at ``s``'s degree and layout."""
    return backend(s.family).refusal(tp=s.degree, layout=s.layout, hidden=m.hidden_size, heads=m.num_attention_heads,
                                     ffn=m.ffn_hidden_size, micro_batch=m.micro_batch_size, query_groups=query_groups)


def family_layouts(name: str, tp: int) -> tuple[Layout, ...]:
    """The layouts the planner offers family ``name`` at TP ``tp`` (``Family.layouts``, else its
    record's ``Backend.layouts``); a plan file naming another is refused (``plan_file``)."""
    return (family_of(BlockStrategy(degree=tp, family=name)).layouts or backend(name).layouts)(tp)


def family_names() -> tuple[str, ...]:
    """The strategy families: one per backend record (``describe.backends.BACKENDS``), read when
    asked so that a new row is offered without an edit here."""
    return tuple(BACKENDS)


def attention_fits(s: BlockStrategy, m: PlanModel) -> bool:
    """Whether ``s`` can run an attention block: Megatron's attention gives each rank whole
    key/value groups, so a block's degree must divide them (GQA)."""
    return m.num_query_groups % backend(s.family).kv_groups_divisor(s.degree, s.layout) == 0


def candidate_strategies(m: PlanModel, degrees: tuple[int, ...] | None = None,
                         families: tuple[str, ...] = ("megatron",)) -> list[BlockStrategy]:
    """Megatron 1-D at each power-of-two degree up to T that can run the model (ascending;
    ``degrees`` restricts them), then for each other family asked, in the records' order, every
    layout its record offers at T that can (``Backend.layouts``: for ATP every mesh d1 x d2 = T,
    ``describe.atp_meshes.atp_meshes``, d2 = 1 too: ATP's layers there are not Megatron's,
    :func:`_atp_layouts`; the cube)."""
    known = family_names()
    bad = [f for f in families if f not in known]
    if bad:
        raise PlanError(f"--families: unknown family {bad[0]!r} (known: {', '.join(known)})")
    refused = moe_plan_refusal(m, families=families, degrees=degrees)  # what the trainer runs for MoE
    if refused:
        raise PlanError(refused)
    out = []
    why = ""  # the first reason a family's layout was left out, for the refusal below
    for name in known:
        if name in families and backend(name).per_block_plans:
            out += _megatron_candidates(m, degrees, name)
    for name in known:
        if name in families and not backend(name).per_block_plans:
            layouts = [BlockStrategy(degree=m.tp, family=name, layout=x) for x in family_layouts(name, m.tp)]
            if not layouts:
                why = why or f"{name} has no layout at --tensor-model-parallel-size {m.tp}"
            for s in layouts:
                refused = feasible(s, m)
                if refused:
                    why = why or refused
                else:
                    out.append(s)
    if not out:
        raise PlanError(f"no block strategy of --families {','.join(families)} can run this model"
                        + (f": {why}; or add megatron" if why else "; add megatron or raise --micro-batch-size"))
    return out


def _megatron_candidates(m: PlanModel, degrees: tuple[int, ...] | None, family: str) -> list[BlockStrategy]:
    """Per-block degrees are powers of two dividing T (the runtime's degree groups and plan files
    hold only those), so this family needs T itself a power of two; ATP and 3-D do not."""
    if m.tp & (m.tp - 1):
        raise PlanError(f"--tensor-model-parallel-size {m.tp} must be a power of two for the planner's "
                        "megatron family (block degrees are powers of two dividing it); plan --families atp")
    all_d = list(plan_degrees(m.tp))  # describe.plan_degrees
    if degrees:
        bad = [d for d in degrees if d not in all_d]
        if bad:
            raise PlanError(f"--degrees {','.join(map(str, bad))}: each must be a power of two dividing "
                            f"--tensor-model-parallel-size {m.tp} (one of {','.join(map(str, all_d))})")
        all_d = sorted(set(degrees))
    if m.sequence_parallel:  # the runtime runs SP at the uniform degree T only
        if degrees and m.tp not in degrees:
            raise PlanError(f"--sequence-parallel is priced at the uniform degree {m.tp} only; "
                            f"drop --degrees or include {m.tp}")
        all_d = [m.tp]
    offered = [BlockStrategy(degree=d, family=family) for d in all_d]
    out = [s for s in offered if not feasible(s, m)]
    if not out:
        why = "; ".join(f"{s.label}: {feasible(s, m)}" for s in offered)
        raise PlanError(f"no block strategy can run this model ({why}); raise --micro-batch-size")
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    """One node of the model graph."""

    index: int
    layer: int
    kind: str

    @property
    def name(self) -> str:
        return f"{self.layer}.{self.kind}"


def build_graph(m: PlanModel) -> list[Block]:
    """The chain of blocks: layer 0 attention, layer 0 mlp, layer 1 attention, ...; an MoE layer's
    second block is ``moe`` (``--moe-layer-freq``: ``PlanModel.is_moe_block``)."""
    return [Block(index=i, layer=i // len(BLOCK_KINDS),
                  kind=MOE_KIND if m.is_moe_block(i) else BLOCK_KINDS[i % len(BLOCK_KINDS)])
            for i in range(m.num_blocks)]
