"""Saved-bytes budget per layer, per schedule and recompute mode: what a layer's forward keeps
for its backward, measured with saved-tensor hooks (``runtime.saved_tensors``: autograd's live
saved storages plus the Oases executor's step state, parameters excluded), equals the
description's ``describe.saved.layer_saved_bytes`` with the CPU kernels' sizes.

One layer's bytes are the difference between a 2-layer and a 1-layer model (same head), so the
embedding, output layer and loss cancel out."""
from __future__ import annotations

import pytest

from megatron_oases.describe.saved import CPU_KERNELS, layer_saved_bytes
from megatron_oases.runtime.spawn import run_on_ranks
from tests.rank_fns_saved import saved_bytes_of_one_forward

RC = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
CASES = {  # name: (trainer flags, schedule, recompute, fine-grained)
    "stock": ([], "stock", False, True),
    "stock-full-recompute": (RC, "stock", True, True),
    "oases": (["--schedule", "oases"], "oases", False, True),
    "oases-fine-grained-recompute": (["--schedule", "oases", *RC, "--oases-fine-grained-recompute"],
                                     "oases", True, True),
    "oases-full-recompute": (["--schedule", "oases", *RC, "--no-oases-fine-grained-recompute"],
                             "oases", True, False),
}


def _argv(layers, *, tp, b, s, h, a, dropout, bf16, extra):
    return ["--num-layers", str(layers), "--hidden-size", str(h), "--num-attention-heads", str(a),
            "--seq-length", str(s), "--vocab-size", "256", "--micro-batch-size", str(b),
            "--global-batch-size", str(b), "--device", "cpu", "--tensor-model-parallel-size",
            str(tp), "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
            *(["--bf16"] if bf16 else []), *extra]


def _measured_per_layer(**kw) -> int:
    one, two = (run_on_ranks(saved_bytes_of_one_forward, kw["tp"], args=(_argv(n, **kw),),
                             timeout_s=180) for n in (1, 2))
    assert one[0] == one[-1] and two[0] == two[-1]  # TP ranks keep the same bytes
    return two[0] - one[0]


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("case", list(CASES))
def test_saved_bytes_per_layer_equal_the_description(case, dropout):
    flags, schedule, recompute, fine = CASES[case]
    shape = dict(tp=2, b=4, s=16, h=32, a=4)
    got = _measured_per_layer(**shape, dropout=dropout, bf16=False, extra=flags)
    want = layer_saved_bytes(schedule=schedule, recompute=recompute, fine_grained=fine,
                             b=4, s=16, h=32, a=4, f=128, t=2, e=4, hidden_dropout=dropout > 0,
                             attention_dropout=dropout > 0, kernels=CPU_KERNELS)
    assert got == want


@pytest.mark.parametrize("schedule", ["stock", "oases"])
def test_saved_bytes_bf16_and_another_shape(schedule):
    """bf16 (norm statistics and CPU dropout noise in the input's dtype), 8 heads, s = 8, b = 2."""
    extra = ["--schedule", "oases"] if schedule == "oases" else []
    got = _measured_per_layer(tp=2, b=2, s=8, h=32, a=8, dropout=0.1, bf16=True, extra=extra)
    want = layer_saved_bytes(schedule=schedule, b=2, s=8, h=32, a=8, f=128, t=2, e=2,
                             kernels=CPU_KERNELS)
    assert got == want


def test_oases_without_recompute_keeps_more_than_stock_as_priced():
    """Without recompute the Oases schedule keeps the two all-reduce outputs per layer beyond
    stock's inventory (with bool masks it keeps less for dropout): what the memory model adds."""
    kw = dict(b=4, s=16, h=32, a=4, f=128, t=2, e=4, kernels=CPU_KERNELS, hidden_dropout=False,
              attention_dropout=False)
    extra = layer_saved_bytes(schedule="oases", **kw) - layer_saved_bytes(schedule="stock", **kw)
    assert extra == 2 * 4 * 16 * 32 * 4 + 16 * 16


LLAMA_FLAGS = ["--group-query-attention", "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size",
               "96", "--normalization", "RMSNorm", "--disable-bias-linear"]


@pytest.mark.parametrize("case", ["stock", "oases", "oases-fine-grained-recompute"])
def test_saved_bytes_of_llama_layers(case):
    """GQA (2 groups of 2 heads), SwiGLU (f 96), RMSNorm, no bias: the description's variant."""
    from megatron_oases.describe.ops import LayerVariant

    flags, schedule, recompute, fine = CASES[case]
    got = _measured_per_layer(tp=2, b=4, s=16, h=32, a=4, dropout=0.1, bf16=False,
                              extra=flags + LLAMA_FLAGS)
    variant = LayerVariant(query_groups=2, gated=True, normalization="RMSNorm", bias=False)
    want = layer_saved_bytes(schedule=schedule, recompute=recompute, fine_grained=fine, b=4, s=16,
                             h=32, a=4, f=96, t=2, e=4, kernels=CPU_KERNELS, variant=variant)
    assert got == want
