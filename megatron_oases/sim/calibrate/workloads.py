"""The torch ops behind each compute event, so the profiler can time them on the local device.

Events of a Megatron 1-D layer (``attention``, ``mlp``, their ``.bwd`` and ``.wgrad``, tagged
with ``exec`` in their dims) run on a real Megatron-Core layer (``sim.calibrate.layer_workloads``); the
rest run the synthetic ops below.
Every compute segment of a layer description (``attention``, ``mlp``, ``atp.qkv``, ...) maps to
a forward function of the right shapes (from the event's ``dims``): GEMMs through ``F.linear``,
Megatron's unfused attention core (baddbmm, causal mask, softmax, bmm) or, when the dims name
an SDPA core attention (``attn``), torch's SDPA, LayerNorm, GeLU, the
residual adds; each backend's record names the function that builds its layer's
(``Backend.profile_workloads``: :func:`megatron_forward`, :func:`atp_forward`,
:func:`cube_forward`). ``<name>.bwd`` is the autograd backward of ``<name>`` (dgrad + wgrad), timed with
the forward's graph retained; ``logits.wgrad`` is the output layer's weight gradient alone.
``optimizer`` is the step's tail (zero grads, clip, AdamW as Megatron falls back to
``torch.optim.AdamW``), ``grad_norm`` the L2 norm of the gradients, both
over the stage's own parameter tensors (``sizes``).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...pricing.device_model import SimError
from .layer_workloads import LAYER_EVENTS, core_attention_backend, megatron_layer_workload

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
Forward = Callable[[], Any]


class _Maker:
    """Allocates inputs (requiring grad) and parameters on one device and dtype."""

    def __init__(self, dtype: torch.dtype, device: torch.device, seed: int = 0):
        self.dtype, self.device = dtype, device
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    def t(self, *shape: int, grad: bool = True, scale: float = 1.0) -> torch.Tensor:
        x = (torch.randn(*shape, generator=self.gen) * scale).to(device=self.device, dtype=self.dtype)
        return x.requires_grad_(grad)

    def w(self, *shape: int) -> torch.Tensor:
        return self.t(*shape, scale=0.02)


def _attention_core(qkv: torch.Tensor, s: int, b: int, heads: int, hd: int, mask: torch.Tensor,
                    backend: str = "local") -> torch.Tensor:
    """The core attention of ``--attention-backend backend`` (``layer_workloads.core_attention_backend``
    of the event's dims) on ``[s, b, heads * 3 hd]`` -> ``[s, b, heads * hd]``: Megatron's
    DotProductAttention (unfused, ``local``) or torch's SDPA restricted to the backend's kernels as
    ``layers.core_attention`` runs it."""
    q, k, v = qkv.view(s, b, heads, 3 * hd).split(hd, dim=-1)
    if backend != "local":
        return _sdpa_core(q, k, v, backend)
    q = q.reshape(s, b * heads, hd).transpose(0, 1)
    k = k.reshape(s, b * heads, hd).transpose(0, 1)
    v = v.reshape(s, b * heads, hd).transpose(0, 1)
    scores = torch.baddbmm(torch.empty(b * heads, s, s, dtype=q.dtype, device=q.device), q, k.transpose(1, 2),
                           beta=0.0, alpha=1.0 / math.sqrt(hd))
    scores = scores.view(b, heads, s, s).masked_fill(mask, -10000.0)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    ctx = torch.bmm(probs.view(b * heads, s, s), v)
    return ctx.transpose(0, 1).reshape(s, b, heads * hd)


def _sdpa_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    """SDPA, causal, on ``[s, b, heads, hd]`` views, with ``backend``'s kernels
    (``layers.core_attention.SDPAttention``'s call without its module: the synthetic ATP / 3-D
    cores have no Megatron config)."""
    from ...layers.core_attention import backend_kernel_context

    s, b, heads, hd = q.shape
    with backend_kernel_context(backend, q.device):
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * hd)


def _forward(name: str, d: dict, mk: _Maker) -> Forward:
    """The event's forward: the head's (embedding, logits), else the one its backend's record
    names (``Backend.profile_workloads``: each returns None for an event not of its layer)."""
    from ...describe.backends import BACKENDS, resolve

    for build in (_head_forward, *(resolve(b.profile_workloads) for b in BACKENDS.values())):
        fwd = build(name, d, mk)
        if fwd is not None:
            return fwd
    raise SimError(f"no profiling workload for compute event {name!r}")


def _sizes(d: dict) -> tuple[int, ...]:
    """b, s, h, a, f, t, d1, d2, v of an event's dims (``describe.event_key.layer_shape``)."""
    b, s, h, a, f, t = (int(d.get(k, 1)) for k in ("b", "s", "h", "a", "f", "t"))
    return b, s, h, a, f, t, int(d.get("d1", t)), int(d.get("d2", 1)), int(d.get("v", 1))


def _causal_mask(s: int, mk: _Maker) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool, device=mk.device).triu(1)


def megatron_forward(name: str, d: dict, mk: _Maker) -> Forward | None:
    """Megatron 1-D's layer events without a real layer (``attention``, ``mlp``)."""
    b, s, h, a, f, t, _, _, _ = _sizes(d)
    hd = h // a
    attn = core_attention_backend(d)  # the event's core attention, as --attention-backend
    if name == "attention":
        mask = _causal_mask(s, mk)
        prev, res = mk.t(s, b, h), mk.t(s, b, h)
        lw, lb, wq, bq, wp = mk.w(h), mk.w(h), mk.w(3 * h // t, h), mk.w(3 * h // t), mk.w(h, h // t)
        return lambda: F.linear(_attention_core(F.linear(F.layer_norm(prev + res, (h,), lw, lb), wq, bq),
                                                s, b, a // t, hd, mask, attn), wp)
    if name == "mlp":
        prev, res = mk.t(s, b, h), mk.t(s, b, h)
        lw, lb, w1, b1, w2 = mk.w(h), mk.w(h), mk.w(f // t, h), mk.w(f // t), mk.w(h, f // t)
        return lambda: F.linear(F.gelu(F.linear(F.layer_norm(prev + res, (h,), lw, lb), w1, b1)), w2)
    return None


def _head_forward(name: str, d: dict, mk: _Maker) -> Forward | None:
    """The embedding and the output layer (Megatron's on every backend)."""
    b, s, h, a, f, t, _, _, v = _sizes(d)
    if name == "embedding":
        vt = v // t
        tokens = torch.randint(0, v, (b, s), generator=mk.gen).to(mk.device)
        emb, pos = mk.w(vt, h), mk.w(s, h)

        def embed():
            outside = (tokens < 0) | (tokens >= vt)  # vocab-parallel: rows of other TP ranks -> 0
            out = F.embedding(tokens.masked_fill(outside, 0), emb).masked_fill(outside.unsqueeze(-1), 0.0)
            return out.transpose(0, 1) + pos.unsqueeze(1)
        return embed
    if name == "logits":
        vt = v // t
        prev, res = mk.t(s, b, h), mk.t(s, b, h)
        lw, lb, out_w = mk.w(h), mk.w(h), mk.w(vt, h)
        target = torch.randint(0, vt, (s, b, 1), generator=mk.gen).to(mk.device)

        def head():  # final LN, logits, the local part of Megatron's vocab-parallel cross-entropy
            lf = F.linear(F.layer_norm(prev + res, (h,), lw, lb), out_w).float()
            lf = lf - lf.max(dim=-1, keepdim=True)[0].detach()
            pred = lf.gather(-1, target)
            return torch.log(lf.exp().sum(-1, keepdim=True)) - pred
        return head
    return None


def atp_forward(name: str, d: dict, mk: _Maker) -> Forward | None:
    """ATP's layer events (``describe/atp_2d.py``) on one rank of the mesh ``d1 x d2``."""
    if not name.startswith("atp."):
        return None
    b, s, h, a, f, t, d1, d2, _ = _sizes(d)
    hd = h // a
    attn = core_attention_backend(d)
    mask = _causal_mask(s, mk) if name == "atp.core" else None
    n = d1 * d2
    if name in ("atp.ln1", "atp.ln2"):
        prev, res = mk.t(s, b, h // d2), mk.t(s, b, h // d2)

        def partial_stats():
            x = prev + res
            xf = x.float()
            mean = xf.sum(-1, keepdim=True) / h
            return x, ((xf - mean) ** 2).sum(-1, keepdim=True)
        return partial_stats
    if name in ("atp.qkv", "atp.fc1"):
        out = 3 * h // d1 if name == "atp.qkv" else f // d1
        x, mean, var = mk.t(s, b, h // d2), mk.t(s, b, 1), mk.t(s, b, 1, scale=0.0)
        lw, lb, wt, bias = mk.w(h // d2), mk.w(h // d2), mk.w(out, h // d2), mk.w(out)
        return lambda: F.linear((x - mean) * torch.rsqrt(var.float().abs() + 1e-5).to(x.dtype) * lw + lb, wt, bias)
    if name == "atp.core":
        qkv = mk.t(s, b, 3 * h // d1)
        j = 0  # this rank's heads within the axis-2 group
        return lambda: _attention_core(qkv[..., j * 3 * h // n:(j + 1) * 3 * h // n], s, b, a // n, hd, mask, attn)
    if name == "atp.proj":
        x, wt = mk.t(s, b, h // d1), mk.w(h // d2, h // d1)
        return lambda: F.linear(x, wt)
    if name == "atp.fc2":
        x, wt = mk.t(s, b, f // d1), mk.w(h // d2, f // d1)
        return lambda: F.linear(F.gelu(x), wt)
    raise SimError(f"no profiling workload for compute event {name!r}")


def cube_forward(name: str, d: dict, mk: _Maker) -> Forward | None:
    """The cube's layer events (``describe/cube_3d.py``)."""
    return _cube_forward(name, d, mk) if name.startswith("3d.") else None


def _cube_forward(name: str, d: dict, mk: _Maker) -> Forward:
    """One cube rank's local work (``describe/cube_3d.py``) on p x p x p = t ranks: activation
    blocks ``[tokens/p^2, N/p]`` (norm statistics, GeLU), GEMMs on the gathered ``[tokens/p, n_in/p]``
    times the weight block ``[n_out/p, n_in/p]``, attention on ``b/p^2`` samples and ``a/p`` heads."""
    from ...describe.cube_3d import cube_side
    from .layer_workloads import variant_of

    b, s, h, a, f = (int(d[k]) for k in ("b", "s", "h", "a", "f"))
    p = cube_side(int(d["t"]))
    variant = variant_of(d)
    tok = b * s
    if name in ("3d.ln1", "3d.ln2"):
        prev, res = mk.t(tok // (p * p), h // p), mk.t(tok // (p * p), h // p)

        def partial_stats():
            xf = (prev + res).float()
            return xf.sum(-1, keepdim=True), (xf * xf).sum(-1, keepdim=True)
        return partial_stats
    if name == "3d.core":
        qkv = mk.t(s, b // (p * p), 3 * h // p)
        mask = torch.ones(s, s, dtype=torch.bool, device=mk.device).triu(1)
        return lambda: _attention_core(qkv, s, b // (p * p), a // p, h // a, mask, core_attention_backend(d))
    n_in, n_out = {"3d.qkv": (h, variant.qkv_rows(h, a)), "3d.proj": (h, h), "3d.fc1": (h, variant.fc1_rows(f)),
                   "3d.fc2": (f, h)}.get(name, (0, 0))
    if not n_in:
        raise SimError(f"no profiling workload for compute event {name!r}")
    x, wt = mk.t(tok // p, n_in // p), mk.w(n_out // p, n_in // p)
    if name == "3d.fc2":  # GeLU on the fc1 block, then the GEMM
        return lambda: F.linear(F.gelu(x), wt)
    if name in ("3d.qkv", "3d.fc1"):  # the norm's scale and shift on the gathered block, then the GEMM
        lw, lb = mk.w(n_in // p), mk.w(n_in // p)
        return lambda: F.linear(x * lw + lb, wt)
    return lambda: F.linear(x, wt)


def _as_list(out: Any) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.requires_grad]


def _param_sizes(dims: dict) -> list[int]:
    """The stage's parameter tensor sizes (``sizes``), or one tensor of ``p`` (older events)."""
    return [int(n) for n in dims.get("sizes") or (dims["p"],)]


def _tail_workload(name: str, dims: dict, mk: _Maker, dtype: torch.dtype, device: torch.device) -> Forward:
    """The step's tail as Megatron runs it on the stage's own parameter tensors (Adam and the norm
    loop over tensors, so a few large tensors and many small ones of the same total cost
    differently): ``grad_norm`` the per-tensor L2 norms and their norm; ``optimizer`` zeroing the
    flat gradient buffer, the clip scale (none under ``--clip-grad 0``) and ``torch.optim.AdamW`` (the distributed optimizer's
    ``shard`` of every tensor), plus the cast copy for 16-bit models."""
    sizes = _param_sizes(dims)
    if name == "grad_norm":
        grads = [torch.randn(n, generator=mk.gen).to(device) for n in sizes]
        return lambda: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    shard = int(dims.get("shard", 1))
    masters = []
    for n in sizes:
        p = torch.zeros(-(-n // shard), dtype=torch.float32, device=device, requires_grad=True)
        p.grad = torch.randn(p.numel(), generator=mk.gen).to(device)
        masters.append(p)
    buffer = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    opt = torch.optim.AdamW(masters, lr=1e-4)
    copies = [torch.empty(p.numel(), dtype=dtype, device=device) for p in masters] if dtype != torch.float32 else []

    clip = int(dims.get("clip", 1))  # 0: --clip-grad 0, no scale

    def step():
        buffer.zero_()
        for p in masters:
            if clip:
                p.grad.mul_(0.5)  # clip-by-norm scale
        opt.step()
        for c, p in zip(copies, masters):
            c.copy_(p.detach())
    return step


def compute_workload(name: str, dims: dict, device: torch.device) -> Forward:
    from ...pricing.device_model import GRAD_ACCUMULATE

    """A no-argument function running the event's work once (what the profiler times)."""
    dtype = TORCH_DTYPES[str(dims.get("dtype", "fp32"))]
    if "exec" in dims and name in LAYER_EVENTS:  # a Megatron 1-D layer event: time the real layer
        return megatron_layer_workload(name, dims, device, dtype)
    mk = _Maker(dtype, device)
    if name == GRAD_ACCUMULATE:  # DDP's main_grad += grad (fp32 += the model's dtype)
        n = int(dims["grad_elems"])
        main, grad = torch.zeros(n, dtype=torch.float32, device=device), mk.t(n, grad=False)
        return lambda: main.add_(grad)
    if name in ("optimizer", "grad_norm"):
        return _tail_workload(name, dims, mk, dtype, device)
    if name == "logits.wgrad":  # the output layer's weight gradient, grad_output.t() @ input
        tokens, h, out = int(dims["b"]) * int(dims["s"]), int(dims["h"]), int(dims["v"]) // int(dims["t"])
        grad_output, total_input = mk.t(tokens, out, grad=False), mk.t(tokens, h, grad=False)
        return lambda: grad_output.t().matmul(total_input)
    if name.endswith(".bwd"):
        fwd = _forward(name[: -len(".bwd")], dims, mk)
        outs = _as_list(fwd())
        seeds = [torch.randn_like(o) for o in outs]
        return lambda: torch.autograd.backward(outs, seeds, retain_graph=True)
    return _forward(name, dims, mk)
