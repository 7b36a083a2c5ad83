"""ATP column-first and row-first linears on a 2-D mesh (ATP paper §3.2, Fig. 5/6, §4.1/4.2).

Both compute ``Y = X W^T + b`` with ``W`` stored as ``[out, in]`` (Megatron / ``torch.nn.Linear``
layout) on local shards and explicit collectives on the two mesh-axis groups. Notation: a spec
``[P1, P2]`` gives the placement on mesh axis 1 and axis 2; ``Shard(h)`` is the hidden (last) dim.

| layer        | X (input)          | W [out, in]: out / in on | Y (output)         | fwd AR | bwd AR |
|--------------|--------------------|--------------------------|--------------------|--------|--------|
| ColumnFirst  | [Replicate, Shard(h)] | axis 1 / axis 2       | [Shard(h), Replicate] | axis 2 | axis 1 |
| RowFirst     | [Shard(h), Replicate] | axis 2 / axis 1       | [Replicate, Shard(h)] | axis 1 | axis 2 |

In the paper's ``[in, out]`` terms the column-first weight is ``[Shard(1), Shard(0)]`` and the
row-first weight ``[Shard(0), Shard(1)]``. Column-first's output spec is row-first's input spec,
so fc1 -> activation -> fc2 chains with no resharding and returns to the between-layer spec
``[Replicate, Shard(h)]``. The local GEMM gives a partial sum over the axis that splits ``in``;
the forward all-reduce runs there, and the backward all-reduce (of dX) on the axis that splits
``out`` (the conjugate pair). See docs/atp_layers.md for how this matches the paper's f1..f4.

``chunks > 1`` (paper §4.1) splits the input along ``chunk_dim`` and launches each chunk's
forward all-reduce asynchronously while the next chunk's GEMM runs; in backward (§4.2) the dX
all-reduce is launched before the weight gradient is computed and waited on after it:

| pass      | compute                 | collective                                 |
|-----------|-------------------------|--------------------------------------------|
| forward   | Y_c = X_c W^T per chunk | async all-reduce of Y_c on the ``in`` axis |
| dgrad     | dX = dY W               | async all-reduce on the ``out`` axis       |
| wgrad     | dW = dY^T X, db = sum dY| none (overlaps the dX all-reduce)          |
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from megatron_oases.layers.gated_rows import gated_rows_factory, gated_rows_order
from megatron_oases.parallel import collectives as C
from megatron_oases.errors import ConfigError
from megatron_oases.parallel.mesh import MeshGroups, shard_index


class _OverlappedMeshLinear(torch.autograd.Function):
    """Chunked forward with async all-reduce per chunk; dgrad all-reduce overlapped with wgrad.

    forward: all-reduce on ``fwd_group``; backward: all-reduce of dX on ``bwd_group``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, fwd_group, bwd_group, chunks, chunk_dim):
        ctx.save_for_backward(x, weight)
        ctx.bwd_group, ctx.has_bias = bwd_group, bias is not None
        pieces, works = [], []
        for x_chunk in torch.tensor_split(x, chunks, dim=chunk_dim):
            y_chunk = F.linear(x_chunk, weight)
            works.append(C.all_reduce(y_chunk, fwd_group, async_op=True))
            pieces.append(y_chunk)
        for work in works:
            if work is not None:
                work.wait()
        y = torch.cat(pieces, dim=chunk_dim)
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = work = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_y.matmul(weight)
            work = C.all_reduce(grad_x, ctx.bwd_group, async_op=True)
        dy2d = grad_y.reshape(-1, grad_y.shape[-1])
        grad_w = dy2d.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = dy2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None, None, None, None


class _MeshLinear(torch.nn.Module):
    """Shared body of the two ATP linears; subclasses fix which mesh axis splits ``in`` / ``out``."""

    in_axis: int
    """Mesh axis that splits the input features (and the hidden dim of the input activation)."""
    out_axis: int
    """Mesh axis that splits the output features (and the hidden dim of the output activation)."""

    def __init__(self, input_size: int, output_size: int, mesh_groups: MeshGroups, *,
                 bias: bool = True, init_weight: torch.Tensor | None = None,
                 init_bias: torch.Tensor | None = None,
                 init_method: Callable[[torch.Tensor], object] | None = None,
                 chunks: int = 1, chunk_dim: int = 0, skip_bias_add: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, gated: bool = False):
        """``init_weight`` is the full ``[output_size, input_size]`` weight (same on every rank);
        without it a full weight is drawn with ``init_method`` (default N(0, 0.02)) from the
        current RNG state, which must then be equal on all TP ranks. ``chunks`` > 1 turns on the
        chunk-based overlap along ``chunk_dim`` (use 1 for Megatron's ``[s, b, h]``).
        ``skip_bias_add`` leaves the bias out of ``forward`` so Megatron's bias-dropout-add can
        fuse it (the caller reads ``self.bias``). ``gated``: the output rows are a gated unit's
        ``[gate; up]`` (Megatron's layout of the full weight); each part along the ``out`` axis
        keeps its own gate and up rows (``gated_rows_order``), checkpointed as Megatron's."""
        super().__init__()
        mesh = mesh_groups.mesh
        name = type(self).__name__
        for what, size, axis in (("input_size", input_size, self.in_axis),
                                 ("output_size", output_size, self.out_axis)):
            n = mesh.axis_size(axis)
            if size % n != 0:
                raise ConfigError(f"{name}: {what} {size} is not divisible by --atp-mesh "
                                  f"{mesh.d1}x{mesh.d2} axis {axis} (size {n})")
        if chunks < 1:
            raise ConfigError(f"{name}: chunks must be >= 1 (got {chunks})")
        self.input_size, self.output_size = input_size, output_size
        self.mesh_groups, self.chunks, self.chunk_dim = mesh_groups, chunks, chunk_dim
        self.skip_bias_add = skip_bias_add
        self.weight_layout = (self.out_axis, self.in_axis)
        self.bias_layout = (self.out_axis,)

        if init_weight is None:
            init_weight = torch.empty(output_size, input_size, dtype=torch.float32)
            (init_method or (lambda w: torch.nn.init.normal_(w, 0.0, 0.02)))(init_weight)
        elif tuple(init_weight.shape) != (output_size, input_size):
            raise ConfigError(f"{name}: init_weight has shape {tuple(init_weight.shape)}, expected "
                              f"[out, in] = ({output_size}, {input_size}) (transpose an [in, out] weight)")
        if gated and (self.out_axis != 1 or output_size % (2 * mesh.axis_size(1))):
            raise ConfigError(f"{name}: a gated unit needs a column-first linear whose output "
                              f"{output_size} splits into gate and up halves over axis 1")
        self.weight = self._param(init_weight, self.weight_layout, params_dtype, device,
                                  partition_dim=self._weight_partition_dim, gated=gated)
        if bias:
            if init_bias is None:
                init_bias = torch.zeros(output_size)
            elif tuple(init_bias.shape) != (output_size,):
                raise ConfigError(f"{name}: init_bias has shape {tuple(init_bias.shape)}, "
                                  f"expected ({output_size},)")
            self.bias = self._param(init_bias, self.bias_layout, params_dtype, device, partition_dim=0,
                                    gated=gated)
        else:
            self.register_parameter("bias", None)
        # Megatron's Column/RowParallelLinear carry an empty ``_extra_state`` (TE compatibility)
        # and checkpoint it; carrying it too keeps checkpoints loadable both ways.
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))

    _weight_partition_dim: int

    def get_extra_state(self) -> None:
        """Empty, as Megatron's parallel linears (``_extra_state`` key in the state dict)."""
        return None

    def set_extra_state(self, state) -> None:
        """Ignored, as in Megatron's parallel linears."""

    def _param(self, full, layout, dtype, device, partition_dim, gated: bool = False):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        mg = self.mesh_groups
        if gated:  # [gate; up] -> each out-axis part holds its own gate and up rows
            full = full[gated_rows_order(full.shape[0], mg.mesh.axis_size(layout[0]))]
        local = full.detach()[shard_index(full.shape, layout, mg.coord, mg.mesh)]
        param = torch.nn.Parameter(local.to(dtype=dtype, device=device).clone())
        set_tensor_model_parallel_attributes(param, True, partition_dim, 1)
        param.mesh_layout = layout  # per tensor dim: the mesh axis that splits it (None: whole)
        param.gated_rows = gated
        return param

    def _check_input(self, x: torch.Tensor) -> None:
        local_in = self.input_size // self.mesh_groups.mesh.axis_size(self.in_axis)
        if x.shape[-1] != local_in:
            raise ValueError(f"{type(self).__name__}: input hidden dim {x.shape[-1]} != "
                             f"{self.input_size} / mesh axis {self.in_axis} = {local_in}")

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """The local GEMM: this rank's partial sum over the ``in`` axis, before any collective
        and without the bias (the Oases executor runs the collectives around it itself)."""
        self._check_input(x)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mg = self.mesh_groups
        self._check_input(x)
        fwd_group, bwd_group = mg.group(self.in_axis), mg.group(self.out_axis)
        bias = None if self.skip_bias_add else self.bias
        if self.chunks > 1:
            return _OverlappedMeshLinear.apply(x, self.weight, bias, fwd_group, bwd_group,
                                               self.chunks, self.chunk_dim)
        x = C.copy_to_group(x, bwd_group)  # backward: sum dX over the axis that splits ``out``
        y = C.reduce_from_group(self.partial(x), fwd_group)  # sum partials over ``in``
        return y + bias if bias is not None else y

    def extra_repr(self) -> str:
        m = self.mesh_groups.mesh
        return (f"in={self.input_size}, out={self.output_size}, mesh={m.d1}x{m.d2}, "
                f"coord={self.mesh_groups.coord}, bias={self.bias is not None}, chunks={self.chunks}")


class ColumnFirstLinear(_MeshLinear):
    """fc1 / QKV: output features split on axis 1, input features on axis 2 (paper
    ``[Shard(1), Shard(0)]`` for ``W[in, out]``). In ``[Replicate, Shard(h)]``, out
    ``[Shard(h), Replicate]``; bias split on axis 1, replicated on axis 2."""

    in_axis, out_axis = 2, 1
    _weight_partition_dim = 0  # like Megatron's ColumnParallelLinear: ``out`` is the main split


class RowFirstLinear(_MeshLinear):
    """fc2 / output projection: input features split on axis 1, output features on axis 2
    (paper ``[Shard(0), Shard(1)]`` for ``W[in, out]``). In ``[Shard(h), Replicate]``, out
    ``[Replicate, Shard(h)]``; bias split on axis 2, replicated on axis 1."""

    in_axis, out_axis = 1, 2
    _weight_partition_dim = 1  # like Megatron's RowParallelLinear: ``in`` is the main split


def mesh_replica_index(mesh_layout, mesh_groups: MeshGroups) -> int:
    """This rank's replica number for a parameter: its position along the mesh axes that do not
    split it (0 on exactly one rank per distinct shard)."""
    free = [a for a in (1, 2) if a not in mesh_layout]
    index = 0
    for axis in free:
        index = index * mesh_groups.mesh.axis_size(axis) + mesh_groups.index(axis)
    return index


def count_once_in_grad_norm_(module: torch.nn.Module, mesh_groups: MeshGroups) -> None:
    """Megatron's grad norm counts a param on every TP rank when ``tensor_model_parallel`` is set,
    else only on TP rank 0. A mesh param replicated on one axis must count once: keep the flag only
    on its main replica (TP rank 0 is coordinate (0, 0), always a main replica)."""
    for param in module.parameters():
        layout = getattr(param, "mesh_layout", None)
        if layout is not None:
            param.tensor_model_parallel = mesh_replica_index(layout, mesh_groups) == 0


def mesh_sharded_state_dict(module: torch.nn.Module, mesh_groups: MeshGroups, prefix: str = "",
                            sharded_offsets=(), dp_rank: int | None = None,
                            metadata: dict | None = None) -> dict:
    """dist-checkpointing entries for ``module``'s state dict, from each tensor's ``mesh_layout``.

    A tensor becomes a ``ShardedTensor`` with the global shape and, per split dim, this rank's
    chunk along the mesh axis that splits it (``shard_index``'s rule); its replica id counts the
    axes that do not split it, so one rank per distinct shard saves it. ``_extra_state`` becomes
    a ``ShardedObject`` as in Megatron's ``make_sharded_tensors_for_checkpoint``. Keys and global
    layouts equal those of Megatron's local spec at the same TP size (QKV rows head by head,
    ``[out, in]`` weights), so a checkpoint reshards freely between ATP meshes and stock TP.
    The DP rank comes from ``metadata["dp_cp_group"]`` when given (as Megatron's linears do).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    if dp_rank is None:
        from megatron_oases.parallel.layout import checkpoint_dp_rank

        dp_rank = checkpoint_dp_rank(metadata)
    mesh = mesh_groups.mesh
    tp_rank = mesh_groups.index(1) * mesh.d2 + mesh_groups.index(2)
    n_pre = len(sharded_offsets)
    out = {}
    for name, value in module.state_dict(prefix="", keep_vars=True).items():
        key = f"{prefix}{name}"
        if name.endswith("_extra_state"):
            out[key] = make_sharded_object_for_checkpoint(
                value, key, sharded_offsets, replica_id=(0, tp_rank, dp_rank))
            continue
        layout = getattr(value, "mesh_layout", (None,) * value.dim())  # no layout: replicated
        split = [(dim + n_pre, mesh_groups.index(axis), mesh.axis_size(axis))
                 for dim, axis in enumerate(layout) if axis is not None]
        replica_id = (0, mesh_replica_index(layout, mesh_groups), dp_rank)
        if getattr(value, "gated_rows", False):
            out[key] = gated_rows_factory(key, value, sharded_offsets, split, replica_id)
            continue
        out[key] = ShardedTensor.from_rank_offsets(
            key, value, *sharded_offsets, *split, replica_id=replica_id, prepend_axis_num=n_pre)
    return out

