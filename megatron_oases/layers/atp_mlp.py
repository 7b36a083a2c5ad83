"""ATP MLP for Megatron's TransformerLayer (ATP paper §3.2.1, ops f3 / f4).

``linear_fc1`` is column-first (in ``[Replicate, Shard(h)]``, out ``[Shard(4h), Replicate]``, f3:
forward all-reduce on axis 2) and ``linear_fc2`` row-first (back to ``[Replicate, Shard(h)]``, f4:
forward all-reduce on axis 1), so the activation needs no resharding. Like Megatron's ``MLP`` it
returns ``(output, fc2 bias)`` and leaves the bias to the layer's bias-dropout-add. Gated units
(SwiGLU) are refused: contiguous ``out`` shards would mix Megatron's stacked ``[gate; up]``.
"""
from __future__ import annotations

import torch

from megatron_oases.layers.atp_attention import check_megatron_config, param_device
from megatron_oases.layers.atp_linear import (ColumnFirstLinear, RowFirstLinear,
                                              count_once_in_grad_norm_, mesh_sharded_state_dict)
from megatron_oases.mcore_compat import accept_submodule_kwargs
from megatron_oases.parallel.mesh import MeshGroups


class ATPMLP(torch.nn.Module):
    """Drop-in for Megatron's ``MLP`` in ``TransformerLayer``: ``forward(x) -> (out, bias)``."""

    def __init__(self, config, submodules=None, *, mesh_groups: MeshGroups, chunks: int = 1,
                 tp_group=None, input_size: int | None = None, ffn_hidden_size: int | None = None,
                 **megatron_kwargs):
        super().__init__()
        accept_submodule_kwargs("ATPMLP", megatron_kwargs)
        check_megatron_config(config, mesh_groups, "ATPMLP")
        self.config, self.mesh_groups = config, mesh_groups
        self.gated = config.gated_linear_unit
        self.activation_func = config.activation_func
        hidden = input_size or config.hidden_size
        ffn = ffn_hidden_size or config.ffn_hidden_size
        common = dict(bias=config.add_bias_linear, chunks=chunks, chunk_dim=1,
                      params_dtype=config.params_dtype, device=param_device(config))
        # SwiGLU: fc1 computes gate and up ([gate; up], 2 x ffn rows, as Megatron's MLP)
        self.linear_fc1 = ColumnFirstLinear(hidden, 2 * ffn if self.gated else ffn, mesh_groups,
                                            init_method=config.init_method, gated=self.gated,
                                            **common)
        self.linear_fc2 = RowFirstLinear(ffn, hidden, mesh_groups, skip_bias_add=True,
                                         init_method=config.output_layer_init_method, **common)
        count_once_in_grad_norm_(self, mesh_groups)

    def forward(self, hidden_states, padding_mask=None, **kwargs):
        """``[s, b, h/d2]`` -> ``(output [s, b, h/d2], bias [h/d2] or None)``."""
        intermediate = self.activate(self.linear_fc1(hidden_states))  # [s, b, 4h/d1], f3
        return self.linear_fc2(intermediate), self.linear_fc2.bias      # f4

    def activate(self, fc1_out):
        """The activation of fc1's output (with its bias): ``act(gate) * up`` for a gated unit,
        whose local rows hold this rank's gate and up halves."""
        if self.gated:
            gate, up = torch.chunk(fc1_out, 2, dim=-1)
            return self.activation_func(gate) * up
        return self.activation_func(fc1_out)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return mesh_sharded_state_dict(self, self.mesh_groups, prefix, sharded_offsets,
                                       metadata=metadata)
