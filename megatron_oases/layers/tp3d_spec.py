"""The GPT layer spec for ``--tp-backend 3d``: Megatron's TransformerLayer with 3-D submodules.

Layout conversion (``layers/boundary.py``). ``TransformerLayer3D`` converts Megatron's replicated
``[s, b, h]`` only at the edges of its block: the *first* layer of each block (pipeline / virtual
stage) keeps its part, ``activation_layout("y")`` = samples block ``i p + j`` and hidden block
``l``, a local ``[s, b/p^2, h/p]`` (``split_dim`` in x, y, z: free in forward, all-gathers of dX
in backward); the *last* layer all-gathers it back (forward) and keeps its part of the gradient
(backward).
In between, hidden states, residuals and the bias-dropout-add stay in the 3-D layout; every
layer returns to direction y (§3.2: two exchanges per block, one in attention, one in the MLP).
Cost per block and micro-batch: one ``[s, b, h]`` all-gather over the cube (in three steps of p
ranks) forward and one backward, against the per-layer GEMM collectives it leaves untouched.
The micro-batch is split over p^2 ranks, so ``--micro-batch-size`` must be a multiple of p^2.

Hidden dropout: Megatron's bias-dropout-add would draw from the default RNG, equal on all TP
ranks, so all p^3 blocks would share one pattern. ``bias_dropout_add_3d`` draws under
``get_cuda_rng_tracker().fork()`` (a different stream per TP rank, saved and restored by
Megatron's recompute like the attention dropout): independent masks at the cost of the local
block's random numbers only.
"""
from __future__ import annotations

from megatron_oases.layers.boundary import MEGATRON_NORM_KEYS, BlockLayout, BoundaryTransformerLayer
from megatron_oases.layers.linear3d import LayerNorm3D, cube_sharded_state_dict
from megatron_oases.layers.tp3d_attention import place_cpu_masters
from megatron_oases.parallel.cube import CubeGroups
from megatron_oases.errors import ConfigError


def cube_layout(groups: CubeGroups) -> BlockLayout:
    """``[s, b, h]`` -> ``[s, b/p^2, h/p]`` in ``activation_layout("y")``: samples block i (x,
    outer), then j (y): block ``i p + j``; hidden block l (z)."""
    return BlockLayout("3d", ((1, groups.x), (1, groups.y), (-1, groups.z)))


class TransformerLayer3D(BoundaryTransformerLayer):
    """Megatron's TransformerLayer that enters / leaves the 3-D layout at the block's first / last
    layer (``cube_groups`` comes from the spec's params)."""

    def __init__(self, *args, cube_groups: CubeGroups, **kwargs):
        super().__init__(*args, layout=cube_layout(cube_groups), **kwargs)
        self.cube_groups = cube_groups
        place_cpu_masters(self)  # CPU-initialised weights: this rank's shards of the masters


class Norm3D(LayerNorm3D):
    """Megatron-compatible norm (``config, hidden_size, eps``) on ``activation_layout("y")``:
    ``config.normalization`` LayerNorm or RMSNorm, gamma (and beta) on the cube diagonal."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, cube_groups: CubeGroups):
        kind = getattr(config, "normalization", "LayerNorm")
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"Norm3D: --normalization {kind} is not supported (LayerNorm, RMSNorm)")
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ConfigError("Norm3D: --apply-layernorm-1p is not supported with --tp-backend 3d")
        super().__init__(hidden_size, cube_groups, input_dir="y", eps=eps,
                         dtype=config.params_dtype, rms=kind == "RMSNorm")
        self.kind = kind

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return cube_sharded_state_dict(self, self.groups, prefix, sharded_offsets,
                                       metadata=metadata)

    def extra_repr(self) -> str:
        return f"{self.kind}, hidden={self.hidden}, p={self.groups.p}, eps={self.eps}"


def bias_dropout_add_3d(training: bool, fused: bool):
    """``get_bias_dropout_add`` for cube blocks: the hidden dropout under the RNG tracker."""
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    def bias_dropout_add(x_with_bias, residual, prob: float):
        x, bias = x_with_bias
        x = x + bias if bias is not None else x
        if training and prob > 0.0:
            with get_cuda_rng_tracker().fork():
                x = torch.nn.functional.dropout(x, p=prob, training=True)
        residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
        return residual + x

    return bias_dropout_add


def get_gpt_layer_3d_spec(*, cube_groups: CubeGroups | None = None, order: str = "zxy"):
    """``ModuleSpec`` of a 3-D GPT layer on the cube of Megatron's TP group (TP = p^3).

    Call after ``initialize_model_parallel``. Without ``cube_groups`` the direction groups are
    built from Megatron's TP groups here, which is collective over the world: call it once on
    every rank and reuse the spec for all model chunks.
    """
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from megatron_oases.layers.tp3d_attention import SelfAttention3D
    from megatron_oases.layers.tp3d_mlp import MLP3D
    from megatron_oases.parallel.cube import cube_groups_from_megatron

    if cube_groups is None:
        cube_groups = cube_groups_from_megatron(order=order)
    if cube_groups.p < 2:
        raise ConfigError("--tp-backend 3d needs --tensor-model-parallel-size = p^3 with p >= 2 "
                          "(8, 27, 64, ...)")
    cube = {"cube_groups": cube_groups}
    return ModuleSpec(
        module=TransformerLayer3D,
        params=cube,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ModuleSpec(module=Norm3D, params=cube),
            self_attention=ModuleSpec(module=SelfAttention3D,
                                      params={**cube, "attn_mask_type": AttnMaskType.causal}),
            self_attn_bda=bias_dropout_add_3d,
            pre_mlp_layernorm=ModuleSpec(module=Norm3D, params=cube),
            mlp=ModuleSpec(module=MLP3D, params=cube),
            mlp_bda=bias_dropout_add_3d,
            sharded_state_dict_keys_map=MEGATRON_NORM_KEYS,
        ),
    )
