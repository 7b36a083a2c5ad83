"""One weight-gradient accumulation per micro-batch for the executor's Megatron linears.

Without it each sub-batch's weight-gradient GEMM writes a fresh tensor that is then added into
Megatron DDP's fp32 ``main_grad``: two GEMMs and two full-size adds per micro-batch where stock
runs one GEMM and one add. Inside the executor the linears take Megatron's own
``gradient_accumulation_fusion`` path instead, which accumulates into ``main_grad`` inside the
GEMM (``fused_weight_gradient_mlp_cuda``, Apex) and hands autograd a placeholder gradient
(``grad_added_to_main_grad``, which DDP's hook and the executor honour). Without Apex the same
path runs on torch (``TorchWgrad``): ``main_grad.addmm_`` when the activations have
``main_grad``'s dtype (fp32: no separate add at all); with 16-bit activations and an fp32
``main_grad``, where torch has no GEMM with a wider output, the sub-batches' GEMMs accumulate
into one 16-bit sum (``addmm_``) that is added once, on the micro-batch's last sub-batch, as
stock adds its one GEMM result (``sub_batch_sums``; one more 16-bit rounding than stock's).
"""
from __future__ import annotations

import contextlib

import torch


_SUB_BATCHES: list[int] = []
"""Wgrad calls per weight and micro-batch in the runner now running its backward."""
_PENDING: dict = {}
"""main_grad's data pointer -> [the 16-bit sum of this micro-batch's sub-batches so far, calls]."""


def _accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (2-D), in the GEMM where the dtypes allow;
    else summed over the micro-batch's sub-batches first and added once."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
        return
    calls = _SUB_BATCHES[-1] if _SUB_BATCHES else 1
    key = main_grad.data_ptr()
    entry = _PENDING.get(key)
    if entry is None:
        entry = _PENDING[key] = [grad_output.t().mm(total_input), 1]
    else:
        entry[0].addmm_(grad_output.t(), total_input)
        entry[1] += 1
    if entry[1] == calls:
        main_grad.add_(entry[0])
        del _PENDING[key]


@contextlib.contextmanager
def sub_batch_sums(calls: int):
    """The weight gradients computed inside come in ``calls`` parts per micro-batch (the
    runner's sub-batches): a 16-bit one is added into ``main_grad`` once all have come; none
    may be left over at the end (a lost gradient)."""
    _SUB_BATCHES.append(calls)
    try:
        yield
    finally:
        _SUB_BATCHES.pop()
    if _PENDING:
        raise RuntimeError(f"{len(_PENDING)} weight gradient(s) summed over fewer than {calls} "
                           f"sub-batches were not added into main_grad")


class TorchWgrad:
    """Apex's ``fused_weight_gradient_mlp_cuda`` interface on torch (Megatron calls it with
    ``(total_input, grad_output, main_grad)``, both 2-D)."""

    wgrad_gemm_accum_fp32 = staticmethod(_accumulate)
    wgrad_gemm_accum_fp16 = staticmethod(_accumulate)


def _install() -> None:
    """Give Megatron's linears a weight-gradient accumulation kernel where Apex's is missing."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:
        layers.fused_weight_gradient_mlp_cuda = TorchWgrad


@contextlib.contextmanager
def accumulate_in_gemm(linears, weights):
    """``linears`` (Megatron Column/RowParallelLinear) accumulate their weight gradients into
    ``main_grad`` inside the GEMM while the context is open (forward and backward: the flag is
    read when the graph is built); ``weights``: each linear's weight getter (the output layer's
    may be the embedding's). Linears whose weight has no ``main_grad`` (no Megatron DDP) are
    left as they are."""
    fused = [m for m, get in zip(linears, weights) if hasattr(get(), "main_grad")]
    if fused:
        _install()
    saved = [m.gradient_accumulation_fusion for m in fused]
    for m in fused:
        m.gradient_accumulation_fusion = True
    try:
        yield
    finally:
        for m, s in zip(fused, saved):
            m.gradient_accumulation_fusion = s
