"""The model provider ``megatron.training.pretrain`` calls, for every backend and schedule.

A stock run (``--tp-backend megatron --schedule default``) goes to Megatron-LM's own provider
(``partial(model_provider, gpt_builder)`` from the checkout; from 0.19 the entry builds it from
Megatron's ``gpt_config_from_args`` instead, as the stock script does), so the baseline is
bit-for-bit the stock one, Transformer Engine spec included. Without a checkout there is no stock
provider and stock runs are built here too, with our ``megatron`` spec. Otherwise the model is assembled where the
reference trainer assembles it, ``megatron_oases.specs`` (``backend_groups``, then
``build_gpt_model``: layer spec per backend, schedule applied), with the TransformerConfig from
Megatron-LM's own ``core_transformer_config_from_args`` so its model flags (activation, norm,
bias, init, precision) carry over, and through the checkout's ``model_provider`` (given our builder
in place of ``gpt_builder``) so its options (``--record-memory-history``) apply too; what our
builds cannot honour is refused at parse time (``options``). Process groups are Megatron's global ones (what
``get_model`` passes as ``pg_collection`` by default).
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from megatron_oases.run_config import RunConfig, run_config

StockProvider = Callable[..., Any]
"""Megatron-LM's provider signature: ``(pre_process, post_process, vp_stage, config,
pg_collection)`` as keywords (``megatron.training.training.get_model``)."""


def _megatron_get_args():
    from megatron.training import get_args

    return get_args()


def _megatron_config_from_args(args):
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(args)


class ModelProvider:
    """``pretrain(..., model_provider=ModelProvider(stock), ...)``.

    ``stock`` is Megatron-LM's provider (``None``: stock runs use our ``megatron`` spec too);
    ``get_args`` and ``config_from_args`` default to Megatron-LM's and exist for tests. The
    backend's extra process groups (ATP's mesh axes) are created on the first call, which
    Megatron makes on every rank after ``initialize_model_parallel``, and reused for every
    virtual pipeline stage.
    """

    def __init__(self, stock: StockProvider | None = None, *,
                 get_args: Callable[[], argparse.Namespace] = _megatron_get_args,
                 config_from_args: Callable[[argparse.Namespace], Any] = _megatron_config_from_args):
        self.stock = stock
        self._get_args = get_args
        self._config_from_args = config_from_args
        self._groups: tuple[Any, Any] | None = None  # (key, groups)

    def uses_stock(self, args: argparse.Namespace) -> bool:
        """Whether Megatron-LM's ``args`` is a stock run built by Megatron-LM's own provider (not
        by us). An entry: the patched checkout's ``pretrain_gpt.py`` calls it with its args."""
        from megatron_oases.megatron_lm.flags import is_stock

        return self.stock is not None and is_stock(run_config(args))

    def __call__(self, pre_process: bool = True, post_process: bool = True,
                 vp_stage: int | None = None, config=None, pg_collection=None):
        args = self._get_args()
        ensure_validated(args)
        if self.uses_stock(args):
            return self.stock(pre_process=pre_process, post_process=post_process,
                              vp_stage=vp_stage, config=config, pg_collection=pg_collection)
        outer = _checkout_provider(self.stock)
        if outer is not None:  # the checkout's model_provider (memory history, ...) around ours
            return outer(self._builder, pre_process=pre_process, post_process=post_process,
                         vp_stage=vp_stage, config=config, pg_collection=pg_collection)
        return self._builder(args, pre_process, post_process, vp_stage, config=config,
                             pg_collection=pg_collection)

    def _builder(self, args, pre_process, post_process, vp_stage=None, config=None,
                 pg_collection=None):
        """Our build with ``gpt_builder``'s signature, for the checkout's ``model_provider`` (an
        entry: it passes Megatron-LM's args, as validated by our parse hook)."""
        cfg = run_config(args)
        if config is None:
            config = self._config_from_args(args)  # Megatron-LM's own mapping reads its args
        model = build_model(cfg, config, padded_vocab_size=args.padded_vocab_size,
                            pre_process=pre_process, post_process=post_process,
                            vp_stage=vp_stage, groups=self.backend_groups(cfg))
        if cfg.oases_layer_degrees:
            _prepare_replicas(model, config)
        return model

    def backend_groups(self, cfg: RunConfig):
        """``specs.backend_groups(cfg)`` once per (backend, mesh); collective on first use."""
        from megatron_oases.specs import backend_groups

        key = (cfg.tp_backend, cfg.atp_mesh, cfg.oases_layer_degrees)
        if self._groups is None or self._groups[0] != key:
            self._groups = (key, backend_groups(cfg))
        return self._groups[1]


def _checkout_provider(stock):
    """The checkout's ``model_provider(builder, ...)`` when ``stock`` is
    ``partial(model_provider, gpt_builder)`` (both entries pass that), else None."""
    import functools

    if isinstance(stock, functools.partial) and len(stock.args) == 1 and not stock.keywords:
        return stock.func
    return None


def _prepare_replicas(model, config) -> None:
    """``--oases-plan`` on Megatron-LM: replicas of a planned layer start equal (Megatron's GPU
    init seeds each TP rank differently; its CPU init is already equal), and ``train()`` sums
    their gradients through ``finalize_with_replica_grads`` around Megatron's
    ``finalize_model_grads`` (rebound in ``megatron.training.training``, which reads it when
    training starts)."""
    import warnings

    from megatron_oases.layers.planned_layer import finalize_with_replica_grads, sync_replica_params

    if not config.use_cpu_initialization:
        # Megatron's get_model moves the model to the GPU only after the provider returns, and
        # the torch norms (no Apex / TE) are still on the host here: an NCCL group broadcasts
        # device tensors only, so the model goes to this rank's device first (a no-op on CPU).
        from megatron_oases.runtime import current_runtime

        model.to(current_runtime().device)
        sync_replica_params([model])
    try:
        import megatron.training.training as training
    except ImportError:  # our provider in someone else's loop: they must wrap it themselves
        warnings.warn("--oases-plan: wrap your finalize_model_grads_func with "
                      "megatron_oases.layers.planned_layer.finalize_with_replica_grads")
        return
    if not getattr(training.finalize_model_grads, "oases_replicas", False):
        training.finalize_model_grads = finalize_with_replica_grads(training.finalize_model_grads)


def ensure_validated(args: argparse.Namespace) -> None:
    """Validate when the args did not pass our parser hook (e.g. ``parsed_args=`` callers)."""
    if not hasattr(args, "tp_backend"):  # our flags were never added to the parser
        raise RuntimeError("megatron_oases' flags are missing from Megatron-LM's args: pass "
                           "extra_args_provider=megatron_oases.megatron_lm.flags."
                           "extra_args_provider to pretrain()")
    if isinstance(args.atp_mesh, str):  # "D1,D2" or "auto": not through our hook
        from megatron_oases.megatron_lm.flags import keep_on_megatron_args, validate_megatron_args

        keep_on_megatron_args(args, validate_megatron_args(args))


def build_model(cfg: RunConfig, config, *, padded_vocab_size: int, pre_process: bool,
                post_process: bool, vp_stage: int | None = None, groups=None):
    """A GPTModel chunk from ``specs.build_gpt_model`` (layer spec of ``--tp-backend``, the
    ``--schedule`` applied), with Megatron-LM's config and padded vocabulary (``args.padded_vocab_size``).

    The Oases schedule recomputes by itself: Megatron's recompute is cleared from the config
    (``--recompute-granularity full`` then selects Oases' recompute through its options).
    """
    import dataclasses

    from megatron_oases.specs import build_gpt_model

    from megatron_oases.schedules.oases.options import oases_runs

    if oases_runs(cfg) and config.recompute_granularity:
        config = dataclasses.replace(config, recompute_granularity=None, recompute_method=None,
                                     recompute_num_layers=None)
    if cfg.oases_layer_degrees:
        # a per-block plan gives layers different shard shapes, which cannot stack on one key
        # with a layer axis: per-layer checkpoint keys (the reference trainer's always)
        config = dataclasses.replace(config, hetereogenous_dist_checkpoint=True)
    # specs pads ``vocab_size``; Megatron-LM has already padded it (from the tokenizer), so hand
    # that over unchanged (Megatron-LM initialises with its own, TP-dependent, init).
    view = dataclasses.replace(cfg, vocab_size=padded_vocab_size, make_vocab_size_divisible_by=1,
                               tp_invariant_init=False)
    return build_gpt_model(view, config, pre_process=pre_process, post_process=post_process,
                           vp_stage=vp_stage, groups=groups)
