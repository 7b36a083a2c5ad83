"""The shared layer description agrees with Megatron's FLOPs formula and with the collectives a
real Megatron-Core layer issues (the executors, planner and simulator all read it)."""
from __future__ import annotations

import pytest

from megatron_oases.flops import gpt_flops_per_iteration
from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
from tests import rank_fns


def test_flops_match_megatron_formula():
    b, s, h, a, L, V = 4, 128, 256, 8, 1, 1
    d = megatron_1d_gpt_layer(micro_batch=b, seq=s, hidden=h, heads=a, ffn=4 * h, tp=1)
    per_layer = d.flops("forward") + d.flops("backward")
    total = gpt_flops_per_iteration(global_batch_size=b, seq_length=s, num_layers=L, hidden_size=h,
                                    num_attention_heads=a, ffn_hidden_size=4 * h, padded_vocab_size=V)
    logits = 3 * 2 * b * s * V * h  # the formula's V term, fwd + bwd
    assert per_layer == pytest.approx(total - logits, rel=1e-12)


def test_tp_divides_compute():
    one = megatron_1d_gpt_layer(micro_batch=2, seq=16, hidden=64, heads=4, ffn=256, tp=1)
    four = megatron_1d_gpt_layer(micro_batch=2, seq=16, hidden=64, heads=4, ffn=256, tp=4)
    assert four.flops() * 4 == pytest.approx(one.flops())


def test_collectives_match_a_real_megatron_layer(on_ranks):
    tp = 2
    seen = on_ranks(rank_fns.megatron_layer_collectives, tp, tp, False)[0]
    d = megatron_1d_gpt_layer(micro_batch=2, seq=8, hidden=16, heads=4, ffn=64, tp=tp)
    for pass_ in ("forward", "backward"):
        real = sorted((k, n) for p, k, n in seen if p == pass_)
        described = sorted((c.kind, c.payload_bytes) for c in d.collectives(pass_))
        assert real == described, (pass_, real, described)
