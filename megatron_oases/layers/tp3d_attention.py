"""3-D self-attention for Megatron's TransformerLayer (Bian et al. 2021, §3.2, Fig. 6a).

Between layers a rank ``(i, j, l)`` of the cube holds ``activation_layout("y")`` of the hidden
states: samples block ``i p + j`` of the micro-batch (``b / p^2`` whole sequences) and hidden
columns block ``l`` (``h / p``), as a local ``[s, b/p^2, h/p]``. Rows are split by *samples*, not
positions, so attention needs no token exchange (what Colossal-AI's 3-D layers do: split the batch
over the input and weight directions):

| step                           | local shape          | layout (rows / cols)          | collectives           |
|--------------------------------|----------------------|-------------------------------|-----------------------|
| input                          | [s, b/p^2, h/p]      | samples (x, y) / hidden (z)   |                       |
| linear_qkv (Linear3D, y -> z)  | [s, b/p^2, 3h/p]     | samples (x, z) / heads (y)    | AG y, AG x, RS z; bias|
| core attention                 | [s, b/p^2, h/p]      | nh/p heads of b/p^2 samples   | none                  |
| linear_proj (Linear3D, z -> y) | [s, b/p^2, h/p]      | samples (x, y) / hidden (z)   | AG z, AG x, RS y; bias|

Megatron lays QKV rows out head by head (``[q_h, k_h, v_h]``), and ``linear_qkv``'s weight rows
are split by y into contiguous blocks, so rank ``(i, j, l)`` computes heads
``[j nh/p, (j+1) nh/p)`` for samples block ``i p + l``: every (sample, head) pair exactly once on
the cube. The core is the one of ``--attention-backend`` (``config.attention_backend``;
``layers/core_attention.py``) built on the y group (heads per partition ``nh / p``); it draws
attention dropout under ``get_cuda_rng_tracker().fork()``, which differs per TP rank, so the
p^3 blocks get independent masks. Biases are added inside the linears (Algorithm 7), so
``forward`` returns ``(output, None)`` and the layer's bias-dropout-add just drops and adds.
"""
from __future__ import annotations

import torch

from megatron_oases.layers import refuse_unsupported
from megatron_oases.layers.core_attention import core_attention_class
from megatron_oases.layers.linear3d import Linear3D, activation_layout, cube_sharded_state_dict
from megatron_oases.layers.qkv_heads import qk_norms, split_own_heads
from megatron_oases.mcore_compat import accept_submodule_kwargs
from megatron_oases.parallel.cube import CubeGroups, other_dir
from megatron_oases.errors import ConfigError


def check_3d_config(config, groups: CubeGroups, what: str) -> None:
    """One-line errors for Megatron features the 3-D layers do not implement (yet)."""
    import torch.distributed as dist

    flag = "--tp-backend 3d"
    if getattr(config, "sequence_parallel", False):
        raise ConfigError(f"{what}: --sequence-parallel is not supported with {flag}")
    if getattr(config, "context_parallel_size", 1) != 1:
        raise ConfigError(f"{what}: --context-parallel-size > 1 is not supported with {flag}")
    if config.tensor_model_parallel_size != groups.cube.tp_size:
        raise ConfigError(f"{what}: the cube has {groups.cube.tp_size} ranks but "
                          f"--tensor-model-parallel-size is {config.tensor_model_parallel_size}")
    for d in "xyz":  # gathers and splits index blocks by group rank: it must be the coordinate
        if dist.get_rank(groups.group(d)) != groups.pos(d):
            raise ConfigError(f"{what}: the {d} group order differs from the cube coordinates "
                              "(TP ranks must be increasing)")


def linear_3d(config, in_features: int, out_features: int, groups: CubeGroups, *, input_dir: str,
              bias: bool, init_method) -> Linear3D:
    """A ``Linear3D`` on ``config``'s device, initialised as Megatron's own linears are: with
    ``use_cpu_initialization``, a full ``[out, in]`` master weight drawn with ``init_method`` from
    the default generator (the same draw as Megatron's ``_initialize_affine_weight_cpu``, equal on
    every TP rank), kept on the weight as ``cpu_master`` until ``place_cpu_masters`` gives each rank
    its shard; otherwise the shard is drawn under the model-parallel RNG tracker (a different
    stream per TP rank, as Megatron's GPU init)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_oases.layers.atp_attention import param_device

    lin = Linear3D(in_features, out_features, groups, input_dir=input_dir, bias=bias, init_std=0.0,
                   dtype=config.params_dtype).to(param_device(config))
    if getattr(config, "perform_initialization", True) and init_method is not None:
        if getattr(config, "use_cpu_initialization", False):
            master = torch.empty(out_features, in_features, dtype=torch.float32)
            init_method(master)
            lin.weight.cpu_master = master
        else:
            with get_cuda_rng_tracker().fork():
                init_method(lin.weight.data)
    return lin


@torch.no_grad()
def place_cpu_masters(module: torch.nn.Module) -> None:
    """Copy each rank's shard of the ``cpu_master`` weights ``linear_3d`` drew into the
    parameters (through the module's ``sharded_state_dict``, which knows every shard's region,
    SwiGLU's gate and up rows included), then drop the masters."""
    from megatron_oases.parallel.layout import param_shards

    for shard in param_shards([module]):
        master = getattr(shard.param, "cpu_master", None)
        if master is not None:
            shard.local(shard.param).copy_(master[shard.index])
    for p in module.parameters():
        if hasattr(p, "cpu_master"):
            del p.cpu_master


def local_samples(t: torch.Tensor, dim: int, groups: CubeGroups, rows: tuple[str, str]):
    """The samples block of ``t`` (split along ``dim``) a rank holds under row directions ``rows``."""
    p = groups.p
    n = t.shape[dim] // (p * p)
    k = groups.pos(rows[0]) * p + groups.pos(rows[1])
    return t.narrow(dim, k * n, n)


class SelfAttention3D(torch.nn.Module):
    """Drop-in for Megatron's ``SelfAttention`` in ``TransformerLayer`` (same call and return)."""

    def __init__(self, config, layer_number: int = 1, attn_mask_type=None, pg_collection=None,
                 cp_comm_type=None, *, cube_groups: CubeGroups, submodules=None, **megatron_kwargs):
        super().__init__()
        accept_submodule_kwargs("SelfAttention3D", megatron_kwargs)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType

        groups = cube_groups
        check_3d_config(config, groups, "SelfAttention3D")
        nh, ng = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        if nh % groups.p or ng % groups.p:
            raise ConfigError(f"SelfAttention3D: --num-attention-heads {nh} and the key/value "
                              f"groups {ng} must be divisible by p = {groups.p} (--tp-backend 3d, "
                              f"--tensor-model-parallel-size {groups.p ** 3})")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ConfigError("SelfAttention3D: only the vanilla softmax is supported with "
                              "--tp-backend 3d")
        self.config, self.layer_number, self.groups = config, layer_number, groups
        self.attn_mask_type = attn_mask_type if attn_mask_type is not None else AttnMaskType.causal
        self.head_dim = config.kv_channels
        self.heads_per_group = nh // ng
        proj = self.head_dim * nh
        qkv_out = self.head_dim * (nh + 2 * ng)  # Megatron's rows: per group [q..., k, v]
        heads = ProcessGroupCollection()
        # QKV (input direction y) splits its output columns (heads) by y: nh / p heads per rank
        heads.tp = groups.group("y")
        # Megatron's order (core attention, proj, then QKV), so CPU-initialised masters are the
        # same draws as stock's
        self.core_attention = core_attention_class(config.attention_backend)(
            config=config, layer_number=layer_number, attn_mask_type=self.attn_mask_type,
            attention_type="self", pg_collection=heads)
        self.linear_proj = linear_3d(config, proj, config.hidden_size, groups,
                                     input_dir=other_dir("y"), bias=config.add_bias_linear,
                                     init_method=config.output_layer_init_method)
        self.linear_qkv = linear_3d(config, config.hidden_size, qkv_out, groups, input_dir="y",
                                    bias=config.add_bias_linear or config.add_qkv_bias,
                                    init_method=config.init_method)
        assert self.linear_proj.input_dir == self.linear_qkv.output_dir
        # rows of the attention core: samples block (x, z) of the QKV output
        self.sample_rows = activation_layout(self.linear_qkv.output_dir).rows
        self.q_layernorm, self.k_layernorm = qk_norms(config, self.head_dim)  # replicated

    def forward(self, hidden_states, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """``[s, b/p^2, h/p]`` (layout y) -> ``(output [s, b/p^2, h/p] (layout y), None)``."""
        refuse_unsupported("SelfAttention3D", key_value_states=key_value_states,
                           inference_context=inference_context,
                           rotary_pos_cos=rotary_pos_cos, attention_bias=attention_bias,
                           packed_seq_params=packed_seq_params, inference_params=inference_params)
        if attention_mask is not None and attention_mask.shape[0] > 1:  # [b, 1, s, s]
            attention_mask = local_samples(attention_mask, 0, self.groups, self.sample_rows)
        qkv = self.linear_qkv(hidden_states)                 # [s, b/p^2, 3h/p], heads block j
        query, key, value = split_own_heads(qkv, self.head_dim, self.heads_per_group,
                                            self.q_layernorm, self.k_layernorm, rotary_pos_emb,
                                            self.config)
        context = self.core_attention(query, key, value, attention_mask,
                                      attn_mask_type=self.attn_mask_type,
                                      attention_bias=None, packed_seq_params=None)
        return self.linear_proj(context), None               # [s, b/p^2, h/p], layout y

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return cube_sharded_state_dict(self, self.groups, prefix, sharded_offsets,
                                       metadata=metadata)
