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
every divisor pair: ``describe/atp_meshes.py``)
that describes the layer on its share of the batch, splits it into the two blocks, names the
group ranks of each collective axis, reshards between two strategies and counts parameters and
saved bytes. A family the runtime cannot place next to another (``mixes=False``: ATP layers run
as a whole-model backend, ``--tp-backend atp``) gets infinite edges to every other strategy, so
a plan either uses it for every block or not at all.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from megatron_oases.describe.atp_2d import atp_2d_gpt_layer
from megatron_oases.describe.atp_meshes import atp_mesh_refusal, atp_meshes
from megatron_oases.describe.cube_3d import cube_3d_gpt_layer, cube_side
from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
from megatron_oases.describe.ops import Collective, Compute, LayerDescription, ModelingError
from megatron_oases.describe.split import split_refusal, sub_batches_at
from megatron_oases.describe.planned import ATTENTION_FIRST_BWD, MLP_FIRST, degree_reshard, split_at
from megatron_oases.describe.registry import (axis_ranks, block_edges, block_param_tensors, layer_activation_bytes,
                                                layer_param_tensors)

from .memory import block_activation_bytes, block_memory
from .model import BLOCK_KINDS, DTYPES, PlanError, PlanModel, model_from_mapping  # noqa: F401

# ---- strategies --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockStrategy:
    """How one block is partitioned inside the TP group of ``T`` ranks."""

    degree: int
    """Ranks that shard one replica of the block; ``T / degree`` replicas split the batch."""
    family: str = "megatron"
    """megatron (1-D TP) | atp (``mesh`` = (d1, d2), d1 x d2 = degree)."""
    mesh: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        if self.family == "megatron":
            return f"tp{self.degree}"
        return f"{self.family}{'x'.join(map(str, self.mesh or (self.degree,)))}"

    def replicas(self, tp: int) -> int:
        return tp // self.degree


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


def _megatron_describe(s: BlockStrategy, m: PlanModel, samples: int) -> LayerDescription:
    return megatron_1d_gpt_layer(micro_batch=samples, seq=m.seq_length, hidden=m.hidden_size,
                                 heads=m.num_attention_heads, ffn=m.ffn_hidden_size, tp=s.degree,
                                 bytes_per_element=m.bytes_per_element, variant=m.variant,
                                 sequence_parallel=m.sequence_parallel, keeps_gathered_input=m.sub_batches > 1,
                                 attention_dropout=m.attention_dropout > 0, hidden_dropout=m.hidden_dropout > 0,
                                 core_attention=m.core_attention)


def _megatron_ranks(s: BlockStrategy, axis: str) -> tuple[int, ...]:
    if axis != "tp":
        raise PlanError(f"strategy {s.label}: unknown collective axis {axis!r}")
    return tuple(range(s.degree))


def _megatron_reshard(src: BlockStrategy, dst: BlockStrategy, m: PlanModel) -> Reshard:
    """The batch reshard between two degrees (``describe.planned.degree_reshard``), per sub-batch."""
    r = degree_reshard(src.degree, dst.degree, tp=m.tp, micro_batch=m.micro_batch_size, seq=m.seq_length,
                       hidden=m.hidden_size, bytes_per_element=m.bytes_per_element, sub_batches=m.sub_batches)
    return Reshard(forward=r.forward, backward=r.backward, ranks_forward=r.ranks if r.forward else (),
                   ranks_backward=r.ranks if r.backward else ())


def block_params(s: BlockStrategy, m: PlanModel, kind: str) -> int:
    """Weights + biases + norm of one block on one rank: the family's layer parameters
    (``describe.registry.layer_param_tensors``) that belong to the block."""
    mesh = s.mesh if s.family == "atp" else None
    tensors = layer_param_tensors(s.family, m.hidden_size, m.ffn_hidden_size, s.degree, mesh,
                                  heads=m.num_attention_heads, variant=m.variant)
    return sum(block_param_tensors(kind, tensors))


def _megatron_memory(s: BlockStrategy, m: PlanModel, kind: str, samples: int) -> tuple[float, float]:
    return block_memory(m, kind, samples, s.degree)


# ---- ATP (paper 004): the 2-D mesh d1 x d2 over the whole TP group ------------------------------

def _atp_describe(s: BlockStrategy, m: PlanModel, samples: int) -> LayerDescription:
    d1, d2 = s.mesh
    return atp_2d_gpt_layer(micro_batch=samples, seq=m.seq_length, hidden=m.hidden_size,
                            heads=m.num_attention_heads, ffn=m.ffn_hidden_size, d1=d1, d2=d2,
                            bytes_per_element=m.bytes_per_element, variant=m.variant)


def _split_named(mlp_first: str | tuple[str, ...], attention_first_bwd: str | tuple[str, ...]) -> Callable[[LayerDescription], list["BlockOps"]]:
    """A split for layers with many small segments (ATP, 3-D: norm statistics, gathers): the
    attention block is everything before ``mlp_first`` (the pre-MLP norm, forward) and from
    ``attention_first_bwd`` (the proj backward) on."""
    def block(kind, ops_f, ops_b):
        return BlockOps(kind=kind, fwd_compute=tuple(o for o in ops_f if isinstance(o, Compute)),
                        fwd_comm=tuple(o for o in ops_f if isinstance(o, Collective)),
                        bwd_compute=tuple(o for o in ops_b if isinstance(o, Compute)),
                        bwd_comm=tuple(o for o in ops_b if isinstance(o, Collective)))

    def split(desc: LayerDescription) -> list[BlockOps]:
        attn_f, mlp_f = split_at(desc.forward, mlp_first)
        mlp_b, attn_b = split_at(desc.backward, attention_first_bwd)
        return [block("attention", attn_f, attn_b), block("mlp", mlp_f, mlp_b)]

    return split


_atp_split = _split_named("atp.ln2", "atp.proj.bwd")


def _atp_ranks(s: BlockStrategy, axis: str) -> tuple[int, ...]:
    """TP rank 0's group on a mesh axis, as the simulator places it (``describe.registry.axis_ranks``)."""
    try:
        return axis_ranks(axis, tuple(range(s.degree)), s.mesh)
    except ModelingError:
        raise PlanError(f"strategy {s.label}: unknown collective axis {axis!r}") from None


def _atp_reshard(src: BlockStrategy, dst: BlockStrategy, m: PlanModel) -> Reshard:
    """ATP keeps ``[s, b, h/d2]`` between its layers and converts at the edges of its run of
    layers: entering splits (backward: all-gather over axis 2), leaving all-gathers over axis 2
    (backward: keep own chunk). Only edges to the degree-T embedding / logits and between equal
    meshes are used (``mixes=False``)."""
    if src == dst:
        return Reshard(forward=None, backward=None)
    atp = src if src.family == "atp" else dst
    d2 = atp.mesh[1]
    if d2 == 1:
        return Reshard(forward=None, backward=None)
    payload = round(m.micro_batch_size / m.sub_batches * m.seq_length * m.hidden_size * m.bytes_per_element)
    op = Collective(name="atp.leave" if src is atp else "atp.enter.bwd", kind="all_gather", axis="mesh2",
                    group_size=d2, payload_bytes=payload)
    if src is atp:
        return Reshard(forward=op, backward=None, ranks_forward=tuple(range(d2)))
    return Reshard(forward=None, backward=op, ranks_backward=tuple(range(d2)))


def _saved_flags(m: PlanModel) -> dict:
    """What a layer's saved bytes depend on beyond its sizes, as the simulator passes it
    (``sim.memory``): the dropout masks only where the dropout is on, the core attention's kind
    (``GPTShape.core_attention``: no s x s tensor under a fused kernel) and the variant."""
    return {"hidden_dropout": m.hidden_dropout > 0, "attention_dropout": m.attention_dropout > 0,
            "core_attention": m.core_attention, "variant": m.variant}


def _atp_memory(s: BlockStrategy, m: PlanModel, kind: str, samples: int) -> tuple[float, float]:
    """Hidden states are ``[s, b, h/d2]``. Fine-grained recompute keeps the block input and the
    outputs of its forward collectives (attention: QKV sum 3h/d1, gathered context h/d1, proj sum
    h/d2; MLP: fc1 sum f/d1, fc2 sum h/d2); without recompute the block's share of ATP's full
    activations (``describe.registry.layer_activation_bytes``, split in proportion to Megatron's)."""
    d1, d2 = s.mesh
    e, h, f, tok = m.bytes_per_element, m.hidden_size, m.ffn_hidden_size, samples * m.seq_length
    layer = layer_activation_bytes("atp", b=samples, s=m.seq_length, h=h, a=m.num_attention_heads, f=f,
                                   t=s.degree, e=e, mesh=s.mesh, **_saved_flags(m))
    both = {k: block_activation_bytes(m, k, samples, s.degree) for k in ("attention", "mlp")}
    full = layer * both[kind] / sum(both.values())
    grads = 2 * e * tok * h / d2
    if not m.recompute:
        return full, grads
    qkv, fc1 = m.variant.qkv_rows(h, m.num_attention_heads), m.variant.fc1_rows(f)
    saved = e * tok * ((h / d2 + qkv / d1 + h / d1 + h / d2) if kind == "attention" else (fc1 / d1 + h / d2))
    return saved, full + grads


# ---- 3-D TP (paper 002): the cube p x p x p = T over the whole TP group ---------------------------

def _cube_describe(s: BlockStrategy, m: PlanModel, samples: int) -> LayerDescription:
    return cube_3d_gpt_layer(micro_batch=samples, seq=m.seq_length, hidden=m.hidden_size,
                             heads=m.num_attention_heads, ffn=m.ffn_hidden_size, tp=s.degree,
                             bytes_per_element=m.bytes_per_element, variant=m.variant)


def _cube_ranks(s: BlockStrategy, axis: str) -> tuple[int, ...]:
    """TP rank 0's line of the cube in a direction (``describe.registry.axis_ranks``)."""
    try:
        return axis_ranks(axis, tuple(range(s.degree)), None)
    except ModelingError:
        raise PlanError(f"strategy {s.label}: unknown collective axis {axis!r}") from None


def _cube_reshard(src: BlockStrategy, dst: BlockStrategy, m: PlanModel) -> Reshard:
    """The cube's block edges (``describe.registry.block_edges``): leaving all-gathers in z, y
    and x (forward); entering splits, whose backward gathers the same way."""
    if src == dst:
        return Reshard(forward=None, backward=None)
    cube = src if src.family == "3d" else dst
    leave, enter_b = block_edges(backend="3d", mesh=None, micro_batch=m.micro_batch_size // m.sub_batches,
                                 seq=m.seq_length, hidden=m.hidden_size, tp=cube.degree,
                                 bytes_per_element=m.bytes_per_element)
    steps = tuple((op, _cube_ranks(cube, op.axis)) for op in (leave if src is cube else enter_b))
    (first, first_ranks), rest = steps[0], steps[1:]
    if src is cube:
        return Reshard(forward=first, backward=None, ranks_forward=first_ranks, more_forward=rest)
    return Reshard(forward=None, backward=first, ranks_backward=first_ranks, more_backward=rest)


def _cube_memory(s: BlockStrategy, m: PlanModel, kind: str, samples: int) -> tuple[float, float]:
    """Every saved tensor is a rank's own block (1/T of the dense layer's); with recompute a block
    keeps its input block only (the cube runs the stock executor's full recompute)."""
    e, h, tok = m.bytes_per_element, m.hidden_size, samples * m.seq_length
    layer = layer_activation_bytes("3d", b=samples, s=m.seq_length, h=h, a=m.num_attention_heads,
                                   f=m.ffn_hidden_size, t=s.degree, e=e, mesh=None, **_saved_flags(m))
    both = {k: block_activation_bytes(m, k, samples, 1) for k in ("attention", "mlp")}
    full = layer * both[kind] / sum(both.values())
    grads = 2 * e * tok * h / s.degree
    if not m.recompute:
        return full, grads
    return e * tok * h / s.degree, full + grads


FAMILIES: dict[str, Family] = {
    "megatron": Family(describe=_megatron_describe, group_ranks=_megatron_ranks, reshard=_megatron_reshard,
                       params=block_params, memory=_megatron_memory,
                       split=_split_named(MLP_FIRST, ATTENTION_FIRST_BWD)),
    "atp": Family(describe=_atp_describe, group_ranks=_atp_ranks, reshard=_atp_reshard, params=block_params,
                  memory=_atp_memory, split=_atp_split, mixes=False),
    "3d": Family(describe=_cube_describe, group_ranks=_cube_ranks, reshard=_cube_reshard, params=block_params,
                 memory=_cube_memory, split=_split_named("3d.ln2", "3d.proj.bwd"), mixes=False),
}


def family_of(s: BlockStrategy) -> Family:
    try:
        return FAMILIES[s.family]
    except KeyError:
        raise PlanError(f"strategy family {s.family!r} is not supported by the planner yet "
                        f"(known: {', '.join(FAMILIES)})") from None


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
    """Why ``s`` cannot run ``m`` (empty string: it can)."""
    d = s.degree
    if s.family == "3d":
        try:
            p = cube_side(d)
        except ModelingError as e:
            return str(e)
        h, a, f = m.hidden_size, m.num_attention_heads, m.ffn_hidden_size
        if d != m.tp:
            return f"the cube {p}^3 must cover T={m.tp}"
        if m.sub_batches != 1:
            return "3-D TP runs the stock executor (no Oases tape): plan with --sub-batches 1"
        if m.micro_batch_size % (p * p) or h % (p * p) or f % (p * p) or a % p:
            return f"micro-batch {m.micro_batch_size}, hidden {h}, ffn {f} must divide by p^2 = {p * p}, heads {a} by p"
        return _describe_refuses(s, m)
    if s.family == "atp":
        refused = atp_mesh_refusal(s.mesh, m.tp)
        if refused or d != m.tp:
            return refused or f"an ATP block covers the whole TP group: degree {d} must be T={m.tp}"
        d1, d2 = s.mesh
        h, a, f = m.hidden_size, m.num_attention_heads, m.ffn_hidden_size
        if h % d or a % d or f % d1 or h % d2:
            return f"hidden {h} and heads {a} must divide by {d}, ffn {f} by {d1}"
        if split_refusal(m.micro_batch_size, m.sub_batches):  # describe.split
            return split_refusal(m.micro_batch_size, m.sub_batches)
        return _describe_refuses(s, m)
    if d < 1 or m.tp % d:
        return f"degree {d} does not divide T={m.tp}"
    if m.hidden_size % d or m.num_attention_heads % d or m.ffn_hidden_size % d:
        return f"hidden/heads/ffn not divisible by {d}"
    share = m.micro_batch_size * d
    if share % m.tp:
        return f"micro-batch {m.micro_batch_size} does not split over {m.tp // d} replicas"
    share //= m.tp
    if split_refusal(share, sub_batches_at(d, oases=m.sub_batches > 1)):  # describe.split
        return f"a replica's {share} sample(s) do not split into {m.sub_batches} sub-batches"
    return ""


def _describe_refuses(s: BlockStrategy, m: PlanModel) -> str:
    """What the family's description refuses for ``m`` (e.g. key/value groups a mesh or cube
    cannot split whole), or ""."""
    try:
        FAMILIES[s.family].describe(s, m, m.micro_batch_size)
    except ModelingError as e:
        return str(e)
    return ""


FAMILY_NAMES = ("megatron", "atp", "3d")


def attention_fits(s: BlockStrategy, m: PlanModel) -> bool:
    """Whether ``s`` can run an attention block: Megatron's attention gives each rank whole
    key/value groups, so a block's degree must divide them (GQA)."""
    return s.family != "megatron" or m.num_query_groups % s.degree == 0


def candidate_strategies(m: PlanModel, degrees: tuple[int, ...] | None = None,
                         families: tuple[str, ...] = ("megatron",)) -> list[BlockStrategy]:
    """Megatron 1-D at each power-of-two degree up to T that can run the model (ascending;
    ``degrees`` restricts them), then with ``"atp" in families`` every ATP mesh d1 x d2 = T
    that can (``describe.atp_meshes.atp_meshes``; d2 = 1 is the megatron family's layout)."""
    bad = [f for f in families if f not in FAMILY_NAMES]
    if bad:
        raise PlanError(f"--families: unknown family {bad[0]!r} (known: {', '.join(FAMILY_NAMES)})")
    out = _megatron_candidates(m, degrees) if "megatron" in families else []
    if "atp" in families:
        meshes = [BlockStrategy(degree=m.tp, family="atp", mesh=mesh) for mesh in atp_meshes(m.tp, with_1d=False)]
        out += [s for s in meshes if not feasible(s, m)]
    if "3d" in families and not feasible(cube := BlockStrategy(degree=m.tp, family="3d"), m):
        out.append(cube)
    if not out:
        raise PlanError(f"no block strategy of --families {','.join(families)} can run this model; "
                        f"add megatron or raise --micro-batch-size")
    return out


def _megatron_candidates(m: PlanModel, degrees: tuple[int, ...] | None) -> list[BlockStrategy]:
    """Per-block degrees are powers of two dividing T (the runtime's degree groups and plan files
    hold only those), so this family needs T itself a power of two; ATP and 3-D do not."""
    if m.tp & (m.tp - 1):
        raise PlanError(f"--tensor-model-parallel-size {m.tp} must be a power of two for the planner's "
                        "megatron family (block degrees are powers of two dividing it); plan --families atp")
    all_d = [1 << i for i in range(m.tp.bit_length()) if m.tp % (1 << i) == 0]
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
    out = [BlockStrategy(degree=d) for d in all_d if not feasible(BlockStrategy(degree=d), m)]
    if not out:
        why = "; ".join(f"tp{d}: {feasible(BlockStrategy(degree=d), m)}" for d in all_d)
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
    """The chain of blocks: layer 0 attention, layer 0 mlp, layer 1 attention, ..."""
    return [Block(index=i, layer=i // len(BLOCK_KINDS), kind=BLOCK_KINDS[i % len(BLOCK_KINDS)])
            for i in range(m.num_blocks)]
