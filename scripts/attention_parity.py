"""SDPA core attention against Megatron's local one: errors and kernel times, one JSON line.

    python scripts/attention_parity.py                      # CPU, tiny shapes (seconds)
    python scripts/attention_parity.py --device cuda --hidden 4096 --seq 4096 --heads 32

For each dtype (fp32, bf16), ``--attention-backend`` value of ``--backends`` and head layout
(MHA, and GQA with ``--heads / 4`` key/value groups), causal, no dropout: the forward and
backward of ``megatron_oases.layers.core_attention`` against Megatron's ``DotProductAttention``
(as our builds configure it: no Apex softmax fusion) on the same inputs. Errors are
``max |a - b| / max |b|`` per output (``out``, ``dq``, ``dk``, ``dv``); with bf16 both are also
compared with the fp32 local result. Times are medians of ``--reps`` runs, forward and backward
separately, CUDA events on CUDA. Runs without any process group (a one-rank TP group stand-in)
and outside the test suite (whose conftest hides GPUs), so a GPU lease can call it directly.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types

DTYPES = ("fp32", "bf16")


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _config(hidden: int, heads: int, groups: int, dtype: str):
    from megatron.core.transformer import TransformerConfig

    bf16 = dtype == "bf16"
    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads,
                             num_query_groups=groups, attention_dropout=0.0, bf16=bf16,
                             params_dtype=_torch_dtype(dtype), masked_softmax_fusion=False,
                             use_cpu_initialization=True)


def build_core(backend: str, config, layer_number: int = 1):
    """The core attention ``--attention-backend backend`` builds, on a one-rank TP group."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_oases.layers.core_attention import core_attention_class

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # DotProductAttention's score buffer
        parallel_state._set_global_memory_buffer()
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME as rng_name
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    if rng_name not in get_cuda_rng_tracker().get_states():  # DotProductAttention forks it
        get_cuda_rng_tracker().add(rng_name, 1234)
    one_rank = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    return core_attention_class(backend)(config=config, layer_number=layer_number,
                                         attn_mask_type=AttnMaskType.causal,
                                         attention_type="self",
                                         pg_collection=ProcessGroupCollection(tp=one_rank))


class _Clock:
    """Elapsed milliseconds of a callable: CUDA events on CUDA, wall time on CPU."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def ms(self, fn) -> float:
        if self.cuda:
            start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def run_core(core, q, k, v, grad, clock: _Clock, reps: int):
    """(output, (dq, dk, dv), forward ms, backward ms) of ``core`` on copies of q, k, v."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fwd, bwd, out = [], [], None
    for _ in range(reps + 1):  # the first is a warm-up
        for t in leaves:
            t.grad = None
        box = {}
        fwd.append(clock.ms(lambda: box.update(out=core(*leaves, None))))
        out = box["out"]
        bwd.append(clock.ms(lambda: out.backward(grad)))
    timed = slice(1, None) if reps else slice(None)
    return (out.detach(), [t.grad for t in leaves], statistics.median(fwd[timed]),
            statistics.median(bwd[timed]))


def rel_err(a, b) -> float:
    """``max |a - b| / max |b|`` in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _errors(got, want) -> dict:
    out, grads = got
    ref_out, ref_grads = want
    errs = {"out": rel_err(out, ref_out)}
    errs.update({n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    return errs


def compare(*, device: str = "cpu", hidden: int = 64, heads: int = 4, groups: int | None = None,
            seq: int = 32, batch: int = 1, dtype: str = "fp32", backend: str = "auto",
            reps: int = 3, seed: int = 0) -> dict:
    """One case: SDPA ``backend`` against ``local`` (and, for bf16, both against fp32 local)."""
    import torch

    groups = groups or heads
    dev = torch.device(device)
    hn = hidden // heads
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(seq, batch, n, hn, generator=gen) for n in (heads, groups, groups))
    grad = torch.randn(seq, batch, heads * hn, generator=gen)
    dt = _torch_dtype(dtype)
    q, k, v, grad = (t.to(dev, dt) for t in (q, k, v, grad))
    clock = _Clock(dev)
    row = {"dtype": dtype, "backend": backend, "heads": heads, "groups": groups}
    config = _config(hidden, heads, groups, dtype)
    try:
        *local, l_fwd, l_bwd = run_core(build_core("local", config), q, k, v, grad, clock, reps)
        *sdpa, s_fwd, s_bwd = run_core(build_core(backend, config), q, k, v, grad, clock, reps)
    except RuntimeError as exc:  # e.g. no kernel of this backend for the dtype / device
        row["error"] = str(exc).splitlines()[0][:200]
        return row
    row["max_rel_err"] = _errors(sdpa, local)
    row["ms"] = {"local_fwd": l_fwd, "local_bwd": l_bwd, "sdpa_fwd": s_fwd, "sdpa_bwd": s_bwd}
    if dtype != "fp32":
        ref_config = _config(hidden, heads, groups, "fp32")
        ref = run_core(build_core("local", ref_config), *(t.float() for t in (q, k, v, grad)),
                       clock, 0)[:2]
        row["sdpa_vs_fp32"] = _errors(sdpa, ref)
        row["local_vs_fp32"] = _errors(local, ref)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--backends", nargs="+", default=["auto", "flash", "fused", "unfused"],
                   choices=("auto", "flash", "fused", "unfused"))
    p.add_argument("--no-gqa", action="store_true", help="MHA only")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", help="also write the JSON line to this file")
    a = p.parse_args(argv)
    import torch

    from megatron_oases.runtime import init_runtime
    from megatron_oases.runtime.quiet import quiet_known_warnings

    quiet_known_warnings(cpu=a.device == "cpu")
    init_runtime(a.device)  # on CPU: the shims that let Megatron's modules run there
    layouts = [a.heads] + ([] if a.no_gqa or a.heads < 4 else [a.heads // 4])
    rows = [compare(device=a.device, hidden=a.hidden, heads=a.heads, groups=g, seq=a.seq,
                    batch=a.batch, dtype=dt, backend=be, reps=a.reps)
            for dt in a.dtypes for be in a.backends for g in layouts]
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    line = json.dumps({"attention_parity": {
        "device": name, "torch": torch.__version__, "hidden": a.hidden, "heads": a.heads,
        "seq": a.seq, "batch": a.batch, "causal": True, "rows": rows}})
    print(line, flush=True)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    return 1 if any("error" in r for r in rows if r["backend"] == "auto") else 0


if __name__ == "__main__":
    sys.exit(main())
