"""The one place a model is assembled: TransformerConfig from the run's config, layer spec per backend.

A TP backend registers here with one row of ``SPEC_BUILDERS`` (its process groups and layer
spec), so the trainer, the Megatron-LM entry point, the profiler and the tests all build models
the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_oases.describe.backends import backend, resolve
from megatron_oases.mcore_compat import quiet_gpt_model_deprecation, router_gemm_without_te
from megatron_oases.moe import moe_config_kwargs, moe_layer_pattern, moe_runs, moe_words
from megatron_oases.run_config import RunConfig, gqa_groups
from megatron_oases.schedules.oases.options import oases_runs
from megatron_oases.vocab import padded_vocab_size


def transformer_config_from_args(cfg: RunConfig, *, cuda: bool) -> TransformerConfig:
    """Map the run's (Megatron-named) flags onto Megatron-Core's TransformerConfig."""
    from megatron.core.transformer.enums import AttnBackend

    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    oases = oases_runs(cfg)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=_vp_size(cfg),
        sequence_parallel=cfg.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        normalization=cfg.normalization,
        # Llama-family features, set as Megatron-LM's core_transformer_config_from_args sets them
        gated_linear_unit=cfg.swiglu,
        activation_func=torch.nn.functional.silu if cfg.swiglu else torch.nn.functional.gelu,
        num_query_groups=gqa_groups(cfg),
        add_bias_linear=cfg.add_bias_linear,
        qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        # ATP and 3-D attention pick their core attention from it (layers/core_attention.py)
        attention_backend=AttnBackend[cfg.attention_backend],
        init_method_std=cfg.init_method_std,
        # The Oases schedule recomputes by itself (OasesOptions); Megatron's must stay off then.
        recompute_granularity=None if oases else cfg.recompute_granularity,
        recompute_method=None if oases else cfg.recompute_method,
        recompute_num_layers=None if oases else cfg.recompute_num_layers,
        use_cpu_initialization=not cuda,
        # Fused kernels and TE/Apex paths need CUDA; the local spec uses torch ops. On CUDA
        # Megatron's own SwiGLU kernel (``bias_swiglu_impl``, no Apex needed) is 1.76x faster
        # than eager on an H100 (docs/gpu.md, element-wise parts); its GeLU kernel (tanh GeLU,
        # 0.91x), bias-dropout-add (0.46x) and torch.compile'd norms (0.35-0.39x) are slower.
        # ATP and 3-D MLPs activate eagerly (their own ``activate``).
        bias_activation_fusion=cuda and cfg.swiglu,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=cfg.gradient_accumulation_fusion,
        deallocate_pipeline_outputs=True,
        **moe_config_kwargs(cfg),  # Megatron-LM's MoE fields (empty for a dense run)
    )


def _vp_size(cfg: RunConfig) -> int | None:
    if cfg.num_layers_per_virtual_pipeline_stage is None:
        return None
    return cfg.num_layers // cfg.pipeline_model_parallel_size // cfg.num_layers_per_virtual_pipeline_stage


@dataclasses.dataclass(frozen=True)
class SpecBuilder:
    """How the runtime builds one TP backend's layers (the runtime's half of its record in
    ``describe.backends``, which cannot hold torch modules)."""

    groups: Callable[[RunConfig], Any]
    """The process groups its layers need beyond Megatron's (collective: every rank calls it)."""
    spec: Callable[[RunConfig, Any], ModuleSpec]
    """Its TransformerLayer ModuleSpec, given those groups."""


def _no_groups(cfg: RunConfig) -> None:
    return None


def _megatron_spec(cfg: RunConfig, groups, *, moe: bool = False) -> ModuleSpec:
    """Megatron's local spec with the run's core attention (the Oases tapes and planned layers
    build on this spec, so they take it too); on ``--oases-plan`` degrees, the planned layer.
    ``moe``: its MoE layer (Megatron-Core's ``MoELayer``, local ``SequentialMLP`` experts)."""
    from megatron_oases.layers.core_attention import core_attention_class

    if moe:
        router_gemm_without_te()
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts if moe else None,
                                    moe_grouped_gemm=moe and cfg.moe_grouped_gemm,
                                    qk_layernorm=cfg.qk_layernorm, normalization=cfg.normalization)
    spec.submodules.self_attention.submodules.core_attention = core_attention_class(cfg.attention_backend)
    if cfg.oases_layer_degrees:
        from megatron_oases.layers.planned_layer import planned_layer_spec

        spec = planned_layer_spec(spec, cfg.oases_layer_degrees, groups)
    return spec


def _atp_groups(cfg: RunConfig):
    from megatron_oases.parallel.mesh import mesh_groups_from_megatron

    layout = cfg.layout
    return mesh_groups_from_megatron(layout["d1"], layout["d2"])


def _atp_spec(cfg: RunConfig, groups) -> ModuleSpec:
    from megatron_oases.layers.atp_spec import get_gpt_layer_atp_spec

    layout = cfg.layout
    return get_gpt_layer_atp_spec(layout["d1"], layout["d2"], cfg.atp_chunks, mesh_groups=groups)


def _cube_groups(cfg: RunConfig):
    from megatron_oases.parallel.cube import cube_groups_from_megatron

    return cube_groups_from_megatron()


def _cube_spec(cfg: RunConfig, groups) -> ModuleSpec:
    from megatron_oases.layers.tp3d_spec import get_gpt_layer_3d_spec

    return get_gpt_layer_3d_spec(cube_groups=groups)


megatron_builder = SpecBuilder(groups=_no_groups, spec=_megatron_spec)
atp_builder = SpecBuilder(groups=_atp_groups, spec=_atp_spec)
cube_builder = SpecBuilder(groups=_cube_groups, spec=_cube_spec)
"""How each backend's layers are built; its record in ``describe.backends`` names its builder
(``Backend.spec_builder``, ``tests/test_backend_records.py``)."""


def _builder(cfg: RunConfig) -> SpecBuilder:
    return resolve(backend(cfg.tp_backend).spec_builder)


def backend_groups(cfg: RunConfig):
    """Process groups a backend needs beyond Megatron's; collective, so call once on all ranks
    after ``initialize_model_parallel`` (ATP: the two mesh-axis groups of every TP group;
    ``--oases-plan``: the TP sub-groups and reshard groups of its degrees)."""
    if cfg.oases_layer_degrees:
        from megatron_oases.parallel.degree_groups import degree_groups_from_megatron

        return degree_groups_from_megatron({d for pair in cfg.oases_layer_degrees for d in pair})
    return _builder(cfg).groups(cfg)


def layer_spec(cfg: RunConfig, groups=None) -> ModuleSpec:
    """The TransformerLayer ModuleSpec for ``--tp-backend`` (``groups`` from ``backend_groups``)."""
    return _builder(cfg).spec(cfg, groups)


def build_gpt_model(cfg: RunConfig, config: TransformerConfig, *,
                    pre_process: bool, post_process: bool, vp_stage: int | None = None,
                    groups=None) -> GPTModel:
    """One GPTModel chunk (a pipeline stage, or a virtual stage when ``vp_stage`` is set)."""
    spec = layer_spec(cfg, groups)
    if config.sequence_parallel and backend(cfg.tp_backend).sequence_parallel:
        from megatron_oases.layers.torch_norm import sequence_parallel_block_spec

        spec = sequence_parallel_block_spec(spec, config, vp_stage)
    if moe_runs(cfg):
        spec = _moe_block_spec(cfg, config, spec, vp_stage)
    quiet_gpt_model_deprecation()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(cfg),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
        rotary_percent=cfg.rotary_percent,
        rotary_base=cfg.rotary_base,
        vp_stage=vp_stage,
    )
    if cfg.oases_layer_degrees:
        from megatron_oases.layers.planned_layer import connect_planned_layers

        connect_planned_layers(model.decoder)
    if oases_runs(cfg):
        from megatron_oases.schedules.oases.block import enable_oases_schedule
        from megatron_oases.schedules.oases.options import oases_options_of

        enable_oases_schedule(model, oases_options_of(cfg))
    elif cfg.oases_skip_tp_collectives:
        _layers_skip_tp_collectives(model)
    return model


def _moe_block_spec(cfg: RunConfig, config: TransformerConfig, spec, vp_stage: int | None):
    """The block spec of an MoE run: this stage's layers, MoE or dense by ``--moe-layer-freq``
    (``moe.moe_layer_pattern``, Megatron-Core's rule), sliced at Megatron's layer offset; ``spec``:
    the dense layer's spec, or the sequence-parallel block spec (its norms, kept in every layer)."""
    from megatron.core.transformer.transformer_block import (LayerNormImpl, TransformerBlockSubmodules,
                                                             get_num_layers_to_build)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_oases.layers.torch_norm import with_torch_norms

    sp = isinstance(spec, TransformerBlockSubmodules)
    dense, moe = (_megatron_spec(cfg, None, moe=m) for m in (False, True))
    layers = [moe if m else dense for m in moe_layer_pattern(cfg)]
    start = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local = layers[start:start + get_num_layers_to_build(config, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=[with_torch_norms(s) if sp else s for s in local],
                                      layer_norm=spec.layer_norm if sp else LayerNormImpl)


def _layers_skip_tp_collectives(model) -> None:
    """Benchmark only (``--oases-skip-tp-collectives`` with stock layers): the decoder's Megatron
    linears issue no TP collective, as the Oases executor skips its own; the head's are kept.
    ``explicit_expert_comm`` is Megatron's switch for "the caller communicates"."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for m in model.decoder.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.explicit_expert_comm = True


def build_line(cfg: RunConfig, *, world: int, device: str, dist_backend: str,
               stock: bool = False) -> str:
    """The one start-up line naming what the run builds (rank 0 of the trainer and of Megatron-LM's
    entries prints it): the TP backend and its layout (TP size, ATP mesh, cube), the executor,
    the plan, the parallel sizes and the device. ``stock``: Megatron-LM's own model provider
    builds it (a stock run with a checkout), not these specs."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    cp = cfg.megatron_lm.context_parallel_size or 1
    if stock:
        model = "from Megatron-LM's own provider (stock, 1-D TP)"
    else:  # the record's words for its layout: 1-D TP, mesh 2x4, cube 2x2x2
        model = f"--tp-backend {cfg.tp_backend} ({backend(cfg.tp_backend).run_words(cfg.layout, cfg)})"
    executor = (f"--schedule {cfg.schedule}" if cfg.schedule == "default" or oases_runs(cfg)
                else f"--schedule {cfg.schedule} (stock layers at TP 1: nothing to overlap)")
    plan = "no plan"
    if cfg.oases_layer_degrees:
        degrees = " ".join(f"{a}/{m}" for a, m in cfg.oases_layer_degrees)
        plan = f"--oases-plan {cfg.oases_plan} (attention/MLP degree per layer: {degrees})"
    moe = f" | {moe_words(cfg)}" if moe_runs(cfg) else ""
    ep = f" (EP {cfg.expert_model_parallel_size})" if moe_runs(cfg) else ""
    return (f"megatron_oases: model {model}{moe} | {executor} | {plan} | TP {tp} x PP {pp} x "
            f"DP {world // (tp * pp * cp)}{ep}{f' x CP {cp}' if cp > 1 else ''} on {world} ranks | "
            f"{device}, {dist_backend}")
