"""Saved-bytes budget per layer, per schedule and recompute mode: what a layer's forward keeps
for its backward, measured with saved-tensor hooks (``runtime.saved_tensors``: autograd's live
saved storages plus the Oases executor's step state, parameters excluded), equals the
description's ``describe.saved.layer_saved_bytes`` with the CPU kernels' sizes, for each core
attention (``--attention-backend``: ``local`` is Megatron's ``DotProductAttention``; SDPA's fused
kernel, ``auto`` without dropout on CPU; SDPA's math kernel, ``unfused`` or ``auto`` with dropout
on CPU: ``describe.core_attention``).

One layer's bytes are the difference between a 2-layer and a 1-layer model (same head), so the
embedding, output layer and loss cancel out."""
from __future__ import annotations

import pytest

from megatron_oases.describe.saved import CPU_KERNELS, layer_saved_bytes
from megatron_oases.runtime.spawn import run_on_ranks
from tests.rank_fns_saved import saved_bytes_of_forwards

RC = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
ROPE, QKN = ["--position-embedding-type", "rope"], ["--qk-layernorm"]
CASES = {  # name: (trainer flags, the mode's ``layer_saved_bytes`` arguments)
    "stock": ([], {}),
    "stock-full-recompute": (RC, dict(recompute=True)),
    # Megatron checkpoints the core attention: no s^2 tensor, no causal mask; + its 4-byte mask type
    "stock-selective-recompute": (["--recompute-granularity", "selective"], dict(recompute_core_attention=True)),
    "oases": (["--schedule", "oases"], dict(schedule="oases")),
    "oases-fine-grained-recompute": (["--schedule", "oases", *RC, "--oases-fine-grained-recompute"],
                                     dict(schedule="oases", recompute=True)),
    "oases-full-recompute": (["--schedule", "oases", *RC, "--no-oases-fine-grained-recompute"],
                             dict(schedule="oases", recompute=True, fine_grained=False)),
}


SDPA = {  # name: (--attention-backend, attention dropout) -> the kernel that runs on CPU
    "fused": ("auto", 0.0),  # torch's CPU flash kernel
    "math-dropout": ("auto", 0.1),  # the CPU flash kernel has no dropout: SDPA's math kernel
    "unfused": ("unfused", 0.0),  # SDPA's math kernel without dropout
}
KIND = {"auto": "fused", "unfused": "unfused", "local": "local"}


def _argv(layers, *, tp, b, s, h, a, dropout, bf16, extra, attention="local"):
    return ["--attention-backend", attention, "--num-layers", str(layers), "--hidden-size", str(h), "--num-attention-heads", str(a),
            "--seq-length", str(s), "--vocab-size", "256", "--micro-batch-size", str(b),
            "--global-batch-size", str(b), "--device", "cpu", "--tensor-model-parallel-size",
            str(tp), "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
            *(["--bf16"] if bf16 else []), *extra]


def _measured_per_layer(**kw) -> int:
    """One layer's saved bytes (``_argv``'s keywords; ``attention``: the ``--attention-backend``)."""
    # both models in one spawned group (a spawn per model cost more than the forwards)
    ranks = run_on_ranks(saved_bytes_of_forwards, kw["tp"], args=([_argv(n, **kw) for n in (1, 2)],),
                         timeout_s=180)
    one, two = [r[0] for r in ranks], [r[1] for r in ranks]
    assert one[0] == one[-1] and two[0] == two[-1]  # TP ranks keep the same bytes
    return two[0] - one[0]


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("case", list(CASES))
def test_saved_bytes_per_layer_equal_the_description(case, dropout):
    flags, mode = CASES[case]
    shape = dict(tp=2, b=4, s=16, h=32, a=4)
    got = _measured_per_layer(**shape, dropout=dropout, bf16=False, extra=flags)
    want = layer_saved_bytes(**mode, b=4, s=16, h=32, a=4, f=128, t=2, e=4, hidden_dropout=dropout > 0,
                             attention_dropout=dropout > 0, kernels=CPU_KERNELS)
    assert got == want


@pytest.mark.parametrize("sdpa", list(SDPA))
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_saved_bytes_per_layer_equal_the_description(case, sdpa):
    """SDPA keeps no causal mask and, in its fused kernel, no s x s tensor: its inputs (as the
    checkpoint of selective recompute keeps them), its output (the context) and an fp32
    logsumexp; the math kernel its fp32 copies and scores. The Oases recompute keeps one
    generator state per sub-batch for the kernel's own draw."""
    flags, mode = CASES[case]
    backend, dropout = SDPA[sdpa]
    got = _measured_per_layer(tp=2, b=4, s=16, h=32, a=4, dropout=dropout, bf16=False, extra=flags,
                              attention=backend)
    want = layer_saved_bytes(**mode, b=4, s=16, h=32, a=4, f=128, t=2, e=4, hidden_dropout=dropout > 0,
                             attention_dropout=dropout > 0, kernels=CPU_KERNELS, core_attention=KIND[backend])
    assert got == want


@pytest.mark.parametrize("rope_qk_norm", [False, True], ids=["gpt", "rope+qk-norm"])
@pytest.mark.parametrize("schedule", ["stock", "oases", "stock-selective"])
@pytest.mark.parametrize("attention", [("local", 0.1), ("auto", 0.0), ("auto", 0.1)], ids=["local", "fused", "math"])
def test_saved_bytes_bf16_and_another_shape(schedule, rope_qk_norm, attention):
    """bf16 (norm statistics, CPU dropout noise and RoPE's cos and sin in the input's dtype; SDPA's
    logsumexp and its math kernel's copies and scores in fp32), 8 heads, s = 8, b = 2."""
    from megatron_oases.describe.ops import LayerVariant

    selective = schedule == "stock-selective"
    extra = ({"oases": ["--schedule", "oases"], "stock-selective": ["--recompute-granularity", "selective"]}
             .get(schedule, []) + (ROPE + QKN if rope_qk_norm else []))
    backend, dropout = attention
    got = _measured_per_layer(tp=2, b=2, s=8, h=32, a=8, dropout=dropout, bf16=True, extra=extra, attention=backend)
    want = layer_saved_bytes(schedule="stock" if selective else schedule, b=2, s=8, h=32, a=8, f=128, t=2, e=2,
                             kernels=CPU_KERNELS, recompute_core_attention=selective,
                             variant=LayerVariant(rotary=rope_qk_norm, qk_norm=rope_qk_norm),
                             hidden_dropout=dropout > 0, attention_dropout=dropout > 0, core_attention=KIND[backend])
    assert got == want


def test_oases_without_recompute_keeps_more_than_stock_as_priced():
    """Without recompute the Oases schedule keeps, beyond stock's inventory, only its second
    sub-batch's causal mask (its step boundaries are freed; with bool masks it keeps less for
    dropout): what the memory model adds."""
    kw = dict(b=4, s=16, h=32, a=4, f=128, t=2, e=4, kernels=CPU_KERNELS, hidden_dropout=False,
              attention_dropout=False)
    extra = layer_saved_bytes(schedule="oases", **kw) - layer_saved_bytes(schedule="stock", **kw)
    assert extra == 16 * 16


LLAMA_FLAGS = ["--group-query-attention", "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size",
               "96", "--normalization", "RMSNorm", "--disable-bias-linear"]


LLAMA = dict(query_groups=2, gated=True, normalization="RMSNorm", bias=False)
LAYERS = {  # name: (trainer flags, the description's variant fields)
    "llama": (LLAMA_FLAGS, LLAMA),
    "rope": (ROPE, dict(rotary=True)),
    "qk-norm": (QKN, dict(qk_norm=True)),
    "rope+qk-norm": (ROPE + QKN, dict(rotary=True, qk_norm=True)),
    "llama+half-rope+qk-norm": (LLAMA_FLAGS + ROPE + ["--rotary-percent", "0.5"] + QKN,
                                dict(LLAMA, rotary=True, rotary_percent=0.5, qk_norm=True)),
}


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("case", ["stock", "stock-selective-recompute", "oases", "oases-fine-grained-recompute"])
def test_saved_bytes_of_llama_layers(case, layer):
    """GQA (2 groups of 2 heads), SwiGLU (f 96), RMSNorm, no bias; RoPE (whole or half of each
    head) and QK-norm, with and without GQA: the description's variant."""
    from megatron_oases.describe.ops import LayerVariant

    flags, mode = CASES[case]
    layer_flags, fields = LAYERS[layer]
    got = _measured_per_layer(tp=2, b=4, s=16, h=32, a=4, dropout=0.1, bf16=False,
                              extra=flags + layer_flags)
    variant = LayerVariant(**fields)
    want = layer_saved_bytes(**mode, b=4, s=16, h=32, a=4, f=96 if variant.gated else 128, t=2, e=4,
                             kernels=CPU_KERNELS, variant=variant)
    assert got == want


@pytest.mark.parametrize("sdpa", list(SDPA))
@pytest.mark.parametrize("layer, case", [(layer, "stock") for layer in LAYERS] + [
    (layer, case) for layer in ("llama", "llama+half-rope+qk-norm")
    for case in ("stock-selective-recompute", "oases", "oases-fine-grained-recompute")])
def test_sdpa_saved_bytes_of_llama_layers(layer, case, sdpa):
    """GQA through ``enable_gqa`` (the groups' keys and values, not repeated: the fused kernel
    keeps QKV's output and the rotated queries and keys; the math kernel repeats them in fp32),
    RoPE, QK-norm, SwiGLU, RMSNorm under SDPA."""
    from megatron_oases.describe.ops import LayerVariant

    flags, mode = CASES[case]
    layer_flags, fields = LAYERS[layer]
    backend, dropout = SDPA[sdpa]
    got = _measured_per_layer(tp=2, b=4, s=16, h=32, a=4, dropout=dropout, bf16=False,
                              extra=flags + layer_flags, attention=backend)
    variant = LayerVariant(**fields)
    want = layer_saved_bytes(**mode, b=4, s=16, h=32, a=4, f=96 if variant.gated else 128, t=2, e=4,
                             hidden_dropout=dropout > 0, attention_dropout=dropout > 0, kernels=CPU_KERNELS,
                             variant=variant, core_attention=KIND[backend])
    assert got == want


def test_rope_and_qk_norm_keep_what_was_measured():
    """The numbers behind the description (TP 2, fp32, b 4, s 16, h 32, 4 heads, CPU): RoPE and
    QK-norm each keep 10,240 bytes more a layer, both 12,288; the Oases schedule rebuilds RoPE's
    cos and sin per sub-batch (+ 2,048)."""
    from megatron_oases.describe.ops import LayerVariant

    def extra(schedule, **fields):
        kw = dict(schedule=schedule, b=4, s=16, h=32, a=4, f=128, t=2, e=4, kernels=CPU_KERNELS)
        return layer_saved_bytes(**kw, variant=LayerVariant(**fields)) - layer_saved_bytes(**kw)

    assert (extra("stock", rotary=True), extra("stock", qk_norm=True)) == (10240, 10240)
    assert extra("stock", rotary=True, qk_norm=True) == 12288
    assert extra("oases", rotary=True) == 10240 + 2048


SP_CASES = ["stock", "stock-full-recompute", "stock-selective-recompute", "oases", "oases-fine-grained-recompute"]


@pytest.mark.parametrize("attention", ["local", "auto"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("case", SP_CASES)
def test_sequence_parallel_saved_bytes_per_layer_equal_the_description(case, dropout, attention):
    """``--sequence-parallel`` at TP 2 (the CPU SP norms of ``layers/torch_norm.py``): norms,
    column inputs (stock) and hidden dropout masks on s/t tokens; the Oases tape keeps the
    gathered inputs and its step boundaries; recompute keeps 1/t (stock) or 2 + 3/t (Oases
    fine-grained) hidden states."""
    flags, mode = CASES[case]
    got = _measured_per_layer(tp=2, b=4, s=16, h=32, a=4, dropout=dropout, bf16=False,
                              extra=flags + ["--sequence-parallel"], attention=attention)
    want = layer_saved_bytes(**mode, b=4, s=16, h=32, a=4, f=128, t=2, e=4, hidden_dropout=dropout > 0,
                             attention_dropout=dropout > 0, kernels=CPU_KERNELS, sequence_parallel=True,
                             core_attention=KIND[attention])
    assert got == want
