"""LayerNorm / RMSNorm on a hidden dim sharded over ATP mesh axis 2 (between-layer spec
``[Replicate, Shard(h)]``, ATP paper §3.2).

Each rank holds ``h / d2`` features of every token, so the per-token statistics are partial sums
over axis 2. They are all-reduced with a pair whose forward *and* backward are all-reduces
(``reduce_from_group(copy_to_group(.))``): the forward completes the sum, and in backward every
rank's output shard contributes to the gradient of the shared statistic, so those contributions
must be summed too. LayerNorm takes two all-reduces of ``s b`` fp32 floats (the mean, then the
centred sum of squares: one fused ``[sum x, sum x^2]`` would save a latency but cancels badly when
|mean| >> std); RMSNorm takes one. Both are latency-bound, tiny next to the linears. The weight
(and bias) are split on axis 2 with ``mesh_layout = (2,)`` and replicated on axis 1; axis-1
replicas see identical inputs and output gradients, so their weight gradients agree without any
reduction (and only the axis-1 index 0 replica counts in Megatron's grad norm).
"""
from __future__ import annotations

import torch

from megatron_oases.layers.atp_linear import (count_once_in_grad_norm_, mesh_sharded_state_dict)
from megatron_oases.parallel import collectives as C
from megatron_oases.errors import ConfigError
from megatron_oases.parallel.mesh import MeshGroups, shard_index


def sum_over_axis(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce in forward and in backward: a statistic shared by every rank of ``group``."""
    return C.reduce_from_group(C.copy_to_group(x, group), group)


class ATPNorm(torch.nn.Module):
    """Megatron-compatible norm (``config, hidden_size, eps``) for ``[.., h / d2]`` shards.

    ``kind`` is ``"LayerNorm"`` or ``"RMSNorm"`` (default: ``config.normalization``). Honours
    ``config.layernorm_zero_centered_gamma`` (scale ``1 + w``) like Megatron's norms.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, mesh_groups: MeshGroups,
                 kind: str | None = None, params_dtype: torch.dtype | None = None, device=None):
        super().__init__()
        kind = kind or getattr(config, "normalization", "LayerNorm")
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"ATPNorm: --normalization {kind} is not supported (LayerNorm, RMSNorm)")
        mesh = mesh_groups.mesh
        if hidden_size % mesh.d2 != 0:
            raise ConfigError(f"ATPNorm: --hidden-size {hidden_size} is not divisible by --atp-mesh "
                              f"{mesh.d1}x{mesh.d2} axis 2 (size {mesh.d2})")
        self.kind, self.hidden_size, self.eps = kind, hidden_size, eps
        self.mesh_groups = mesh_groups
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        dtype = params_dtype or getattr(config, "params_dtype", torch.float32)
        full_w = torch.zeros(hidden_size) if self.zero_centered else torch.ones(hidden_size)
        self.weight = self._param(full_w, dtype, device)
        if kind == "LayerNorm":
            self.bias = self._param(torch.zeros(hidden_size), dtype, device)
        else:
            self.register_parameter("bias", None)
        count_once_in_grad_norm_(self, mesh_groups)

    def _param(self, full, dtype, device):
        mg = self.mesh_groups
        local = full[shard_index(full.shape, (2,), mg.coord, mg.mesh)]
        param = torch.nn.Parameter(local.to(dtype=dtype, device=device).clone())
        param.mesh_layout = (2,)
        param.partition_dim = 0
        param.partition_stride = 1
        param.tensor_model_parallel = True
        return param

    def _check_input(self, x: torch.Tensor) -> None:
        local_h = self.hidden_size // self.mesh_groups.mesh.d2
        if x.shape[-1] != local_h:
            raise ValueError(f"ATPNorm: input hidden dim {x.shape[-1]} != {self.hidden_size} / "
                             f"mesh axis 2 ({self.mesh_groups.mesh.d2}) = {local_h}")

    # The norm's local math, in the stages between its axis-2 sums, so a caller that runs the
    # sums itself (the Oases executor) computes exactly what ``forward`` does.
    def first_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the first statistic: sum of x (LayerNorm) or x^2 (RMSNorm)."""
        self._check_input(x)
        xf = x.float()
        return (xf if self.kind == "LayerNorm" else xf * xf).sum(-1, keepdim=True)

    def centre(self, x: torch.Tensor, total: torch.Tensor):
        """LayerNorm: ``x`` minus the mean (``total`` = axis-2 sum of ``first_partial``), and
        this rank's part of the centred sum of squares."""
        xc = x.float() - total / self.hidden_size
        return xc, (xc * xc).sum(-1, keepdim=True)

    def normalize(self, x: torch.Tensor, base: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """``base`` (LayerNorm: centred x; RMSNorm: x in fp32) over the root of the statistic
        whose axis-2 sum is ``total``, then the affine transform."""
        y = base * torch.rsqrt(total / self.hidden_size + self.eps)
        w = self.weight + 1 if self.zero_centered else self.weight
        y = y.to(x.dtype) * w
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.mesh_groups.group(2)
        xf = x.float()  # one fp32 copy: RMSNorm's square and scale both keep it for backward
        total = sum_over_axis(self.first_partial(xf), group)
        if self.kind == "LayerNorm":
            base, part = self.centre(xf, total)
            total = sum_over_axis(part, group)
        else:
            base = xf
        return self.normalize(x, base, total)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return mesh_sharded_state_dict(self, self.mesh_groups, prefix, sharded_offsets,
                                       metadata=metadata)

    def extra_repr(self) -> str:
        m = self.mesh_groups.mesh
        return f"{self.kind}, hidden={self.hidden_size}, mesh={m.d1}x{m.d2}, eps={self.eps}"
