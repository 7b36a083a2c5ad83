"""Element-wise parts of a layer, eager against fused (issue 34 item 3): is a fused kernel worth
turning on where our builds run Megatron's local layer without Apex or Transformer Engine?

For one rank's shapes of a TP-1 layer (tokens = sequence x micro-batch, hidden, 4 x hidden FFN,
bf16 by default) each case is timed forward + backward, eager and in its fused forms:

* ``bias_gelu``: ``F.gelu(y + b)`` (Megatron's unfused MLP, erf GeLU) / Megatron's
  ``bias_gelu_impl`` (its ``bias_activation_fusion``: tanh GeLU, ``jit_fuser``) /
  ``torch.compile`` of the eager form;
* ``swiglu``: ``silu(a) * b`` on fc1's two halves / Megatron's ``bias_swiglu_impl`` / compiled;
* ``bias_dropout_add``: ``residual + dropout(x + bias)`` / Megatron's
  ``bias_dropout_add_fused_train`` (its ``bias_dropout_fusion``) / compiled;
* ``softmax``: scale + causal mask + softmax over [b, heads, s, s] scores as Megatron's
  ``FusedScaleMaskSoftmax`` falls back without Apex (upcast to fp32, softmax, cast back) against
  the same in the input dtype (torch accumulates in fp32 inside its softmax kernel);
* ``layer_norm`` / ``rms_norm``: torch's kernels in the input dtype, eager / compiled.

Prints a table (ms forward + backward, median of ``--reps``) and writes ``--out`` JSON. On CPU it
runs at small sizes for testing the script; its numbers then say nothing about a GPU.

    python scripts/gpu_fusion_bench.py --device cuda --hidden 4096 --seq 4096 --out fusion.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _timer(device: torch.device):
    """A function timing ``fn()`` once in ms: CUDA events on CUDA, a host clock on CPU."""
    if device.type == "cuda":
        def run(fn):
            # on ``device``'s stream: with --device cuda:1 the current device's (cuda:0) timed nothing
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end)
    else:
        def run(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return run


def fwd_bwd(fn, *inputs):
    """One forward + backward of ``fn`` over fresh-grad leaves (grads summed into a scalar-free
    backward with a random cotangent drawn once)."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    cot = torch.ones_like(out)

    def step():
        y = fn(*leaves)
        y.backward(cot)
    return step


def cases(tokens: int, hidden: int, heads: int, seq: int, batch: int, dtype, device,
          compiled: bool = True):
    """name -> (variant -> step callable) for every case; each case's eager form is also
    compiled with ``torch.compile`` unless ``compiled=False`` (a quick test of the script)."""
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    def swiglu_eager(y, b):
        a, g = torch.chunk(y + b, 2, dim=-1)
        return F.silu(a) * g

    def bda_eager(x, bias, res):
        return res + F.dropout(x + bias, p=0.1, training=True)

    def bda_megatron(x, bias, res):
        return bias_dropout_add_fused_train((x, bias), res, 0.1)

    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)
    scale = 1.0 / (hidden // heads) ** 0.5

    def softmax_fp32(s):  # Megatron's FusedScaleMaskSoftmax without Apex (softmax in fp32)
        return torch.softmax((s.float() * scale).masked_fill(mask, -10000.0), dim=-1).to(s.dtype)

    def softmax_input_dtype(s):
        return torch.softmax((s * scale).masked_fill(mask, -10000.0), dim=-1)

    ffn = 4 * hidden
    seq_major = (seq, batch, hidden)
    table = {  # name: (inputs, {variant: fn}); the first variant is the eager reference
        "bias_gelu": ((rand(tokens, ffn), rand(ffn)),
                      {"eager": lambda y, b: F.gelu(y + b), "megatron_fused": bias_gelu_impl}),
        "swiglu": ((rand(tokens, 2 * ffn), rand(2 * ffn)),
                   {"eager": swiglu_eager, "megatron_fused": bias_swiglu_impl}),
        "bias_dropout_add": ((rand(*seq_major), rand(hidden), rand(*seq_major)),
                             {"eager": bda_eager, "megatron_fused": bda_megatron}),
        "softmax": ((rand(batch, heads, seq, seq),),
                    {"eager_fp32": softmax_fp32, "eager_input_dtype": softmax_input_dtype}),
        "layer_norm": ((rand(tokens, hidden),),
                       {"eager": torch.nn.LayerNorm(hidden, device=device, dtype=dtype)}),
        "rms_norm": ((rand(tokens, hidden),),
                     {"eager": torch.nn.RMSNorm(hidden, device=device, dtype=dtype)}),
    }
    out = {}
    for name, (inputs, variants) in table.items():
        if compiled:
            variants["compiled"] = torch.compile(next(iter(variants.values())))
        out[name] = {v: fwd_bwd(fn, *inputs) for v, fn in variants.items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile variants")
    p.add_argument("--out", default=None, help="JSON file for the results")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    timer = _timer(device)
    rows = []
    for name, variants in cases(a.seq * a.micro_batch, a.hidden, a.heads, a.seq, a.micro_batch,
                                dtype, device, compiled=not a.no_compile).items():
        for variant, step in variants.items():
            try:
                for _ in range(a.warmup):
                    step()
                ms = statistics.median(timer(step) for _ in range(a.reps))
                rows.append({"case": name, "variant": variant, "ms_fwd_bwd": ms})
            except Exception as e:  # a compile failure is a result, not a crash of the bench
                rows.append({"case": name, "variant": variant, "error": f"{type(e).__name__}: {e}"[:300]})
    print(f"{'case':18s} {'variant':18s} {'ms fwd+bwd':>10s}  vs eager")
    base = {}
    for r in rows:
        if r["variant"].startswith("eager") and "ms_fwd_bwd" in r:
            base.setdefault(r["case"], r["ms_fwd_bwd"])
    for r in rows:
        if "error" in r:
            print(f"{r['case']:18s} {r['variant']:18s} {'error':>10s}  {r['error'][:60]}")
            continue
        ratio = base.get(r["case"], r["ms_fwd_bwd"]) / r["ms_fwd_bwd"]
        r["speedup_vs_eager"] = ratio
        print(f"{r['case']:18s} {r['variant']:18s} {r['ms_fwd_bwd']:10.3f}  {ratio:5.2f}x")
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": a.dtype, "hidden": a.hidden, "heads": a.heads,
              "seq": a.seq, "micro_batch": a.micro_batch, "rows": rows}
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
