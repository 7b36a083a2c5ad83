"""The one place a model is assembled: TransformerConfig from trainer args, layer spec per backend.

Later backends (ATP, 3-D) and schedules (Oases) register here, so the trainer, the Megatron-LM
entry point and the tests all build models the same way.
"""
from __future__ import annotations

import argparse

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from megatron_oases.mcore_compat import quiet_gpt_model_deprecation
from megatron_oases.run_config import RunConfig, gqa_groups, run_config
from megatron_oases.schedules.oases.options import oases_runs
from megatron_oases.vocab import padded_vocab_size


def transformer_config_from_args(args: argparse.Namespace | RunConfig, *,
                                 cuda: bool) -> TransformerConfig:
    """Map the trainer's (Megatron-named) flags onto Megatron-Core's TransformerConfig."""
    from megatron.core.transformer.enums import AttnBackend

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    oases = oases_runs(args)
    cfg = run_config(args)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=_vp_size(args),
        sequence_parallel=args.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        normalization=args.normalization,
        # Llama-family features, set as Megatron-LM's core_transformer_config_from_args sets them
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        num_query_groups=gqa_groups(args),
        add_bias_linear=args.add_bias_linear,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        # ATP and 3-D attention pick their core attention from it (layers/core_attention.py)
        attention_backend=AttnBackend[cfg.attention_backend],
        init_method_std=args.init_method_std,
        # The Oases schedule recomputes by itself (OasesOptions); Megatron's must stay off then.
        recompute_granularity=None if oases else args.recompute_granularity,
        recompute_method=None if oases else args.recompute_method,
        recompute_num_layers=None if oases else args.recompute_num_layers,
        use_cpu_initialization=not cuda,
        # Fused kernels and TE/Apex paths need CUDA; the local spec uses torch ops. On CUDA
        # Megatron's own SwiGLU kernel (``bias_swiglu_impl``, no Apex needed) is 1.76x faster
        # than eager on an H100 (docs/gpu.md, element-wise parts); its GeLU kernel (tanh GeLU,
        # 0.91x), bias-dropout-add (0.46x) and torch.compile'd norms (0.35-0.39x) are slower.
        # ATP and 3-D MLPs activate eagerly (their own ``activate``).
        bias_activation_fusion=cuda and args.swiglu,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        deallocate_pipeline_outputs=True,
    )


def _vp_size(args) -> int | None:
    if args.num_layers_per_virtual_pipeline_stage is None:
        return None
    return args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage


def backend_groups(args: argparse.Namespace | RunConfig):
    """Process groups a backend needs beyond Megatron's; collective, so call once on all ranks
    after ``initialize_model_parallel`` (ATP: the two mesh-axis groups of every TP group;
    ``--oases-plan``: the TP sub-groups and reshard groups of its degrees)."""
    cfg = run_config(args)
    if cfg.oases_layer_degrees:
        from megatron_oases.parallel.degree_groups import degree_groups_from_megatron

        return degree_groups_from_megatron({d for pair in cfg.oases_layer_degrees for d in pair})
    if cfg.tp_backend == "atp":
        from megatron_oases.parallel.mesh import mesh_groups_from_megatron

        return mesh_groups_from_megatron(*cfg.atp_mesh)
    if cfg.tp_backend == "3d":
        from megatron_oases.parallel.cube import cube_groups_from_megatron

        return cube_groups_from_megatron()
    return None


def layer_spec(args: argparse.Namespace | RunConfig, groups=None):
    """The TransformerLayer ModuleSpec for ``--tp-backend`` (``groups`` from ``backend_groups``)."""
    cfg = run_config(args)
    if cfg.tp_backend == "megatron":
        from megatron_oases.layers.core_attention import core_attention_class

        spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm,
                                        normalization=cfg.normalization)
        # --attention-backend: Megatron's local spec with the run's core attention (the Oases
        # tapes and planned layers build on this spec, so they take it too)
        spec.submodules.self_attention.submodules.core_attention = core_attention_class(
            cfg.attention_backend)
        if cfg.oases_layer_degrees:
            from megatron_oases.layers.planned_layer import planned_layer_spec

            spec = planned_layer_spec(spec, cfg.oases_layer_degrees, groups)
        return spec
    if cfg.tp_backend == "atp":
        from megatron_oases.layers.atp_spec import get_gpt_layer_atp_spec

        d1, d2 = cfg.atp_mesh
        return get_gpt_layer_atp_spec(d1, d2, cfg.atp_chunks, mesh_groups=groups)
    if cfg.tp_backend == "3d":
        from megatron_oases.layers.tp3d_spec import get_gpt_layer_3d_spec

        return get_gpt_layer_3d_spec(cube_groups=groups)
    raise ValueError(f"unknown --tp-backend {cfg.tp_backend!r}")


def build_gpt_model(args: argparse.Namespace | RunConfig, config: TransformerConfig, *,
                    pre_process: bool, post_process: bool, vp_stage: int | None = None,
                    groups=None) -> GPTModel:
    """One GPTModel chunk (a pipeline stage, or a virtual stage when ``vp_stage`` is set)."""
    cfg = run_config(args)
    spec = layer_spec(cfg, groups)
    if config.sequence_parallel and cfg.tp_backend == "megatron":
        from megatron_oases.layers.torch_norm import sequence_parallel_block_spec

        spec = sequence_parallel_block_spec(spec, config, vp_stage)
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
        from megatron_oases.schedules.oases.options import oases_options_from_args

        enable_oases_schedule(model, oases_options_from_args(cfg))
    elif cfg.oases_skip_tp_collectives:
        _layers_skip_tp_collectives(model)
    return model


def _layers_skip_tp_collectives(model) -> None:
    """Benchmark only (``--oases-skip-tp-collectives`` with stock layers): the decoder's Megatron
    linears issue no TP collective, as the Oases executor skips its own; the head's are kept.
    ``explicit_expert_comm`` is Megatron's switch for "the caller communicates"."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for m in model.decoder.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.explicit_expert_comm = True
