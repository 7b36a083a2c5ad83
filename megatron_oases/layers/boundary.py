"""Where a block of non-Megatron layers meets Megatron's replicated ``[s, b, h]``.

Megatron's block boundaries (embedding output, pipeline P2P buffers, the final layernorm and the
output layer) carry the hidden states replicated over TP. A backend whose layers keep them in
another layout (ATP's ``[Replicate, Shard(h)]``, the 3-D cube's blocks) converts only at the edges
of each block (pipeline / virtual stage): its *first* layer enters the layout, its *last* leaves
it. The layout is a list of cuts of ``[s, b, h]``, each a tensor dim split over a group:

* enter: ``split_dim`` each cut in order (keep own chunk: free in forward; backward all-gathers
  dX), ``[s, b, h]`` -> the local block;
* leave: ``gather_dim`` the cuts in reverse order (forward all-gathers; backward keeps own chunk
  of the gradient), the local block -> ``[s, b, h]``.

Cost per block and micro-batch: one ``[s, b, h]`` all-gather over the cut groups in forward and
one in backward, against the per-layer collectives it leaves untouched. A layout with no cut
(ATP's ``d2 == 1``) converts nothing: a size-1 split or gather would hand back its input as a
view, which Megatron's pipeline schedules refuse to free.
"""
from __future__ import annotations

import dataclasses

from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_oases.parallel import collectives as C

MEGATRON_NORM_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
"""``sharded_state_dict_keys_map`` of a boundary backend's layer spec: its separate norms under the
keys of Megatron's local spec (where they are fused into the column linears), so checkpoints and
``parallel.layout`` keys are interchangeable with ``--tp-backend megatron``."""


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """A backend's layout of the hidden states inside its blocks, as cuts of ``[s, b, h]``."""

    backend: str
    """The ``--tp-backend`` name of the layers that use it (the Oases tape is looked up by it)."""
    cuts: tuple[tuple[int, object], ...]
    """``(tensor dim, process group)`` pairs, outermost first: entering splits ``dim`` over the
    group's ranks for each pair in order."""

    def enter(self, x):
        """Megatron's replicated ``[s, b, h]`` -> this rank's block of the layout."""
        for dim, group in self.cuts:
            x = C.split_dim(x, dim, group)
        return x

    def leave(self, x):
        """Inverse of ``enter``: all-gather the cuts innermost first."""
        for dim, group in reversed(self.cuts):
            x = C.gather_dim(x, dim, group)
        return x


class BoundaryTransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer`` that enters ``layout`` at its block's first layer and leaves
    it at the last (``layers`` of backends other than Megatron 1-D subclass it)."""

    def __init__(self, config, submodules, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None, *, layout: BlockLayout):
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.utils import get_pg_rank

        super().__init__(config, submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection,
                         vp_stage=vp_stage)
        self.layout = layout
        pp_rank = get_pg_rank(getattr(self.pg_collection, "pp", None))
        n_local = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        # ``layer_number`` as passed by TransformerBlock is 1-based within this block.
        converts = bool(layout.cuts)
        self.enters_layout = converts and layer_number == 1
        self.leaves_layout = converts and layer_number == n_local

    @property
    def tp_backend(self) -> str:
        return self.layout.backend

    def forward(self, hidden_states, *args, **kwargs):
        if self.enters_layout:
            hidden_states = self.layout.enter(hidden_states)
        output, context = super().forward(hidden_states, *args, **kwargs)
        if self.leaves_layout:
            output = self.layout.leave(output)
        return output, context
