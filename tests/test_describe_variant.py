"""The layer variant's RoPE and QK-norm in the Megatron 1-D description: event keys, element-wise
bytes, parameters (pure Python; saved bytes are measured in test_saved_bytes_budget.py)."""
from __future__ import annotations

import pytest

from megatron_oases.describe.event_key import layer_shape
from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
from megatron_oases.describe.ops import GPT2, LayerVariant
from megatron_oases.describe.registry import layer_params
from megatron_oases.sim.calibrate.layer_workloads import variant_of

SHAPE = dict(micro_batch=4, seq=16, hidden=64, heads=8, ffn=256, tp=2, bytes_per_element=2)


def _key(variant):
    return layer_shape(b=4, s=16, h=64, a=8, f=256, t=2, v=128, dtype="bf16", backend="megatron", layout=None,
                       hidden_dropout=0.0, attention_dropout=0.0, chains=1, variant=variant)


@pytest.mark.parametrize("variant, suffix", [
    (GPT2, ""), (LayerVariant(rotary=True), "_rope"), (LayerVariant(rotary=True, rotary_percent=0.5), "_rope0.5"),
    (LayerVariant(qk_norm=True), "_qkn"),
    (LayerVariant(query_groups=2, normalization="RMSNorm", rotary=True, qk_norm=True), "_g2_rms_rope_qkn")])
def test_event_keys_name_rope_and_qk_norm_and_parse_back(variant, suffix):
    key, dims = _key(variant)
    assert key == f"b4s16h64a8f256t2_bf16{suffix}"
    assert variant_of(dict(dims)) == variant  # the profiler builds the same layer


def test_llama_keys_without_rope_keep_their_dims():
    _, dims = _key(LayerVariant(gated=True))
    assert "rope" not in dict(dims) and "qkn" not in dict(dims)


def test_rope_and_qk_norm_each_read_and_write_queries_and_keys():
    def attention_bytes(variant):
        return megatron_1d_gpt_layer(**SHAPE, variant=variant).computes()[0].elementwise_bytes

    for groups in (None, 2):
        base = LayerVariant(query_groups=groups)
        qk = 4 * 16 * 8 * (8 + (groups or 8)) // 2  # queries and keys on a rank: b s d (a + g) / t
        for on in (dict(rotary=True), dict(qk_norm=True)):
            variant = LayerVariant(query_groups=groups, **on)
            assert attention_bytes(variant) - attention_bytes(base) == 2 * 2 * qk
    assert megatron_1d_gpt_layer(**SHAPE, variant=LayerVariant(rotary=True)).flops() == \
        megatron_1d_gpt_layer(**SHAPE).flops()


def test_qk_norm_weights_are_replicated_and_rope_has_none():
    kw = dict(heads=8)
    for t in (1, 2, 4):
        extra = layer_params("megatron", 64, 256, t, None, **kw, variant=LayerVariant(qk_norm=True)) \
            - layer_params("megatron", 64, 256, t, None, **kw)
        assert extra == 4 * 8  # q and k LayerNorm weight and bias of head_dim 8, whatever the TP
    assert layer_params("megatron", 64, 256, 2, None, **kw, variant=LayerVariant(rotary=True)) == \
        layer_params("megatron", 64, 256, 2, None, **kw)
    with pytest.raises(ValueError, match="rotary_percent"):
        LayerVariant(rotary_percent=0.5)
