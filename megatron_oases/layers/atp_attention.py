"""ATP self-attention for Megatron's TransformerLayer (ATP paper §3.2.2, ops f1 / f2).

Dataflow on a ``d1 x d2`` mesh, hidden states ``[s, b, h]`` in the between-layer spec
``[Replicate, Shard(h)]`` (local ``[s, b, h/d2]``):

| step                         | local shape          | spec                    | collective        |
|------------------------------|----------------------|-------------------------|-------------------|
| linear_qkv (column-first)    | [s, b, 3h/d1]        | [Shard(h), Replicate]   | f1: AR axis 2     |
| scatter heads over axis 2    | [s, b, 3h/N]         | [Shard(h), Shard(h)]    | bwd: AG axis 2    |
| core attention               | [s, b, h/N]          | fully sharded by head   | none              |
| gather heads over axis 2     | [s, b, h/d1]         | [Shard(h), Replicate]   | fwd: AG axis 2    |
| linear_proj (row-first)      | [s, b, h/d2]         | [Replicate, Shard(h)]   | f2: AR axis 1     |

Megatron lays QKV rows out head by head (``[q_h, k_h, v_h]`` per head), so contiguous splits of
``out`` keep heads whole: the rank at TP position ``r = i d2 + j`` owns heads
``[r nh/N, (r+1) nh/N)``, exactly Megatron's TP head partition. The core is the one of
``--attention-backend`` (``config.attention_backend``; ``layers/core_attention.py``: SDPA, or
Megatron's ``DotProductAttention`` for ``local``) built on the whole TP group (so heads per
partition = ``nh / N``); it draws attention dropout under ``get_cuda_rng_tracker().fork()``. ``linear_proj``'s bias is
returned, not added, so the layer's bias-dropout-add sees ``(output, bias)`` as with Megatron.
"""
from __future__ import annotations

import torch

from megatron_oases.layers import refuse_unsupported
from megatron_oases.layers.core_attention import core_attention_class
from megatron_oases.layers.qkv_heads import qk_norms, split_own_heads
from megatron_oases.layers.atp_linear import (ColumnFirstLinear, RowFirstLinear,
                                              count_once_in_grad_norm_, mesh_sharded_state_dict)
from megatron_oases.mcore_compat import accept_submodule_kwargs
from megatron_oases.parallel import collectives as C
from megatron_oases.errors import ConfigError
from megatron_oases.parallel.mesh import MeshGroups


def check_megatron_config(config, mesh_groups: MeshGroups, what: str) -> None:
    """One-line errors for Megatron features the ATP layers do not implement (yet)."""
    import torch.distributed as dist

    m = mesh_groups.mesh
    if getattr(config, "sequence_parallel", False):
        raise ConfigError(f"{what}: --sequence-parallel is not supported with --tp-backend atp")
    if getattr(config, "context_parallel_size", 1) != 1:
        raise ConfigError(f"{what}: --context-parallel-size > 1 is not supported with --tp-backend atp")
    if config.tensor_model_parallel_size != m.size:
        raise ConfigError(f"{what}: --atp-mesh {m.d1}x{m.d2} needs --tensor-model-parallel-size "
                          f"{m.size} (got {config.tensor_model_parallel_size})")
    for axis in (1, 2):  # splits and gathers index shards by group rank: it must be the mesh index
        if dist.get_rank(mesh_groups.group(axis)) != mesh_groups.index(axis):
            raise ConfigError(f"{what}: --atp-mesh axis-{axis} group order differs from the mesh "
                              "order (TP ranks must be increasing)")


def param_device(config):
    """Where parameters live: CPU with ``--use-cpu-initialization`` or without CUDA."""
    from megatron_oases.runtime import current_runtime

    if getattr(config, "use_cpu_initialization", True):
        return torch.device("cpu")
    return current_runtime().device


class ATPSelfAttention(torch.nn.Module):
    """Drop-in for Megatron's ``SelfAttention`` in ``TransformerLayer`` (same call and return)."""

    def __init__(self, config, layer_number: int = 1, attn_mask_type=None, pg_collection=None,
                 cp_comm_type=None, *, mesh_groups: MeshGroups, chunks: int = 1, submodules=None,
                 **megatron_kwargs):
        super().__init__()
        accept_submodule_kwargs("ATPSelfAttention", megatron_kwargs)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType

        check_megatron_config(config, mesh_groups, "ATPSelfAttention")
        m = mesh_groups.mesh
        nh, ng = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        if nh % m.size != 0 or ng % m.size != 0:
            raise ConfigError(f"ATPSelfAttention: --num-attention-heads {nh} and the key/value "
                              f"groups {ng} must be divisible by --atp-mesh {m.d1}x{m.d2} "
                              f"({m.size} ranks: each holds whole groups)")
        self.config, self.layer_number, self.mesh_groups = config, layer_number, mesh_groups
        self.attn_mask_type = attn_mask_type if attn_mask_type is not None else AttnMaskType.causal
        self.head_dim = config.kv_channels
        self.heads_per_group = nh // ng
        proj = self.head_dim * nh
        qkv_out = self.head_dim * (nh + 2 * ng)  # Megatron's rows: per group [q..., k, v]
        bias = config.add_bias_linear or config.add_qkv_bias
        common = dict(chunks=chunks, chunk_dim=1, params_dtype=config.params_dtype,
                      device=param_device(config))
        # Megatron's Attention builds linear_proj before SelfAttention builds linear_qkv, so with
        # --use-cpu-initialization it draws the projection's full weight first: same order here,
        # so ATP starts from Megatron's weights (registration order stays qkv, proj).
        linear_proj = RowFirstLinear(proj, config.hidden_size, mesh_groups,
                                     bias=config.add_bias_linear, skip_bias_add=True,
                                     init_method=config.output_layer_init_method, **common)
        self.linear_qkv = ColumnFirstLinear(config.hidden_size, qkv_out, mesh_groups, bias=bias,
                                            init_method=config.init_method, **common)
        # QK-norm: replicated on every rank (no mesh layout: saved from TP rank 0)
        self.q_layernorm, self.k_layernorm = qk_norms(config, self.head_dim)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.core_attention = core_attention_class(config.attention_backend)(
            config=config, layer_number=layer_number, attn_mask_type=self.attn_mask_type,
            attention_type="self", pg_collection=pg_collection)
        self.linear_proj = linear_proj
        count_once_in_grad_norm_(self, mesh_groups)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """``hidden_states`` ``[s, b, h/d2]`` -> ``(output [s, b, h/d2], bias [h/d2] or None)``."""
        refuse_unsupported("ATPSelfAttention", key_value_states=key_value_states,
                           inference_context=inference_context,
                           rotary_pos_cos=rotary_pos_cos, packed_seq_params=packed_seq_params,
                           inference_params=inference_params)
        axis2 = self.mesh_groups.group(2)
        qkv = self.linear_qkv(hidden_states)                 # [s, b, 3h/d1], f1
        qkv = C.split_dim(qkv, -1, axis2)                    # [s, b, 3h/N]: own heads only
        context = self.core(qkv, attention_mask, attention_bias, rotary_pos_emb)  # [s, b, h/N]
        context = C.gather_dim(context, -1, axis2)           # [s, b, h/d1]
        output = self.linear_proj(context)                   # [s, b, h/d2], f2
        return output, self.linear_proj.bias

    def core(self, qkv, attention_mask=None, attention_bias=None, rotary_pos_emb=None):
        """Local math between the head split and the head gather: own groups' QKV rows
        ``[s, b, (heads + 2 groups) hd / N]`` -> context ``[s, b, h/N]`` (QK-norm, rotary
        embeddings, the core attention; no collective)."""
        query, key, value = split_own_heads(qkv, self.head_dim, self.heads_per_group,
                                            self.q_layernorm, self.k_layernorm, rotary_pos_emb,
                                            self.config)
        return self.core_attention(query, key, value, attention_mask,
                                   attn_mask_type=self.attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return mesh_sharded_state_dict(self, self.mesh_groups, prefix, sharded_offsets,
                                       metadata=metadata)
