"""Load-balanced 3-D matrix operations and layers (Bian et al. 2021, §3.1-3.2) on a ``CubeGroups``.

Every 2-D operand is split p^2 ways along one dimension and p ways along the other, so no rank
holds a replicated block (§3.1.1). A ``BlockLayout`` names which cube directions split the rows
and the columns (outer -> inner). The three GEMM forms take the paper's direction triple
(a, b, c): all-gather the first operand in a, the second in b, local GEMM, reduce-scatter in c.

| form      | A layout        | B layout        | C layout        | dA (dirs)         | dB (dirs)         |
|-----------|-----------------|-----------------|-----------------|-------------------|-------------------|
| C = A B   | rows b,a cols c | rows c cols a,b | rows b,c cols a | dC B^T  (c, b, a) | A^T dC  (a, c, b) |
| C = A B^T | rows b,a cols c | rows a cols c,b | rows b,c cols a | dC B    (c, b, a) | dC^T A  (c, a, b) |
| C = A^T B | rows c,a cols b | rows c,b cols a | rows b cols a,c | B dC^T  (b, c, a) | A dC    (a, c, b) |

With (a, b, c) = (y, x, z) these are Algorithms 1-6. The backward passes re-gather their inputs
(the paper's choice: activation memory stays O(1/P); saving the gathered blocks would trade that
for two all-gathers). Vectors (bias, norm weights) are stored on the diagonal j = l (Fig. 5).
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_oases.parallel.collectives import (
    all_gather_dim,
    copy_to_group,
    reduce_from_group,
    reduce_scatter_dim,
)
from megatron_oases.layers.gated_rows import gated_rows_factory
from megatron_oases.parallel.cube import CubeGroups, broadcast_, other_dir, reduce_
from megatron_oases.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Directions that split a 2-D tensor's rows and columns, outer -> inner (p-way each)."""

    rows: tuple[str, ...]
    cols: tuple[str, ...]

    def region(self, shape, coord, p) -> tuple[slice, slice]:
        """Slices of the full tensor (of ``shape``) held at cube ``coord``."""
        out = []
        for size, dirs in zip(shape, (self.rows, self.cols)):
            parts = p ** len(dirs)
            if size % parts:
                raise ConfigError(f"3-D layout: dimension {size} is not divisible by p^{len(dirs)} = {parts}")
            k = 0
            for d in dirs:
                k = k * p + coord["xyz".index(d)]
            out.append(slice(k * size // parts, (k + 1) * size // parts))
        return tuple(out)

    def take(self, full: torch.Tensor, coord, p) -> torch.Tensor:
        return full[self.region(full.shape, coord, p)].contiguous()

    def rank_offsets(self, shape, coord, p) -> list[tuple[int, int, int]]:
        """``(dim, block index, number of blocks)`` per split dim (dist-checkpointing's form)."""
        self.region(shape, coord, p)  # divisibility check
        out = []
        for dim, dirs in enumerate((self.rows, self.cols)):
            if dirs:
                k = 0
                for d in dirs:
                    k = k * p + coord["xyz".index(d)]
                out.append((dim, k, p ** len(dirs)))
        return out

    def gather(self, local: torch.Tensor, groups: CubeGroups) -> torch.Tensor:
        """The full tensor on every rank (inner direction first; differentiable)."""
        for dim, dirs in ((0, self.rows), (1, self.cols)):
            for d in reversed(dirs):
                local = all_gather_dim(local, dim, groups.group(d))
        return local


@dataclasses.dataclass(frozen=True)
class DiagonalLayout:
    """A vector of size N held only on ranks (i, j, j): chunk b[j N/p + i N/p^2 :][: N/p^2]."""

    def region(self, shape, coord, p) -> tuple[slice] | None:
        (n,), (i, j, l) = shape, coord
        if n % (p * p):
            raise ConfigError(f"3-D vector of size {n} is not divisible by p^2 = {p * p}")
        if j != l:
            return None
        start = j * (n // p) + i * (n // (p * p))
        return (slice(start, start + n // (p * p)),)

    def take(self, full: torch.Tensor, coord, p) -> torch.Tensor:
        region = self.region(full.shape, coord, p)
        return full[region].contiguous() if region else full.new_empty(0)

    def rank_offsets(self, shape, coord, p) -> list[tuple[int, int, int]] | None:
        """``[(0, j p + i, p^2)]`` on a diagonal holder; ``None`` elsewhere (nothing held)."""
        if self.region(shape, coord, p) is None:
            return None
        i, j, _ = coord
        return [(0, j * p + i, p * p)]

    def gather(self, local: torch.Tensor, groups: CubeGroups, size: int) -> torch.Tensor:
        """The full vector on every rank (not differentiable; for checkpoints and tests)."""
        b_l = _expand_vector(local, groups, "z", size // groups.p)
        return all_gather_dim(b_l, 0, groups.z)


DIAGONAL = DiagonalLayout()


def activation_layout(input_dir: str) -> BlockLayout:
    """Layout of a (tokens, hidden) activation whose next GEMM gathers it in ``input_dir``."""
    return BlockLayout(rows=("x", input_dir), cols=(other_dir(input_dir),))


def gemm_layouts(form: str, dirs) -> tuple[BlockLayout, BlockLayout, BlockLayout]:
    """(A, B, C) layouts of a GEMM form ('ab', 'abt', 'atb') under directions (a, b, c)."""
    a, b, c = dirs
    if sorted(dirs) != ["x", "y", "z"]:
        raise ValueError(f"GEMM directions must be a permutation of x, y, z (got {dirs})")
    lay = BlockLayout
    return {"ab": (lay((b, a), (c,)), lay((c,), (a, b)), lay((b, c), (a,))),
            "abt": (lay((b, a), (c,)), lay((a,), (c, b)), lay((b, c), (a,))),
            "atb": (lay((c, a), (b,)), lay((c, b), (a,)), lay((b,), (a, c)))}[form]


# --- the three GEMM forms (plain tensors in, plain tensors out; used by forward and backward) ---

def _ab(a, b, dirs, g):
    da, db, dc = (g.group(d) for d in dirs)
    return reduce_scatter_dim(all_gather_dim(a, 0, da) @ all_gather_dim(b, 1, db), 0, dc)


def _abt(a, b, dirs, g):
    da, db, dc = (g.group(d) for d in dirs)
    return reduce_scatter_dim(all_gather_dim(a, 0, da) @ all_gather_dim(b, 1, db).t(), 0, dc)


def _atb(a, b, dirs, g):
    da, db, dc = (g.group(d) for d in dirs)
    return reduce_scatter_dim(all_gather_dim(a, 0, da).t() @ all_gather_dim(b, 0, db), 1, dc)


_FORMS = {"ab": _ab, "abt": _abt, "atb": _atb}


def _grads(form, a, b, dc, dirs, g, need):
    """(dA, dB) of a form as two other forms with permuted directions (Algorithms 2, 4, 6)."""
    a_, b_, c_ = dirs
    if form == "ab":
        da = _abt(dc, b, (c_, b_, a_), g) if need[0] else None
        db = _atb(a, dc, (a_, c_, b_), g) if need[1] else None
    elif form == "abt":
        da = _ab(dc, b, (c_, b_, a_), g) if need[0] else None
        db = _atb(dc, a, (c_, a_, b_), g) if need[1] else None
    else:
        da = _abt(b, dc, (b_, c_, a_), g) if need[0] else None
        db = _ab(a, dc, (a_, c_, b_), g) if need[1] else None
    return da, db


class _Gemm3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, form, dirs, groups):
        ctx.save_for_backward(a, b)
        ctx.form, ctx.dirs, ctx.groups = form, tuple(dirs), groups
        return _FORMS[form](a, b, ctx.dirs, groups)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        da, db = _grads(ctx.form, a, b, grad.contiguous(), ctx.dirs, ctx.groups,
                        ctx.needs_input_grad[:2])
        return da, db, None, None, None


def gemm_3d(a, b, groups: CubeGroups, form: str = "ab", dirs=("y", "x", "z")) -> torch.Tensor:
    """C = A B | A B^T | A^T B on local blocks laid out per ``gemm_layouts(form, dirs)``."""
    if form not in _FORMS:
        raise ValueError(f"form must be one of {sorted(_FORMS)} (got {form!r})")
    return _Gemm3D.apply(a, b, form, tuple(dirs), groups)


# --- matrix-vector operations on diagonally stored vectors (Algorithms 7-8) ---

def _expand_vector(vec, groups: CubeGroups, col_dir: str, block: int) -> torch.Tensor:
    """b_e (size N/p) for an activation whose columns are split by ``col_dir``.

    The holder (d == e on the diagonal) broadcasts its chunk along the other activation
    direction d, then the x line all-gathers the p chunks of block e.
    """
    d = other_dir(col_dir)
    buf = vec.detach().clone() if vec.numel() else vec.new_empty(block // groups.p)
    broadcast_(buf, groups.pos(col_dir), groups.group(d))
    return all_gather_dim(buf, 0, groups.x)


class _VectorOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, vec, op, col_dir, groups):
        b_e = _expand_vector(vec, groups, col_dir, a.shape[-1])
        ctx.op, ctx.col_dir, ctx.groups, ctx.holder = op, col_dir, groups, vec.numel() > 0
        ctx.save_for_backward(a if op == "mul" else None, b_e if op == "mul" else None)
        return a + b_e if op == "add" else a * b_e

    @staticmethod
    def backward(ctx, grad):
        a, b_e = ctx.saved_tensors
        g = ctx.groups
        da = grad if ctx.op == "add" else grad * b_e
        partial = (grad if ctx.op == "add" else grad * a).reshape(-1, grad.shape[-1]).sum(0)
        chunk = reduce_scatter_dim(partial, 0, g.x)  # sum over the x row blocks, keep chunk i
        d = other_dir(ctx.col_dir)
        reduce_(chunk, g.pos(ctx.col_dir), g.group(d))  # sum over the d row blocks onto j = l
        dvec = chunk if ctx.holder else grad.new_empty(0)
        return da, dvec, None, None, None


def vector_op_3d(a, vec, groups: CubeGroups, col_dir: str, op: str = "add") -> torch.Tensor:
    """A + b or A * b (per column) for ``a`` with columns split by ``col_dir`` and ``vec`` diagonal."""
    if op not in ("add", "mul"):
        raise ValueError(f"op must be 'add' or 'mul' (got {op!r})")
    return _VectorOp.apply(a, vec, op, col_dir, groups)


# --- parameters and modules ---

def _cube_param(local: torch.Tensor, layout, global_shape) -> torch.nn.Parameter:
    """A Parameter tagged with its layout, so shards can be gathered for checkpoints and parity."""
    param = torch.nn.Parameter(local)
    param.cube_layout, param.global_shape = layout, tuple(global_shape)
    param.tensor_model_parallel = True  # Megatron: not a TP duplicate (each shard is unique)
    param.partition_dim, param.partition_stride = 0, 1  # read by Megatron's attribute copies
    return param


def gather_param(tensor: torch.Tensor, layout, global_shape, groups: CubeGroups) -> torch.Tensor:
    """Full tensor from this rank's shard of a cube parameter (or of its gradient)."""
    with torch.no_grad():
        if isinstance(layout, DiagonalLayout):
            return layout.gather(tensor, groups, global_shape[0])
        return layout.gather(tensor, groups)


def _check_divisible(what: str, size: int, groups: CubeGroups) -> None:
    q = groups.p ** 2
    if size % q:
        raise ConfigError(
            f"{what} {size} is not divisible by p^2 = {q} (3-D TP, --tensor-model-parallel-size "
            f"{groups.p ** 3}); use a multiple of {q}")


class Linear3D(torch.nn.Module):
    """y = x W^T + b on the cube, with W in torch (out, in) orientation (form 'abt', Alg. 3-4).

    The input is in ``activation_layout(input_dir)``; the output comes back in
    ``activation_layout(output_dir)`` with ``output_dir = other_dir(input_dir)`` (§3.2 exchange).
    The weight layout depends on ``input_dir``, so it is fixed at construction.
    """

    def __init__(self, in_features: int, out_features: int, groups: CubeGroups, *,
                 input_dir: str = "y", bias: bool = True, full_weight: torch.Tensor | None = None,
                 full_bias: torch.Tensor | None = None, init_std: float = 0.02,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        _check_divisible("Linear3D in_features", in_features, groups)
        _check_divisible("Linear3D out_features", out_features, groups)
        self.groups, self.input_dir = groups, input_dir
        self.output_dir = other_dir(input_dir)
        self.dirs = (input_dir, "x", self.output_dir)
        _, w_layout, _ = gemm_layouts("abt", self.dirs)
        shape = (out_features, in_features)
        if full_weight is not None:
            local = w_layout.take(full_weight.to(dtype), groups.coord, groups.p)
        else:  # shard-local init: no rank ever materialises the full matrix
            rows, cols = w_layout.region(shape, groups.coord, groups.p)
            local = torch.zeros(rows.stop - rows.start, cols.stop - cols.start, dtype=dtype)
            if init_std:  # (0: the caller initialises; a draw would still advance the generator)
                torch.nn.init.normal_(local, std=init_std)
        self.weight = _cube_param(local, w_layout, shape)
        self.bias = None
        if bias:
            full_b = full_bias if full_bias is not None else torch.zeros(out_features, dtype=dtype)
            self.bias = _cube_param(DIAGONAL.take(full_b.to(dtype), groups.coord, groups.p),
                                    DIAGONAL, (out_features,))
        # A state dict without ``_extra_state`` (plain torch, or no Megatron linear) still loads.
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))

    def get_extra_state(self) -> None:
        """None, like Megatron's local linears (its checkpoints carry an ``_extra_state`` key)."""
        return None

    def set_extra_state(self, state) -> None:
        """Extra state is ignored (as in Megatron's local linears)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = gemm_3d(x.reshape(-1, x.shape[-1]), self.weight, self.groups, "abt", self.dirs)
        if self.bias is not None:
            y = vector_op_3d(y, self.bias, self.groups, col_dir=self.input_dir, op="add")
        return y.reshape(*lead, y.shape[-1])


class LayerNorm3D(torch.nn.Module):
    """LayerNorm (or RMSNorm) over a hidden dim split in ``other_dir(input_dir)``; keeps the
    direction state.

    Mean and variance (RMSNorm: the mean square) are fp32 partial sums all-reduced over the p
    ranks that share a row block; the normalised activation is cast back to the input dtype, and
    gamma and beta are diagonal vectors applied with Algorithm 7 (mul, then add). ``rms=True``
    has no beta (``self.bias`` is None).
    """

    def __init__(self, hidden: int, groups: CubeGroups, *, input_dir: str = "y", eps: float = 1e-5,
                 full_weight: torch.Tensor | None = None, full_bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, rms: bool = False):
        super().__init__()
        _check_divisible("LayerNorm3D hidden size", hidden, groups)
        self.groups, self.input_dir, self.eps, self.hidden = groups, input_dir, eps, hidden
        self.col_dir, self.rms = other_dir(input_dir), rms
        w = full_weight if full_weight is not None else torch.ones(hidden, dtype=dtype)
        self.weight = _cube_param(DIAGONAL.take(w.to(dtype), groups.coord, groups.p), DIAGONAL, (hidden,))
        if rms:
            self.register_parameter("bias", None)
        else:
            b = full_bias if full_bias is not None else torch.zeros(hidden, dtype=dtype)
            self.bias = _cube_param(DIAGONAL.take(b.to(dtype), groups.coord, groups.p), DIAGONAL,
                                    (hidden,))

    def _sum_hidden(self, t: torch.Tensor) -> torch.Tensor:
        # all-reduce forward and backward: every rank uses the sum for its own columns
        g = self.groups.group(self.col_dir)
        return reduce_from_group(copy_to_group(t.sum(-1, keepdim=True), g), g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics and normalisation in fp32 (as Megatron's fused norms, torch's layer_norm and
        # ATPNorm), then gamma / beta in the input dtype. In fp16 the backward of rsqrt (-r^3 / 2)
        # overflows once the variance is below ~6e-4 (r > 40: GPT's 0.02-std embeddings), so
        # every gradient upstream of the norm became inf / NaN and the loss scaler skipped every
        # step; a fp16 sum of squares also overflows once |x| > 256.
        xf = x.float()
        if self.rms:
            y = xf * torch.rsqrt(self._sum_hidden(xf * xf) / self.hidden + self.eps)
            return vector_op_3d(y.to(x.dtype), self.weight, self.groups, self.col_dir, "mul")
        mean = self._sum_hidden(xf) / self.hidden
        xc = xf - mean
        var = self._sum_hidden(xc * xc) / self.hidden
        y = (xc * torch.rsqrt(var + self.eps)).to(x.dtype)
        y = vector_op_3d(y, self.weight, self.groups, self.col_dir, "mul")
        return vector_op_3d(y, self.bias, self.groups, self.col_dir, "add")


def cube_sharded_state_dict(module: torch.nn.Module, groups: CubeGroups, prefix: str = "",
                            sharded_offsets=(), dp_rank: int | None = None,
                            metadata: dict | None = None) -> dict:
    """Megatron ``ShardedTensor``s for the cube parameters of ``module`` (from ``cube_layout``).

    Keys and global shapes are those of the dense tensors, so a checkpoint saved under 3-D TP
    loads into stock Megatron TP (and back). Every weight block is unique (replica id 0). A rank
    off the diagonal holds no part of a vector: its empty parameter is a
    ``LocalNonpersistentObject`` (not saved, restored as is on load). Each ``Linear3D`` also gets
    the empty ``_extra_state`` object that Megatron's local linears save (from TP rank 0), so
    the key sets are the same both ways. The DP rank comes from ``metadata["dp_cp_group"]`` when
    given (as in Megatron's linears), else from ``parallel_state``.
    """
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    if dp_rank is None:
        from megatron_oases.parallel.layout import checkpoint_dp_rank

        dp_rank = checkpoint_dp_rank(metadata)
    n_pre = len(sharded_offsets)
    out = {}
    tp_rank = groups.cube.index(groups.coord)
    for name, param in module.named_parameters():
        key = f"{prefix}{name}"
        if not hasattr(param, "cube_layout"):  # replicated on every rank (QK-norm): TP rank 0 saves it
            out[key] = ShardedTensor.from_rank_offsets(key, param, *sharded_offsets,
                                                       replica_id=(0, tp_rank, dp_rank), prepend_axis_num=n_pre)
            continue
        offsets = param.cube_layout.rank_offsets(param.global_shape, groups.coord, groups.p)
        if offsets is None:
            out[key] = LocalNonpersistentObject(param)
            continue
        if getattr(param, "gated_rows", False):  # SwiGLU's fc1: Megatron's [gate; up] layout
            out[key] = gated_rows_factory(key, param, sharded_offsets,
                                          [(dim + n_pre, k, n) for dim, k, n in offsets],
                                          replica_id=(0, 0, dp_rank))
            continue
        out[key] = ShardedTensor.from_rank_offsets(
            key, param, *sharded_offsets, *((dim + n_pre, k, n) for dim, k, n in offsets),
            replica_id=(0, 0, dp_rank), prepend_axis_num=n_pre)
    for name, sub in module.named_modules():
        if isinstance(sub, Linear3D):
            key = f"{prefix}{name}{'.' if name else ''}_extra_state"
            out[key] = make_sharded_object_for_checkpoint(
                sub.get_extra_state(), key, sharded_offsets, replica_id=(0, tp_rank, dp_rank))
    return out

