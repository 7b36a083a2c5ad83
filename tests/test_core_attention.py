"""The SDPA core attention (``layers/core_attention.py``, ``--attention-backend``) against Megatron's
``DotProductAttention`` (``local``).

* One process: the module against ``DotProductAttention`` (causal by type, by a causal mask, a
  padding mask; GQA; ``apply_query_key_layer_scaling``), fp32 to 1e-6 and bf16 no worse than
  local's own bf16 error against fp32 (+ 2^-8); dropout statistics; the Oases replay of a
  sub-batch's kernel draw; the flag mapping and its refusals.
* Training, fp32, dropout 0: losses and every gradient of ``auto`` equal ``local``'s (1e-5) for
  stock TP 2, Oases TP 2 (fine-grained recompute), ATP (2, 2), 3-D (TP 8) and a per-block plan,
  GPT-2-style and Llama-style (GQA, RoPE, QK-norm, SwiGLU, RMSNorm); bf16 stock TP 2 to 2^-6.
* Training with dropout under SDPA: Oases' fine-grained and full recompute give the gradients of
  Oases without recompute (each sub-batch's kernel draw is replayed). Each sub-batch draws its own
  mask inside the kernel; on CPU torch fills a dropout mask in element order, so the two
  sub-batches' draws (leading batch dim) are stock's draw of the whole micro-batch and Oases equals
  stock (to GEMM rounding; checked here). On CUDA that holds for the flash and efficient kernels,
  not for cuDNN's (``schedules/oases/dropout.py``); ``--attention-backend local`` shares stock's
  mask on every device (tests/test_oases_schedule.py).
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_oases.errors import ConfigError
from tests.conftest import assert_same_training
from tests.rank_fns_oases import run_training
from tests.script_modules import load_script

AP = load_script("scripts/attention_parity.py")
TOL = 1e-5
GPT2 = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "128", "--micro-batch-size", "4", "--global-batch-size", "4", "--seed", "7",
        "--train-iters", "2", "--optimizer", "sgd", "--lr", "0.05", "--device", "cpu",
        "--num-layers", "2"]
LLAMA = GPT2 + ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
                "--ffn-hidden-size", "64", "--group-query-attention", "--num-query-groups", "2",
                "--qk-layernorm", "--disable-bias-linear"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
OASES = ["--schedule", "oases"]
LOCAL, AUTO = ["--attention-backend", "local"], ["--attention-backend", "auto"]


# ----- one process ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_runtime():
    from megatron_oases.runtime import init_runtime

    init_runtime("cpu")


def _qkv(heads=4, groups=4, seq=16, batch=2, hn=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(seq, batch, n, hn, generator=g) for n in (heads, groups, groups))
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _fwd_bwd(core, qkv, mask=None):
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = core(*leaves, mask)
    out.backward(torch.ones_like(out).mul_(torch.linspace(-1, 1, out.numel()).view_as(out)))
    return [out.detach()] + [t.grad for t in leaves]


def _core(backend, *, heads=4, groups=4, hn=8, dtype="fp32", mask_type=None, **config):
    from megatron.core.transformer.enums import AttnMaskType

    cfg = AP._config(heads * hn, heads, groups, dtype)
    for k, v in config.items():
        setattr(cfg, k, v)
    core = AP.build_core(backend, cfg)
    if mask_type is not None:
        core.attn_mask_type = mask_type
        if hasattr(core, "scale_mask_softmax"):
            core.scale_mask_softmax.attn_mask_type = mask_type
    return core


def _causal(seq, batch=1):
    return torch.ones(seq, seq, dtype=torch.bool).triu(1).expand(batch, 1, seq, seq)


@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("mask", ["by-type", "causal-mask", "padding-mask"])
def test_sdpa_equals_dot_product_attention_fp32(cpu_runtime, groups, mask):
    from megatron.core.transformer.enums import AttnMaskType

    qkv = _qkv(groups=groups)
    m, mask_type = None, None
    if mask == "causal-mask":
        m = _causal(16, 2)
    elif mask == "padding-mask":  # causal, and the last 3 keys of sample 1 masked out
        m = _causal(16, 2).clone()
        m[1, :, 4:, -3:] = True
        mask_type = AttnMaskType.padding
    for backend in ("auto", "flash", "fused", "unfused"):
        got = _fwd_bwd(_core(backend, groups=groups, mask_type=mask_type), qkv, m)
        want = _fwd_bwd(_core("local", groups=groups, mask_type=mask_type), qkv, m)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert AP.rel_err(a, b) <= 1e-6, (backend, name, AP.rel_err(a, b))


def test_query_key_layer_scaling_keeps_the_scale(cpu_runtime):
    """Megatron divides its scores by the layer number and multiplies them back in its fp32
    softmax: the same attention as without the flag."""
    qkv = _qkv()
    kw = dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True)
    local = AP.build_core("local", _scaled_config(**kw), layer_number=3)
    got = _fwd_bwd(AP.build_core("auto", _scaled_config(**kw), layer_number=3), qkv)
    want = _fwd_bwd(local, qkv)
    assert local.softmax_scale != 1 / 8 ** 0.5  # the layer number is in Megatron's scale
    assert all(AP.rel_err(a, b) <= 1e-6 for a, b in zip(got, want))


def _scaled_config(**kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                             masked_softmax_fusion=False, use_cpu_initialization=True,
                             attention_dropout=0.0, **kw)


def test_bf16_no_worse_than_local(cpu_runtime):
    """bf16: each path's error against fp32 local; SDPA's within local's own + 2^-8."""
    qkv = _qkv(groups=2, seq=32)
    ref = _fwd_bwd(_core("local", groups=2), qkv)
    low = [t.detach().to(torch.bfloat16) for t in qkv]
    sdpa = _fwd_bwd(_core("auto", groups=2, dtype="bf16"), low)
    local = _fwd_bwd(_core("local", groups=2, dtype="bf16"), low)
    for name, s, l, r in zip(("out", "dq", "dk", "dv"), sdpa, local, ref):
        assert AP.rel_err(s, r) <= AP.rel_err(l, r) + 2 ** -8, name


@pytest.mark.parametrize("backend", ["auto", "local"])
def test_dropout_statistics(cpu_runtime, backend):
    """q = k = 0 gives uniform probabilities 1/sk; v = identity reads them out: each is dropped
    with probability p and the kept ones are scaled to 1/(sk (1-p))."""
    from megatron.core.transformer.enums import AttnMaskType

    p, sk, b, heads = 0.3, 32, 4, 4
    core = _core(backend, heads=heads, hn=sk, attention_dropout=p, mask_type=AttnMaskType.no_mask)
    core.train()
    if hasattr(core, "dropout_p"):
        core.dropout_p = p
    else:
        core.attention_dropout.p = p
    zeros = torch.zeros(sk, b, heads, sk)
    eye = torch.eye(sk).view(sk, 1, 1, sk).expand(sk, b, heads, sk)
    out = core(zeros, zeros, eye, None).view(sk, b, heads, sk)
    kept = out != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.02
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / (sk * (1 - p))), rtol=1e-5)


def test_oases_replays_each_sub_batch_kernel_draw(cpu_runtime):
    """Two sub-batches draw their own SDPA dropout; recompute redraws each one exactly and leaves
    the generator where the forward left it."""
    import functools

    from megatron_oases.schedules.oases.dropout import (MicroBatchMasks, active_sub_batch,
                                                        kernel_rng)

    core = _core("auto", attention_dropout=0.2)
    core.train()
    core.dropout_rng = functools.partial(kernel_rng, (0, "attention"))
    subs = [_qkv(batch=1, seed=s) for s in (1, 2)]
    masks = MicroBatchMasks([1, 1])
    fwd = []
    for i, qkv in enumerate(subs):
        with active_sub_batch(masks, i, recompute=False):
            fwd.append(core(*qkv, None))
    core.eval()
    assert all(not torch.equal(f, core(*qkv, None)) for f, qkv in zip(fwd, subs))  # dropped
    core.train()
    state = torch.get_rng_state()
    for i, qkv in reversed(list(enumerate(subs))):
        with active_sub_batch(masks, i, recompute=True):
            assert torch.equal(core(*qkv, None), fwd[i])
    assert torch.equal(torch.get_rng_state(), state) and not masks._kernel_states


def test_standard_causal_mask_is_detected_once():
    from megatron_oases.layers import core_attention as CA

    causal = _causal(8, 2)
    assert CA.is_standard_causal(causal) and CA._CAUSAL_SEEN[id(causal)][2]
    other = causal.clone()
    other[0, 0, 3, 5] = False
    assert not CA.is_standard_causal(other)
    other[0, 0, 3, 5] = True  # an in-place change is seen (tensor version)
    assert CA.is_standard_causal(other)


def test_flag_mapping_and_refusals(cpu_runtime):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    from megatron_oases.layers import core_attention as CA
    from megatron_oases.run_config import DEFAULTS, run_config
    from megatron_oases.train_args import build_parser

    assert CA.core_attention_class("local") is DotProductAttention
    assert CA.core_attention_class(AttnBackend.flash) is CA.FlashSDPAttention
    assert {CA.core_attention_class(b).kernels for b in ("auto", "fused", "unfused")} == {
        "auto", "fused", "unfused"}
    assert DEFAULTS.attention_backend == "auto"
    assert build_parser().parse_args([]).attention_backend == "auto"
    # Megatron-LM's namespace holds the enum: the typed config holds its name
    import argparse

    assert run_config(argparse.Namespace(attention_backend=AttnBackend.local)).attention_backend == "local"
    with pytest.raises(ConfigError, match="--attention-backend"):
        CA.core_attention_class("sdpa")
    with pytest.raises(ConfigError, match="--attention-backend flash.*--bf16"):
        CA.check_backend("flash", cuda=True, half=False)
    CA.check_backend("flash", cuda=False, half=False)  # CPU: torch's CPU kernels
    with pytest.raises(ConfigError, match="--softmax-type"):
        _core("auto", softmax_type="off-by-one")


def test_trainer_refuses_flash_fp32_on_cuda():
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    args = build_parser().parse_args(["--attention-backend", "flash", "--global-batch-size", "2"])
    with pytest.raises(ConfigError, match="--attention-backend flash"):
        validate_config(run_config(args), world_size=1, cuda=True)


def test_attention_parity_script_runs_on_cpu(tmp_path):
    out = tmp_path / "ap.json"
    assert AP.main(["--hidden", "32", "--heads", "4", "--seq", "16", "--reps", "1",
                    "--backends", "auto", "unfused", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["attention_parity"]["rows"]
    assert len(rows) == 2 * 2 * 2 and all(set(r["ms"]) == {"local_fwd", "local_bwd", "sdpa_fwd",
                                                           "sdpa_bwd"} for r in rows)
    assert max(e for r in rows if r["dtype"] == "fp32" for e in r["max_rel_err"].values()) < 1e-6


# ----- training parity ----------------------------------------------------------------------

def _plan(tmp_path, degrees):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "megatron-oases-plan/1", "tensor_model_parallel_size": 4,
                                "num_layers": len(degrees) // 2, "degrees": list(degrees)}))
    return str(path)


TP2 = ["--tensor-model-parallel-size", "2"]
CASES = {  # name: (ranks, flags)
    "stock-tp2-gpt2": (2, GPT2 + TP2),
    "stock-tp2-llama": (2, LLAMA + TP2),
    "oases-tp2-gpt2": (2, GPT2 + TP2 + OASES + RECOMPUTE),
    "oases-tp2-llama": (2, LLAMA + TP2 + OASES + RECOMPUTE),
    "atp-2x2-llama": (4, LLAMA + ["--tensor-model-parallel-size", "4", "--tp-backend", "atp",
                                  "--atp-mesh", "2,2", "--num-attention-heads", "8",
                                  "--num-query-groups", "4"]),
    "3d-tp8-llama": (8, LLAMA + ["--tensor-model-parallel-size", "8", "--tp-backend", "3d",
                                 "--num-layers", "1", "--train-iters", "1",
                                 "--num-attention-heads", "8", "--num-query-groups", "4"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_auto_equals_local(case):
    n, argv = CASES[case]
    assert_same_training(run_training(n, argv + AUTO), run_training(n, argv + LOCAL), tol=TOL,
                         what="local")


def test_planned_layers_auto_equals_local(tmp_path):
    argv = GPT2 + ["--tensor-model-parallel-size", "4", "--oases-plan",
                   _plan(tmp_path, [2, 4, 4, 2])] + OASES + RECOMPUTE
    assert_same_training(run_training(4, argv + AUTO), run_training(4, argv + LOCAL), tol=TOL,
                         what="local")


def test_bf16_training_auto_close_to_local():
    argv = LLAMA + TP2 + ["--bf16"]
    assert_same_training(run_training(2, argv + AUTO), run_training(2, argv + LOCAL),
                         tol=2 ** -6, what="local bf16")


DROPOUT = ["--attention-dropout", "0.2", "--hidden-dropout", "0.1"]


@pytest.mark.parametrize("recompute", [
    RECOMPUTE, RECOMPUTE + ["--no-oases-fine-grained-recompute"]], ids=["fine-grained", "full"])
def test_oases_recompute_replays_sdpa_dropout(recompute):
    argv = LLAMA + TP2 + OASES + DROPOUT + AUTO
    assert_same_training(run_training(2, argv + recompute), run_training(2, argv), tol=1e-6,
                         what="Oases without recompute")


def test_oases_equals_stock_with_sdpa_dropout_on_cpu():
    argv = LLAMA + TP2 + DROPOUT + AUTO
    assert_same_training(run_training(2, argv + OASES + RECOMPUTE), run_training(2, argv), tol=TOL)


def test_split_masks_carry_the_verdict_without_comparing_again(monkeypatch):
    """The Oases executor splits each micro-batch's mask into sub-batch views; their causal
    verdict comes from the one comparison of the whole mask (a host synchronisation on a GPU),
    not one per view inside the overlapped region."""
    from megatron_oases.layers import core_attention as CA

    causal, padded = _causal(8, 4), _causal(8, 4).clone()
    padded[3, 0, :, 6:] = True  # the last sample's padding: not the standard mask
    parts = CA.split_batch(causal, [2, 2]), CA.split_batch(padded, [2, 2])
    assert [p.shape[0] for p in parts[0]] == [2, 2] and torch.equal(torch.cat(parts[1]), padded)
    monkeypatch.setattr(torch, "equal", lambda *a: pytest.fail("a split mask was compared again"))
    assert [CA.is_standard_causal(p) for p in parts[0]] == [True, True]
    assert [CA.is_standard_causal(p) for p in parts[1]] == [False, False]  # conservative: explicit mask
