"""3-D MLP for Megatron's TransformerLayer (Bian et al. 2021, §3.2, Fig. 6b).

``linear_fc1`` is a ``Linear3D`` with input direction y (the block's layout): its output comes back
in ``activation_layout("z")`` (samples in x, z; the ``ffn`` columns in y). ``linear_fc2`` takes z
and returns to y, the paper's "exchange after the first linear": the MLP leaves the hidden states in
the layout it got them in, with no resharding. Per micro-batch of ``M`` tokens the forward moves,
per GEMM, the paper's ``(MN + NK + MK) / p^3`` elements per rank in three collectives of p ranks.
Like Megatron's ``MLP`` it returns ``(output, bias)``; the bias is added inside fc2 (Algorithm 7),
so the bias slot is None. Gated units (SwiGLU) are refused: Megatron stacks ``[gate; up]`` on
``out``, which contiguous cube blocks would mix.
"""
from __future__ import annotations

import torch

from megatron_oases.layers.linear3d import cube_sharded_state_dict
from megatron_oases.layers.tp3d_attention import check_3d_config, linear_3d
from megatron_oases.mcore_compat import accept_submodule_kwargs
from megatron_oases.parallel.cube import CubeGroups
from megatron_oases.errors import ConfigError


class MLP3D(torch.nn.Module):
    """Drop-in for Megatron's ``MLP`` in ``TransformerLayer``: ``forward(x) -> (out, None)``."""

    def __init__(self, config, submodules=None, *, cube_groups: CubeGroups, tp_group=None,
                 input_size: int | None = None, ffn_hidden_size: int | None = None, **megatron_kwargs):
        super().__init__()
        accept_submodule_kwargs("MLP3D", megatron_kwargs)
        check_3d_config(config, cube_groups, "MLP3D")
        self.gated = config.gated_linear_unit
        if self.gated and config.add_bias_linear:
            raise ConfigError("MLP3D: --swiglu with linear biases is not supported with --tp-backend "
                              "3d; add --disable-bias-linear")
        self.config, self.groups = config, cube_groups
        self.activation_func = config.activation_func
        hidden = input_size or config.hidden_size
        ffn = ffn_hidden_size or config.ffn_hidden_size
        # SwiGLU: fc1 computes [gate; up]; each y-part of its output features holds its own
        # gate and up rows (layers/gated_rows.py), the split its output activation has too
        self.linear_fc1 = linear_3d(config, hidden, 2 * ffn if self.gated else ffn, cube_groups,
                                    input_dir="y", bias=config.add_bias_linear,
                                    init_method=config.init_method)
        self.linear_fc1.weight.gated_rows = self.gated
        self.linear_fc2 = linear_3d(config, ffn, hidden, cube_groups,
                                    input_dir=self.linear_fc1.output_dir,
                                    bias=config.add_bias_linear,
                                    init_method=config.output_layer_init_method)

    def forward(self, hidden_states, padding_mask=None, **kwargs):
        """``[s, b/p^2, h/p]`` (layout y) -> ``(output [s, b/p^2, h/p] (layout y), None)``."""
        fc1 = self.linear_fc1(hidden_states)                 # [s, b/p^2, ffn/p] (x 2 gated)
        if self.gated:
            gate, up = torch.chunk(fc1, 2, dim=-1)
            return self.linear_fc2(self.activation_func(gate) * up), None
        return self.linear_fc2(self.activation_func(fc1)), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return cube_sharded_state_dict(self, self.groups, prefix, sharded_offsets,
                                       metadata=metadata)
