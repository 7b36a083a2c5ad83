"""The local step every TP backend's attention takes between its QKV GEMM and Megatron's core
attention, for the heads a rank owns: split Megatron's QKV rows into queries, keys and values
(per key/value group ``[q_1 .. q_k, k, v]``, k = heads / groups), then QK-norm and rotary
embeddings, as Megatron's ``SelfAttention`` does for its TP partition. ATP and 3-D hold whole
key/value groups per rank, so the same split applies to their own rows."""
from __future__ import annotations

import torch


def qk_norms(config, head_dim: int):
    """Megatron's per-head-dim q and k norms when ``config.qk_layernorm`` (else ``(None, None)``):
    replicated on every rank of a backend whose heads are split; each rank's heads give a partial
    gradient, which Megatron's ``finalize_model_grads`` sums over the TP group (parameters named
    ``q_layernorm`` / ``k_layernorm``)."""
    if not config.qk_layernorm:
        return None, None
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return tuple(WrappedTorchNorm(config=config, hidden_size=head_dim, eps=config.layernorm_epsilon)
                 for _ in range(2))


def split_own_heads(qkv: torch.Tensor, head_dim: int, heads_per_group: int, q_layernorm=None,
                    k_layernorm=None, rotary_pos_emb=None, config=None):
    """``[s, b, own groups x (k + 2) x hd]`` QKV rows -> query ``[s, b, own heads, hd]``, key and
    value ``[s, b, own groups, hd]``, with QK-norm and rotary embeddings applied."""
    s, b = qkv.shape[:2]
    qkv = qkv.view(s, b, -1, (heads_per_group + 2) * head_dim)
    query, key, value = torch.split(qkv, [heads_per_group * head_dim, head_dim, head_dim], dim=-1)
    query = query.reshape(s, b, -1, head_dim)
    if q_layernorm is not None:
        query, key = q_layernorm(query), k_layernorm(key)
    if rotary_pos_emb is not None:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb

        q_emb, k_emb = (rotary_pos_emb if isinstance(rotary_pos_emb, tuple)
                        else (rotary_pos_emb, rotary_pos_emb))
        query = apply_rotary_pos_emb(query, q_emb, config=config)
        key = apply_rotary_pos_emb(key, k_emb, config=config)
    return query, key, value
