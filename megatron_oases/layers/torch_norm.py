"""Torch LayerNorm / RMSNorm for sequence parallelism without Apex or Transformer Engine.

Megatron's CPU fallback ``WrappedTorchNorm`` refuses ``config.sequence_parallel`` only because it
does not mark its parameters: under sequence parallelism each TP rank normalizes its own chunk of
the sequence, so a norm weight's gradient is partial per rank and must be summed over the TP
group. Megatron's ``finalize_model_grads`` sums every parameter carrying
``sequence_parallel=True`` (as Apex's ``FusedLayerNorm`` and TE's norms set it); ``TorchNorm``
sets it too, so the torch norms train exactly like one rank.
"""
from __future__ import annotations

import dataclasses

import torch


class TorchNorm:
    """Drop-in for Megatron's ``WrappedTorchNorm`` (same constructor) that supports
    ``config.sequence_parallel`` by marking its parameters for the TP gradient sum."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("torch norms support neither zero-centered gamma nor the "
                             "memory-efficient layer norm; install Apex or Transformer Engine")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"--normalization {config.normalization} has no torch norm here; "
                             f"use LayerNorm or RMSNorm")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)
        return norm


def with_torch_norms(spec):
    """``spec`` (a ModuleSpec tree) with every ``WrappedTorchNorm`` replaced by ``TorchNorm``
    (new objects; Megatron's specs are shared module-level values)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return TorchNorm
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: with_torch_norms(getattr(spec, f.name))
                   for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    return spec


def sequence_parallel_block_spec(spec, config, vp_stage: int | None = None):
    """The block spec of ``spec`` (a layer ModuleSpec) for ``config.sequence_parallel`` without
    Apex/TE: torch norms marked for the TP gradient sum, in the layers and as the block's final
    norm (which Megatron otherwise builds from ``WrappedTorchNorm``)."""
    from megatron.core.transformer.transformer_block import (LayerNormImpl,
                                                             TransformerBlockSubmodules,
                                                             get_num_layers_to_build)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    final = TorchNorm if LayerNormImpl is WrappedTorchNorm else LayerNormImpl
    layer = with_torch_norms(spec)
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=final)
