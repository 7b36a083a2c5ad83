"""The GPT layer spec for ``--tp-backend atp``: Megatron's TransformerLayer with ATP submodules.

Layout conversion (``layers/boundary.py``). ``ATPTransformerLayer`` converts Megatron's replicated
``[s, b, h]`` only at the edges of its block: the *first* layer of each block (pipeline / virtual
stage) keeps its axis-2 slice of the hidden dim (``split_dim``: free in forward, an axis-2
all-gather of dX in backward) and the *last* all-gathers it back on axis 2 (backward: keep own
slice). In between, hidden states, residuals and the bias-dropout-add stay in the paper's
``[Replicate, Shard(h)]`` (local ``[s, b, h/d2]``). Cost per block and micro-batch: one
``[s, b, h]`` all-gather over ``d2`` ranks in forward and one in backward (nothing when
``d2 == 1``), against the per-layer f1..f4 all-reduces it leaves untouched.

Hidden dropout: the mask of the whole ``[s, b, h]`` is drawn and this rank's axis-2 slice kept
(``layers/sharded_dropout.py``), so slices do not share one pattern.
"""
from __future__ import annotations

from megatron_oases.layers.boundary import MEGATRON_NORM_KEYS, BlockLayout, BoundaryTransformerLayer
from megatron_oases.errors import ConfigError
from megatron_oases.parallel.mesh import MeshGroups


class ATPTransformerLayer(BoundaryTransformerLayer):
    """Megatron's TransformerLayer that enters / leaves ``[Replicate, Shard(h)]`` at the block's
    first / last layer (``mesh_groups`` comes from the spec's params)."""

    def __init__(self, *args, mesh_groups: MeshGroups, **kwargs):
        super().__init__(*args, layout=atp_layout(mesh_groups), **kwargs)
        self.mesh_groups = mesh_groups


def atp_layout(mesh_groups: MeshGroups) -> BlockLayout:
    """``[s, b, h]`` -> ``[s, b, h/d2]``: the hidden dim cut on axis 2 (no cut when ``d2 == 1``,
    where the layout is already Megatron's)."""
    cuts = ((-1, mesh_groups.group(2)),) if mesh_groups.mesh.d2 > 1 else ()
    return BlockLayout("atp", cuts)


def atp_bias_dropout_add_builder(mesh_groups: MeshGroups):
    """A ``get_bias_dropout_add`` replacement for hidden states in ``[Replicate, Shard(h)]``."""
    from megatron_oases.layers.sharded_dropout import sharded_bias_dropout_add_builder

    return sharded_bias_dropout_add_builder(-1, mesh_groups.mesh.d2, mesh_groups.index(2))


def get_gpt_layer_atp_spec(d1: int, d2: int, chunks: int = 1, *,
                           mesh_groups: MeshGroups | None = None):
    """``ModuleSpec`` of an ATP GPT layer on a ``d1 x d2`` mesh with ``chunks``-way overlap.

    Call after ``initialize_model_parallel``. Without ``mesh_groups`` the mesh groups are built
    from Megatron's TP groups here, which is collective over the world: call it once on every
    rank and reuse the spec for all model chunks.
    """
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from megatron_oases.layers.atp_attention import ATPSelfAttention
    from megatron_oases.layers.atp_mlp import ATPMLP
    from megatron_oases.layers.atp_norm import ATPNorm
    from megatron_oases.parallel.mesh import mesh_groups_from_megatron

    if chunks < 1:
        raise ConfigError(f"--atp-chunks must be >= 1 (got {chunks})")
    if mesh_groups is None:
        mesh_groups = mesh_groups_from_megatron(d1, d2)
    elif (mesh_groups.mesh.d1, mesh_groups.mesh.d2) != (d1, d2):
        raise ConfigError(f"--atp-mesh {d1}x{d2} does not match the given mesh groups "
                          f"{mesh_groups.mesh.d1}x{mesh_groups.mesh.d2}")
    mesh = {"mesh_groups": mesh_groups}
    bda = atp_bias_dropout_add_builder(mesh_groups)
    return ModuleSpec(
        module=ATPTransformerLayer,
        params=mesh,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ModuleSpec(module=ATPNorm, params=mesh),
            self_attention=ModuleSpec(module=ATPSelfAttention,
                                      params={**mesh, "chunks": chunks,
                                              "attn_mask_type": AttnMaskType.causal}),
            self_attn_bda=bda,
            pre_mlp_layernorm=ModuleSpec(module=ATPNorm, params=mesh),
            mlp=ModuleSpec(module=ATPMLP, params={**mesh, "chunks": chunks}),
            mlp_bda=bda,
            sharded_state_dict_keys_map=MEGATRON_NORM_KEYS,
        ),
    )
