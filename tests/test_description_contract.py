"""Contract tests: what a backend's runtime layer really issues equals its description in
``megatron_oases.describe`` (collectives per pass: kind, group size, bytes, count, recorded by
the ``CommCounter``; parameters per rank). The planner and the simulator price the description,
so a runtime change that is not described fails here."""
from __future__ import annotations

import pytest

from megatron_oases.describe.atp_2d import atp_2d_gpt_layer
from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
from megatron_oases.describe.ops import GPT2, LayerVariant
from megatron_oases.describe.registry import block_edges, layer_params
from megatron_oases.runtime.spawn import run_on_ranks
from megatron_oases.describe.atp_2d import atp_layout
from tests.rank_fns_contract import layer_contract
from tests.test_round_trip import cpu_kernels  # noqa: F401 (the fixture: the CPU kernels' saved sizes)

B, S, H, A = 4, 8, 32, 4
MODEL = ["--num-layers", "1", "--hidden-size", str(H), "--num-attention-heads", str(A),
         "--seq-length", str(S), "--vocab-size", "128", "--micro-batch-size", str(B),
         "--global-batch-size", str(B), "--device", "cpu"]


def _issued(rows):
    """Collectives on groups of one rank issue nothing (the counter still records them)."""
    return sorted(r for r in rows if r[1] > 1)


def _check_atp(argv: list[str], d1: int, d2: int, *, heads: int, ffn: int, chunks: int = 1,
               variant: LayerVariant = GPT2) -> None:
    """One ATP layer on the mesh: every collective per pass (kind, group, bytes; with the block's
    entry into and exit from ATP's [s, b, h/d2] layout) and the parameters per rank equal the
    description's."""
    n = d1 * d2
    argv = argv + ["--tp-backend", "atp", "--tensor-model-parallel-size", str(n),
                   "--atp-mesh", f"{d1},{d2}", "--atp-chunks", str(chunks)]
    outs = run_on_ranks(layer_contract, n, args=(argv, B, S, H), timeout_s=120)
    desc = atp_2d_gpt_layer(micro_batch=B, seq=S, hidden=H, heads=heads, ffn=ffn, d1=d1, d2=d2,
                            bytes_per_element=4, chunks=chunks, variant=variant)
    edges = dict(zip(("forward", "backward"), block_edges(
        backend="atp", layout=atp_layout(d1, d2), micro_batch=B, seq=S, hidden=H, tp=n, bytes_per_element=4)))
    for pass_ in ("forward", "backward"):
        want = sorted((c.kind, c.group_size, c.payload_bytes) for c in (*desc.collectives(pass_), *edges[pass_]))
        for out in outs:
            assert _issued(out[pass_]) == want, (out["rank"], pass_)
    per_rank = layer_params("atp", H, ffn, n, atp_layout(d1, d2), heads=heads, variant=variant)
    assert {out["params"] for out in outs} == {per_rank}


@pytest.mark.parametrize("d1, d2, chunks", [(2, 2, 1), (2, 2, 2), (1, 2, 1), (4, 1, 1)])
def test_atp_layer_issues_what_its_description_says(d1, d2, chunks):
    _check_atp(MODEL, d1, d2, heads=A, ffn=4 * H, chunks=chunks)


LLAMA_F = 64


def llama_model(heads: int, groups: int) -> tuple[list[str], LayerVariant]:
    """A Llama-style layer (GQA, SwiGLU, RMSNorm, no bias, QK-norm) and the variant describing it."""
    argv = [*MODEL, "--num-attention-heads", str(heads), "--ffn-hidden-size", str(LLAMA_F),
            "--swiglu", "--group-query-attention", "--num-query-groups", str(groups),
            "--normalization", "RMSNorm", "--disable-bias-linear", "--qk-layernorm"]
    return argv, LayerVariant(query_groups=groups, gated=True, normalization="RMSNorm", bias=False,
                              qk_norm=True)


@pytest.mark.parametrize("d1, d2", [(2, 2), (1, 2)])
def test_atp_llama_layer_issues_what_its_description_says(d1, d2):
    argv, variant = llama_model(8, groups=d1 * d2)
    _check_atp(argv, d1, d2, heads=8, ffn=LLAMA_F, variant=variant)


LLAMA_QKN = (["--group-query-attention", "--num-query-groups", "2", "--swiglu", "--disable-bias-linear",
              "--position-embedding-type", "rope", "--qk-layernorm"],
             LayerVariant(query_groups=2, gated=True, bias=False, rotary=True, qk_norm=True))


@pytest.mark.parametrize("extra, variant", [([], GPT2), LLAMA_QKN], ids=["gpt2", "llama-rope-qk-norm"])
def test_megatron_1d_layer_parameters_per_rank(extra, variant):
    """QK-norm adds a LayerNorm weight and bias of head_dim for queries and keys, replicated."""
    argv = MODEL + ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", str(4 * H), *extra]
    outs = run_on_ranks(layer_contract, 2, args=(argv, B, S, H), timeout_s=120)
    want = layer_params("megatron", H, 4 * H, 2, None, heads=A, variant=variant)
    assert {out["params"] for out in outs} == {want}


@pytest.mark.parametrize("extra, variant", [([], GPT2), LLAMA_QKN], ids=["gpt2", "llama-rope-qk-norm"])
def test_megatron_sequence_parallel_layer_issues_what_its_description_says(extra, variant):
    """Stock ``--sequence-parallel`` at TP 2: forward all-gathers QKV's and fc1's input and
    reduce-scatters proj's and fc2's output; backward all-gathers each row output's gradient,
    re-gathers each column input for the weight gradient and reduce-scatters each column input
    gradient; every payload the full [s, b, h]."""
    argv = MODEL + ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", str(4 * H),
                    "--sequence-parallel", *extra]
    outs = run_on_ranks(layer_contract, 2, args=(argv, B, S, H), timeout_s=120)
    desc = megatron_1d_gpt_layer(micro_batch=B, seq=S, hidden=H, heads=A, ffn=4 * H, tp=2,
                                 sequence_parallel=True, variant=variant)
    full = S * B * H * 4
    assert sorted(c.kind for c in desc.collectives("backward")) == ["all_gather"] * 4 + ["reduce_scatter"] * 2
    for pass_ in ("forward", "backward"):
        want = sorted((c.kind, c.group_size, c.payload_bytes) for c in desc.collectives(pass_))
        assert {c.payload_bytes for c in desc.collectives(pass_)} == {full}
        for out in outs:
            assert _issued(out[pass_]) == want, (out["rank"], pass_)


@pytest.mark.parametrize("sp", [False, True], ids=["all-reduce", "sequence-parallel"])
def test_megatron_selective_recompute_issues_what_its_description_says(sp):
    """``--recompute-granularity selective`` at TP 2: Megatron reruns the core attention inside
    the attention's backward; the description puts that rerun (``attention.core``) before the
    attention block's backward, a compute segment, so the collectives per pass stay stock's."""
    extra = ["--sequence-parallel"] if sp else []
    argv = MODEL + ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", str(4 * H),
                    "--recompute-granularity", "selective", *extra]
    outs = run_on_ranks(layer_contract, 2, args=(argv, B, S, H), timeout_s=120)
    desc = megatron_1d_gpt_layer(micro_batch=B, seq=S, hidden=H, heads=A, ffn=4 * H, tp=2,
                                 sequence_parallel=sp, recompute_core_attention=True)
    stock = megatron_1d_gpt_layer(micro_batch=B, seq=S, hidden=H, heads=A, ffn=4 * H, tp=2, sequence_parallel=sp)
    names = [op.name for op in desc.backward]
    assert names.index("attention.core") + 1 == names.index("attention.bwd")
    assert desc.flops("backward") - stock.flops("backward") == 4 * B * S * S * H // 2
    for pass_ in ("forward", "backward"):
        want = sorted((c.kind, c.group_size, c.payload_bytes) for c in desc.collectives(pass_))
        assert want == sorted((c.kind, c.group_size, c.payload_bytes) for c in stock.collectives(pass_))
        for out in outs:
            assert _issued(out[pass_]) == want, (out["rank"], pass_)


def test_stock_full_recompute_keeps_megatrons_generator_states_as_described(cpu_kernels):
    """Megatron's full recompute (stock schedule, uniform, dropout 0.1) keeps per layer its input
    and its checkpoint's snapshot of the generators (``CheckpointFunction``'s ``ctx.rng_states``:
    CPU, device and the attention's forked tracker state): the trainer's reading (the ledger,
    ``runtime.saved_tensors``), ``describe.saved`` and ``sim``'s memory agree on it, at TP 1
    (DP 2) and TP 2, in one spawned group of two ranks (issue 49)."""
    from megatron_oases.describe.saved import CPU_KERNELS, checkpoint_rng_state_bytes, layer_saved_bytes
    from tests.rank_fns_saved import saved_bytes_of_forwards
    from tests.test_round_trip import sim_layer

    def argv(tp: int, layers: int) -> list[str]:
        return [*MODEL, "--num-layers", str(layers), "--tensor-model-parallel-size", str(tp),
                "--global-batch-size", str(B * 2 // tp), "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                "--recompute-granularity", "full", "--recompute-method", "uniform"]

    argvs = [argv(tp, n) for tp in (1, 2) for n in (1, 2)]
    rank0 = run_on_ranks(saved_bytes_of_forwards, 2, args=(argvs,), timeout_s=180)[0]
    for i, tp in enumerate((1, 2)):
        got = rank0[2 * i + 1] - rank0[2 * i]
        states = checkpoint_rng_state_bytes(sequence_parallel=False, attention_dropout=True, core_attention="fused",
                                            kernels=CPU_KERNELS)
        assert states > 0 and got == B * S * H * 4 + states, tp  # the layer input and the snapshot
        assert got == layer_saved_bytes(recompute=True, b=B, s=S, h=H, a=A, f=4 * H, t=tp, e=4, kernels=CPU_KERNELS,
                                        core_attention="fused"), tp
        assert got == sim_layer(argv(tp, 2), argv(tp, 1), 2).saved, tp
