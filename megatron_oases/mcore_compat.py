"""The one place that knows megatron-core versions: every difference between the supported
releases (0.16.1 up to 0.19.x) is bridged here, each function naming the release that changed.

Layers, trainer, checkpoints and the Megatron-LM entry call these helpers instead of testing the
version themselves, so the next API change is fixed in one file (and a test per supported
version builds one layer of every backend: ``tests/test_mcore_compat.py``).
"""
from __future__ import annotations

import contextlib
import functools
import re

OLDEST = (0, 16, 1)
"""The oldest megatron-core release we support (``setup.py``'s lower bound)."""
NEWEST_MINOR = (0, 19)
"""The newest supported MAJOR.MINOR (``setup.py``'s upper bound is the next minor)."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.19.2"`` / ``"0.19.0rc1"`` -> ``(0, 19, 2)`` / ``(0, 19, 0)``."""
    parts = [int(re.match(r"\d+", p).group()) if re.match(r"\d+", p) else 0
             for p in text.split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def mcore_version() -> tuple[int, int, int]:
    """The installed megatron-core's (major, minor, patch)."""
    from megatron.core.package_info import __version__

    return parse_version(__version__)


def at_least(major: int, minor: int, patch: int = 0) -> bool:
    """Whether the installed megatron-core is this release or newer."""
    return mcore_version() >= (major, minor, patch)


def python_for(version: tuple[int, int, int]) -> tuple[int, int]:
    """The oldest Python a release installs on (0.17 raised ``Requires-Python`` to 3.12)."""
    return (3, 12) if tuple(version) >= (0, 17, 0) else (3, 10)


def supported(version: tuple[int, int, int]) -> bool:
    """Whether ``version`` is in the supported range [OLDEST, NEWEST_MINOR.x]."""
    return OLDEST <= tuple(version) and tuple(version[:2]) <= NEWEST_MINOR


# --- Layer construction (TransformerLayer's calls into its submodules) ------------------------

SUBMODULE_BUILD_KWARGS = {
    "pp_layer_offset": (0, 17),  # attention: TransformerLayer passes its pipeline offset
    "name": (0, 18),             # attention and MLP: the module's dotted name
    "pg_collection": (0, 18),    # MLP: called as an MlpBuilder (the attention always had it)
    "is_mtp_layer": (0, 18),     # MLP: MlpBuilder's flag for multi-token-prediction layers
}
"""Keywords newer ``TransformerLayer``s pass to the attention and MLP submodules they build,
with the release that added each. Our backends take their process groups from the spec's
params (mesh / cube groups), so these carry nothing they need."""


def accept_submodule_kwargs(owner: str, kwargs: dict) -> None:
    """Let ``owner``'s ``__init__`` take the keywords of ``SUBMODULE_BUILD_KWARGS`` (any
    release) and refuse any other keyword, as a normal signature would."""
    unknown = sorted(set(kwargs) - set(SUBMODULE_BUILD_KWARGS))
    if unknown:
        raise TypeError(f"{owner}.__init__() got unexpected keyword argument(s) {unknown}")


def dense_mlp_parts(mlp_submodule):
    """``(cls, submodules, params)`` of a ``TransformerLayerSubmodules.mlp`` entry that builds
    Megatron's dense ``MLP`` (``cls(config=, submodules=, tp_group=, **params)`` builds it on
    any TP group), or None for anything else.

    0.16-0.17: a ``ModuleSpec(MLP)``. From 0.18 ``mlp`` is an ``MlpBuilder``:
    ``get_gpt_layer_local_spec`` returns ``functools.partial(MLP.as_mlp_submodule, submodules=,
    **params)``, and ``TransformerLayer.__init__`` replaces a ``ModuleSpec(MLP)`` by that
    partial *in the shared submodules*, so later layers of the block see the partial.
    """
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(mlp_submodule, ModuleSpec) and isinstance(mlp_submodule.module, type) \
            and issubclass(mlp_submodule.module, MLP):
        return mlp_submodule.module, mlp_submodule.submodules, dict(mlp_submodule.params or {})
    if isinstance(mlp_submodule, functools.partial) and not mlp_submodule.args:
        owner = getattr(mlp_submodule.func, "__self__", None)
        if isinstance(owner, type) and issubclass(owner, MLP) \
                and mlp_submodule.func.__name__ == "as_mlp_submodule":
            params = dict(mlp_submodule.keywords)
            return owner, params.pop("submodules", None), params
    return None


# --- Models ------------------------------------------------------------------------------------

_GPT_MODEL_DEPRECATION = "GPTModel IS DEPRECATED"


def local_grouped_mlp():
    """Megatron-Core's local grouped-GEMM experts class (``GroupedMLP``, over the ``grouped_gemm``
    package), or None: 0.19 removed it, and its local spec builds ``SequentialMLP`` whatever
    ``moe_grouped_gemm`` says (only Transformer Engine's ``TEGroupedMLP`` groups the GEMMs)."""
    from megatron.core.transformer.moe import experts

    return getattr(experts, "GroupedMLP", None)


def router_gemm_without_te() -> None:
    """megatron-core 0.16's MoE router reads ``moe_utils.te_general_gemm``, which that release
    binds only when Transformer Engine imports (later releases bind it to None otherwise), so
    every MoE forward without TE dies on a NameError. Bind it to None there, as later releases
    do: the router then runs its torch GEMM. Nothing to do where the name exists."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def oases_moe_hooks_missing() -> str:
    """What this megatron-core lacks for the Oases executor over MoE layers ("" when nothing):
    the tape attaches each sub-batch's aux loss through the router's
    ``attach_and_log_load_balancing_loss`` and silences the metrics tracker in recompute
    (``moe_utils.get_moe_metrics_tracker``), both 0.19's; 0.16.1 has neither (its tracker is
    ``save_to_aux_losses_tracker``)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    needed = (("moe_utils.get_moe_metrics_tracker", hasattr(moe_utils, "get_moe_metrics_tracker")),
              ("TopKRouter.attach_and_log_load_balancing_loss",
               hasattr(TopKRouter, "attach_and_log_load_balancing_loss")))
    return ", ".join(name for name, present in needed if not present)


def report_moe_losses(*, num_microbatches: int, iteration: int, num_layers: int, moe_layer_freq,
                      track_names: list[str]) -> dict[str, float]:
    """The MoE routers' losses of the last step, as Megatron-LM's ``training_log`` gathers them
    (``load_balancing_loss``...: summed over the MoE layers and pipeline stages, averaged over the
    micro-batches), and the tracker cleared for the next step. Collective: every rank calls it.
    0.19 deprecates ``moe_utils.track_moe_metrics`` for ``get_moe_metrics_tracker().report``,
    which takes the same keywords; 0.16-0.18 have only the former."""
    from megatron.core.transformer.moe import moe_utils

    totals: dict = {}
    tracker = getattr(moe_utils, "get_moe_metrics_tracker", None)
    report = tracker().report if tracker is not None else moe_utils.track_moe_metrics
    report(loss_scale=1.0 / num_microbatches, iteration=iteration, total_loss_dict=totals,
           force_initialize=True, track_names=track_names, num_layers=num_layers,
           moe_layer_freq=moe_layer_freq)
    return {name: float(value) for name, value in totals.items()}


def quiet_gpt_model_deprecation() -> None:
    """0.19 logs "GPTModel IS DEPRECATED ... HybridModel" for every model chunk built. Megatron-LM's
    own ``pretrain_gpt.py`` (``gpt_builders``) still builds ``GPTModel`` at core_v0.19.0, and so do
    we (the stock baseline must be the model users train), so the line is noise: drop it (and
    only it) from Megatron's ``gpt_model`` logger. Idempotent; nothing logs it before 0.19."""
    _drop_log_line("megatron.core.models.gpt.gpt_model", _GPT_MODEL_DEPRECATION)


# --- Megatron-LM's training entry (megatron.training.pretrain) --------------------------------
# 0.16.x: ``megatron.training`` exists only in a Megatron-LM checkout; ``pretrain(datasets,
#         model_provider, model_type, forward_step, extra_args_provider=, args_defaults=, ...)``
#         parses the args itself.
# 0.17.0: the megatron-core wheel ships ``megatron.training`` too (not Megatron-LM's top-level
#         ``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py``); ``pretrain`` as above.
# 0.18.0: ``pretrain(cfg_container, datasets, model_provider, model_type, forward_step, ...)``:
#         the args come first from ``arguments.parse_and_validate_args(extra_args_provider=,
#         args_defaults=)``, the container from ``argument_utils.pretrain_cfg_container_from_args``;
#         ``get_batch_on_this_tp_rank`` moved to ``megatron.core.utils`` and takes the batch.
# 0.19.0: ``pretrain(cfg_container, datasets, model_type, forward_step, model_provider=None, ...)``;
#         a model config in the container (stock ``pretrain_gpt.py``: ``gpt_config_from_args``)
#         builds the model and the provider is then unused; ``get_batch_on_this_tp_rank``'s
#         ``is_sft`` became ``has_cu_seqlens``.

_MODEL_CONFIG_ADVICE = r"\s*It is recommended to use a ModelConfig"


def megatron_training_in_wheel() -> bool:
    """Whether the installed megatron-core ships ``megatron.training`` (0.17+)."""
    return at_least(0, 17)


def initialize_loads_fused_kernels() -> bool:
    """Whether ``megatron.training.initialize._compile_dependencies`` calls
    ``megatron.legacy.fused_kernels.load`` (0.16; 0.17 dropped it, and ``megatron.legacy``)."""
    return not at_least(0, 17)


def run_pretrain(pretrain, *, datasets_provider, model_provider, forward_step,
                 extra_args_provider, args_defaults: dict, stock_model_config=None, **kwargs):
    """``pretrain`` (``megatron.training.pretrain``, possibly wrapped for in-process restart) as
    the installed release calls it, with our ``extra_args_provider`` and ``model_provider``.

    ``stock_model_config(args) -> bool``: whether this run is the checkout's stock build. From 0.19
    stock ``pretrain_gpt.py`` builds its model from ``gpt_config_from_args(args)`` (a config in the
    container, which ``pretrain`` prefers to the provider), so a stock run does the same there;
    before 0.19 the stock script hands over its provider, and so do we (``model_provider`` routes
    stock runs to it). ``kwargs``: ``store``, ``get_embedding_ranks``, ... as keywords.
    """
    import warnings

    from megatron.core.enums import ModelType

    model_type = ModelType.encoder_or_decoder
    if not at_least(0, 18):
        return pretrain(datasets_provider, model_provider, model_type, forward_step,
                        args_defaults=args_defaults, extra_args_provider=extra_args_provider,
                        **kwargs)
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=extra_args_provider,
                                   args_defaults=args_defaults)
    model_cfg = None
    if at_least(0, 19) and stock_model_config is not None and stock_model_config(args):
        from megatron.training.argument_utils import gpt_config_from_args

        model_cfg = gpt_config_from_args(args)
    with warnings.catch_warnings():  # "use a ModelConfig": our provider is the point here
        warnings.filterwarnings("ignore", message=_MODEL_CONFIG_ADVICE)
        container = pretrain_cfg_container_from_args(args, model_cfg)
    if not at_least(0, 19):
        return pretrain(container, datasets_provider, model_provider, model_type, forward_step,
                        **kwargs)
    return pretrain(container, datasets_provider, model_type, forward_step,
                    model_provider=model_provider, **kwargs)


def repair_help_strings(parser) -> None:
    """Escape the ``%`` of help strings argparse cannot expand, so ``--help`` prints instead of
    raising ValueError (0.19.2: ``--moe-paged-stash-buffer-size-factor-cuda`` says "10%)").
    A no-op where every help string formats."""
    import re

    for action in parser._actions:
        if action.help and "%" in action.help:
            try:
                action.help % {**vars(action), "prog": parser.prog}
            except (ValueError, TypeError, KeyError):
                action.help = re.sub(r"%(?!\()", "%%", action.help)


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def batch_on_this_tp_rank(data_iterator, args) -> dict:
    """The next GPT micro-batch on every rank of the TP group: TP rank 0 reads it, Megatron's
    ``get_batch_on_this_tp_rank`` broadcasts it (no packed sequences, MTP or hybrid CP).
    Keys: ``_BATCH_KEYS`` (``attention_mask`` None unless the dataloader creates it)."""
    from megatron.core import mpu

    if not at_least(0, 18):  # 0.17: reads the iterator itself (megatron.training.utils)
        from megatron.training.utils import get_batch_on_this_tp_rank

        batch = get_batch_on_this_tp_rank(data_iterator)
        return {k: batch.get(k) for k in _BATCH_KEYS}
    from megatron.core.utils import get_batch_on_this_tp_rank

    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        data = next(data_iterator)
        batch = {k: (data[k].cuda(non_blocking=True) if data.get(k) is not None else None)
                 for k in _BATCH_KEYS}
    packed = {"has_cu_seqlens": False} if at_least(0, 19) else {"is_sft": False}
    batch = get_batch_on_this_tp_rank(
        batch, **packed, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=1, tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=False, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    return {k: batch.get(k) for k in _BATCH_KEYS}


# --- Checkpoints: where dist_checkpointing keeps the common state (changed in 0.19) ------------

COMMON_PT = "common.pt"
"""The file that held the common (non-sharded) state up to 0.18, read from 0.19 as legacy."""
COMMON_STATE_ITEM = "common_state/shard_0_1"
"""From 0.19 the common state is the ``ShardedObject("common_state", ..., (1,), (0,))`` inside the
torch_dist files: this is its item name in ``.metadata`` (``ShardedObject.unique_key``)."""


def common_state_in_torch_dist() -> bool:
    """0.19 stopped writing ``common.pt`` (and dropped ``save/load(common_strategy=)``): the common
    state (our iteration, flags, checkpoint version) is saved as the ``common_state`` object in the
    torch_dist shard files, and ``common.pt`` is read only when a legacy checkpoint has one.
    Before 0.19 it is ``common.pt`` only, so such a release cannot read a 0.19 checkpoint."""
    return at_least(0, 19)


def load_common_state(path: str) -> dict:
    """The common state dict of the torch_dist checkpoint in ``path``, without a process group.

    0.19+: Megatron's ``load_common_state_dict`` (reads ``common.pt`` when present, else the
    ``common_state`` object; its deprecation line for the legacy file is dropped). Before: the
    ``common.pt`` file (``weights_only``: plain values and tensors only)."""
    import os

    import torch

    if not common_state_in_torch_dist():
        return torch.load(os.path.join(path, COMMON_PT), map_location="cpu", weights_only=True)
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    _drop_log_line("megatron.core.dist_checkpointing.strategies.common",
                        "load_common is deprecated")
    with _torch_load_to_cpu():
        return load_common_state_dict(path)


@contextlib.contextmanager
def _torch_load_to_cpu():
    """``torch.load`` without a ``map_location`` maps to the CPU inside: Megatron's 0.19 reader of
    the common state (and torch's distributed-checkpoint planner under it) pass none, so a tensor
    saved on a GPU (``--fp16``'s loss scale) came back on ``cuda:0``: a CUDA context on GPU 0 for
    the launcher and every rank, or a failure on a machine without CUDA, like the ``map_location``
    the older ``common.pt`` path gives."""
    import torch

    real = torch.load

    def load(*args, **kwargs):
        kwargs.setdefault("map_location", "cpu")
        return real(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def quiet_sync_save_deprecation() -> None:
    """0.19's synchronous torch_dist save runs through Megatron's own async machinery and logs,
    once per rank, that "MCore's async save is deprecated" (use NVRx): our saves are synchronous,
    so the line is noise; drop it (and only it). Idempotent; nothing logs it before 0.19."""
    _drop_log_line("megatron.core.dist_checkpointing.strategies.torch",
                        "MCore's async save is deprecated")


def _drop_log_line(logger_name: str, text: str) -> None:
    """Filter log records containing ``text`` out of ``logger_name`` (once per pair)."""
    import logging

    logger = logging.getLogger(logger_name)
    if any(getattr(f, "oases_drops", None) == text for f in logger.filters):
        return

    def drop(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()

    drop.oases_drops = text
    logger.addFilter(drop)
