"""Mixture of experts: the MoE flags' checks, and their mapping onto Megatron-Core's config.

Megatron-Core builds the MoE layers (``MoELayer``: its router, token dispatcher and local experts,
``SequentialMLP``); this module only decides whether a run's MoE flags can take effect, before any
process group starts (one ``ConfigError`` line naming the flag and the fix), and hands them to
``TransformerConfig`` under Megatron's names. The trainer (``train_args.validate_config``) and the
Megatron-LM entry (``megatron_lm.flags``) share the checks; ``specs`` builds the layers.

No torch import at module level: the trainer's parse must not import torch.
"""
from __future__ import annotations

import dataclasses

from megatron_oases.describe.moe import (DISPATCHERS, MOE_SHAPE_FLAGS, flops_ffn_width, moe_refusal, moe_shape,
                                         without_experts)
from megatron_oases.errors import ConfigError
from megatron_oases.flags import option
from megatron_oases.run_config import DEFAULTS, RunConfig

MOE_FIELDS = ("moe_router_topk", "expert_model_parallel_size", "moe_token_dispatcher_type",
              "moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_ffn_hidden_size",
              "moe_layer_freq", "moe_expert_capacity_factor", "moe_grouped_gemm")
"""The MoE flags other than ``--num-experts``, which take effect only with it."""



def moe_runs(cfg: RunConfig) -> bool:
    """Whether the run builds MoE layers (``--num-experts`` given, not 0, as Megatron-LM reads it)."""
    return bool(cfg.num_experts)


def normalized_moe(cfg: RunConfig) -> RunConfig:
    """Megatron-LM's filling of the MoE flags (``validate_args``): a one-element
    ``--moe-router-load-balancing-type`` / ``--moe-aux-loss-coeff`` list as its element (several:
    a tuple, one coefficient per type), ``--num-experts 0`` as None, ``--moe-ffn-hidden-size`` from
    ``--ffn-hidden-size`` (filled in first)."""
    def one(value):
        if isinstance(value, (list, tuple)):
            return value[0] if len(value) == 1 else tuple(value)
        return value

    changes = {"moe_router_load_balancing_type": one(cfg.moe_router_load_balancing_type),
               "moe_aux_loss_coeff": one(cfg.moe_aux_loss_coeff)}
    if cfg.num_experts == 0:
        changes["num_experts"] = None
    if cfg.num_experts and cfg.moe_ffn_hidden_size is None:
        changes["moe_ffn_hidden_size"] = cfg.ffn_hidden_size
    return dataclasses.replace(cfg, **changes)


def validate_moe_config(cfg: RunConfig, *, tp: int, dp: int, ours: bool = True) -> RunConfig:
    """Refuse MoE flags that cannot take effect, or combinations that do not run, in one line naming
    the flag and the fix; returns ``cfg`` normalised (``normalized_moe``). ``tp`` / ``dp``: the
    validated degrees (the experts' tensor-parallel size is TP's, Megatron-LM's default, so the
    expert-parallel group must divide DP). ``ours=False``: Megatron-LM's own provider builds the
    model (a stock run with a checkout), whose MoE flags are Megatron-LM's to check."""
    cfg = normalized_moe(cfg)
    if not ours:
        return cfg
    if not moe_runs(cfg):
        for name in MOE_FIELDS:
            if getattr(cfg, name) != getattr(DEFAULTS, name) and not (
                    name == "moe_ffn_hidden_size" and getattr(cfg, name) is None):
                raise ConfigError(without_experts(option(name)))
        return cfg
    _check_values(cfg)
    _check_combinations(cfg, tp, dp)
    return cfg


def _check_values(cfg: RunConfig) -> None:
    """Each MoE flag's own range."""
    n, topk = cfg.num_experts, cfg.moe_router_topk
    experts = option("num_experts")
    if n < 1:
        raise ConfigError(f"{experts} must be >= 1 (got {n}); omit it (or 0) for dense MLPs")
    if not 1 <= topk <= n:
        raise ConfigError(f"{option('moe_router_topk')} must be in [1, {experts} {n}] (got {topk})")
    if topk == 1 and cfg.moe_router_load_balancing_type != "sinkhorn" and not cfg.megatron_lm.moe_router_pre_softmax:
        raise ConfigError(f"{option('moe_router_topk')} 1 needs Megatron's --moe-router-pre-softmax (a softmax "
                          f"over one expert has no gradient), which the trainer does not take; use "
                          f"{option('moe_router_topk')} 2 or more, or {option('moe_router_load_balancing_type')} "
                          f"sinkhorn")
    if cfg.moe_ffn_hidden_size < 1:
        raise ConfigError(f"{option('moe_ffn_hidden_size')} must be >= 1 (got {cfg.moe_ffn_hidden_size})")
    freq = cfg.moe_layer_freq
    if isinstance(freq, (list, tuple)):  # Megatron-LM's per-layer pattern
        if len(freq) != cfg.num_layers or set(freq) - {0, 1}:
            raise ConfigError(f"{option('moe_layer_freq')} as a list needs one 0 (dense) or 1 (MoE) per "
                              f"layer ({cfg.num_layers}; got {list(freq)})")
    elif freq < 1:
        raise ConfigError(f"{option('moe_layer_freq')} must be >= 1 (got {freq})")
    factor = cfg.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        raise ConfigError(f"{option('moe_expert_capacity_factor')} must be > 0 (got {factor}); omit "
                          f"it for dropless MoE")
    types = cfg.moe_router_load_balancing_type
    coeffs = cfg.moe_aux_loss_coeff
    n_types = len(types) if isinstance(types, tuple) else 1
    n_coeffs = len(coeffs) if isinstance(coeffs, tuple) else 1
    if n_types != n_coeffs:
        raise ConfigError(f"{option('moe_aux_loss_coeff')} takes one coefficient per "
                          f"{option('moe_router_load_balancing_type')} ({n_types} given, {n_coeffs} "
                          f"coefficients)")
    if factor is not None and "sinkhorn" in (types if isinstance(types, tuple) else (types,)):
        raise ConfigError(f"{option('moe_expert_capacity_factor')} works with aux_loss, seq_aux_loss, "
                          f"global_aux_loss or none load balancing (Megatron's rule); drop it or "
                          f"change {option('moe_router_load_balancing_type')} sinkhorn")


def _check_combinations(cfg: RunConfig, tp: int, dp: int) -> None:
    """What our builds cannot run with MoE layers yet, refused before any process group starts."""
    from megatron_oases.describe.backends import backend
    from megatron_oases.mcore_compat import mcore_version, oases_moe_hooks_missing
    from megatron_oases.schedules.oases.options import oases_runs

    experts = option("num_experts")
    if cfg.moe_token_dispatcher_type not in DISPATCHERS:
        raise ConfigError(f"{option('moe_token_dispatcher_type')} {cfg.moe_token_dispatcher_type} needs "
                          f"DeepEP or HybridEP (CUDA extensions our local specs do not build); use "
                          f"{' or '.join(DISPATCHERS)}")
    if cfg.moe_grouped_gemm and not grouped_gemm_available():
        raise ConfigError(f"{option('moe_grouped_gemm')}: this megatron-core's local spec has no grouped "
                          f"GEMM experts (Transformer Engine's TEGroupedMLP is not built by our specs); "
                          f"drop it (the local experts run as Megatron's SequentialMLP)")
    if not backend(cfg.tp_backend).megatron_modules:
        raise ConfigError(f"{experts} builds Megatron-Core's MoE layers, which --tp-backend "
                          f"{cfg.tp_backend} does not; use --tp-backend megatron")
    if cfg.oases_skip_tp_collectives:
        raise ConfigError(f"{experts}: --oases-skip-tp-collectives would also drop the experts' "
                          f"communication; drop one of them")
    refused = moe_refusal(moe_shape_of(cfg), tp=tp, ep=cfg.expert_model_parallel_size, dp=dp,
                          sequence_parallel=cfg.sequence_parallel, bias=cfg.add_bias_linear,
                          per_block_plan=cfg.oases_plan is not None, oases=oases_runs(cfg))
    if refused:  # EP divides the experts and DP; TP needs SP, no biases; no plan; what Oases cannot split
        raise ConfigError(refused)
    missing = oases_runs(cfg) and oases_moe_hooks_missing()
    if missing:
        raise ConfigError(f"--schedule oases over {experts} needs megatron-core 0.19 or newer: this "
                          f"{'.'.join(map(str, mcore_version()))} lacks {missing}, through which the "
                          f"executor attaches each sub-batch's aux loss; drop --schedule oases or upgrade")
    if tp == 1 and cfg.expert_model_parallel_size == 1 and cfg.add_bias_linear:
        raise ConfigError(f"{experts} with biases at --tensor-model-parallel-size 1 and "
                          f"{option('expert_model_parallel_size')} 1 fails inside Megatron-Core's local "
                          f"experts (their bias is added in place to an all-reduce's output, which "
                          f"autograd forbids when the reduce is one rank's identity); add "
                          f"--disable-bias-linear or use {option('expert_model_parallel_size')} 2 or more")


def moe_shape_of(cfg: RunConfig):
    """The run's ``describe.moe.MoEShape`` (its layer rules; a per-layer ``--moe-layer-freq``
    list, which those rules do not read, as 1), its aux loss read from
    ``--moe-router-load-balancing-type`` and ``--moe-aux-loss-coeff`` as the router reads them
    (``describe.moe.aux_loss_coeff``)."""
    values = {k: getattr(cfg, k) for k in MOE_SHAPE_FLAGS}
    if isinstance(values["moe_layer_freq"], (list, tuple)):
        values["moe_layer_freq"] = 1
    return moe_shape(**values, ffn_hidden_size=cfg.ffn_hidden_size)


def grouped_gemm_available() -> bool:
    """Whether the local spec can build grouped-GEMM experts: megatron-core before 0.19 has its
    ``GroupedMLP`` over the ``grouped_gemm`` package; 0.19's local spec builds ``SequentialMLP``
    whatever the flag says."""
    import importlib.util

    from megatron_oases.mcore_compat import local_grouped_mlp

    return local_grouped_mlp() is not None and importlib.util.find_spec("grouped_gemm") is not None


def moe_config_kwargs(cfg: RunConfig) -> dict:
    """``TransformerConfig``'s MoE fields for the run (Megatron-LM's mapping, by name); empty
    for a dense run."""
    if not moe_runs(cfg):
        return {}
    listed = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - Megatron takes lists
    return dict(
        num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
        moe_aux_loss_coeff=listed(cfg.moe_aux_loss_coeff),
        moe_router_load_balancing_type=listed(cfg.moe_router_load_balancing_type),
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, moe_layer_freq=cfg.moe_layer_freq,
        moe_expert_capacity_factor=cfg.moe_expert_capacity_factor,
        moe_grouped_gemm=cfg.moe_grouped_gemm)


def moe_layer_pattern(cfg: RunConfig) -> list[bool]:
    """Per layer of the whole model, whether it is an MoE layer: ``--moe-layer-freq N`` makes
    layers 0, N, 2N... MoE, as Megatron-Core's ``get_gpt_decoder_layer_specs``."""
    freq = cfg.moe_layer_freq
    if isinstance(freq, (list, tuple)):  # Megatron-LM's list form, one entry per layer
        return [moe_runs(cfg) and bool(f) for f in freq]
    shape = moe_shape_of(cfg) if moe_runs(cfg) else None
    return [shape is not None and shape.is_moe(i) for i in range(cfg.num_layers)]


def flops_ffn_hidden_size(cfg: RunConfig) -> float:
    """The FFN width Megatron-LM's FLOPs formula counts per layer, averaged over the layers
    (``describe.moe.flops_ffn_width`` over the run's ``moe_layer_pattern``)."""
    return flops_ffn_width(moe_layer_pattern(cfg), dense_ffn=cfg.ffn_hidden_size,
                           moe_ffn=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size, topk=cfg.moe_router_topk)


def moe_words(cfg: RunConfig) -> str:
    """The start-up line's words for the run's MoE layers ('' for a dense run)."""
    if not moe_runs(cfg):
        return ""
    pattern = moe_layer_pattern(cfg)
    every = "" if all(pattern) else f" in {sum(pattern)} of {len(pattern)} layers"
    drop = ("dropless" if cfg.moe_expert_capacity_factor is None
            else f"capacity factor {cfg.moe_expert_capacity_factor:g}")
    return (f"MoE {cfg.num_experts} experts top-{cfg.moe_router_topk}{every}, "
            f"{cfg.moe_token_dispatcher_type}, {drop}")


def moe_loss_names(cfg: RunConfig) -> list[str]:
    """The routers' losses Megatron-LM logs for the run's ``--moe-router-load-balancing-type``
    (its ``training_log``'s ``track_names``; ``--moe-z-loss-coeff`` is not a flag of ours)."""
    types = cfg.moe_router_load_balancing_type
    types = types if isinstance(types, tuple) else (types,)
    names = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
             "global_aux_loss": "global_load_balancing_loss"}
    return [names[t] for t in types if t in names]
