"""Every Megatron-LM option that shapes a GPT model, and what our builds do with it.

Megatron-LM builds its GPT model from its args in three places: ``core_transformer_config_from_args``
copies every arg named like a ``TransformerConfig`` field and maps a few more by hand;
``gpt_builders.gpt_builder`` picks the layer spec and ``GPTModel`` arguments; the checkout's
``model_provider`` adds memory recording and ModelOpt. Our non-stock builds (``--schedule oases``,
``--oases-plan``, ``--tp-backend atp``/``3d``) take the same ``TransformerConfig`` and
``GPTModel`` arguments, but they replace layers, so an option that only Megatron's own layers
implement would silently do nothing. The rule: every such option is in exactly one class below;
an option our build would drop is refused at parse time (``refusal``), one line naming the flag.

``tests/test_megatron_lm_options.py`` checks every ``TransformerConfig`` field of the installed
megatron-core is classified; with a Megatron-LM checkout, ``tests/test_megatron_lm_checkout.py``
walks the checkout's parser and the three builders' ``args.X`` reads (a new Megatron option fails
the walk until it is classified) and flips every refused option through ``parse_args``.
"""
from __future__ import annotations

import argparse

from megatron_oases.describe.backends import BACKENDS, backend
from megatron_oases.run_config import RunConfig

OWN_ATTENTION = frozenset(name for name, b in BACKENDS.items() if not b.megatron_modules)
"""Builds with their own attention and MLP modules (the Oases tape and planned layers call
Megatron's ``SelfAttention`` and ``MLP`` whole, so what those implement carries over): the TP
backends whose record says so (``describe.backends``)."""

BUILDS = ("oases", "plan", *(name for name in BACKENDS if name in OWN_ATTENTION), "megatron")
"""What replaces Megatron's layers: the Oases schedule, per-block plans, ATP and 3-D layers, and
``megatron``: our build of a stock run (``specs``' megatron spec) where no Megatron-LM model
provider exists (no checkout, ``megatron_lm.wheel_gpt``)."""

ALL = frozenset(BUILDS)

OASES_MOE = frozenset({"oases"})
"""The Oases executor alone (its MoE tape's limits, ``REFUSED``'s last entries)."""

MODEL = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
    "group_query_attention", "swiglu", "normalization", "layernorm_epsilon", "qk_layernorm",
    "add_bias_linear", "hidden_dropout", "attention_dropout", "init_method_std",
    "init_method_xavier_uniform", "embedding_init_method_std", "padded_vocab_size",
    "max_position_embeddings", "untie_embeddings_and_output_weights", "position_embedding_type",
    "rotary_base", "rotary_percent", "rope_type", "fp16", "bf16", "params_dtype", "seed",
    "apply_query_key_layer_scaling", "attention_softmax_in_fp32", "perform_initialization",
    "use_cpu_initialization", "transformer_impl", "attention_backend",
})
"""Honoured by every build: our layers read them from the config, or they act in Megatron's own
modules that every build keeps (embedding, the core attention, norms, output layer, loss,
Float16Module). ``transformer_impl`` and ``position_embedding_type`` are checked in ``flags``;
``attention_backend`` picks every build's core attention (``layers/core_attention.py``: SDPA
kernels, or Megatron's ``DotProductAttention`` for ``local``), and ``flags`` refuses a value the
run cannot honour."""

SHARED = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
    "context_parallel_size", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "calculate_per_token_loss", "clone_scatter_output_in_embedding",
    "pipeline_model_parallel_comm_backend", "microbatch_group_size_per_vp_stage",
    "overlap_p2p_comm", "overlap_p2p_comm_warmup_flush", "use_ring_exchange_p2p",
    "barrier_with_L1_time", "pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "disable_bf16_reduced_precision_matmul",
    "config_logger_dir", "tp_comm_overlap",
})
"""Parallel sizes, recompute, pipeline schedule and loss options: Megatron-LM's loop, schedules and
model-parallel state apply them to every build; where a build does not support a value our
validation refuses it (``--sequence-parallel`` with ATP, ``--context-parallel-size`` > 1,
``--tp-comm-overlap`` with Oases, recompute under Oases mapped onto Oases' own)."""

KERNEL_CHOICE = frozenset({
    "masked_softmax_fusion", "bias_dropout_fusion", "apply_rope_fusion", "bias_gelu_fusion",
    "bias_swiglu_fusion", "no_persist_layer_norm", "gradient_accumulation_fusion",
    "async_tensor_model_parallel_allreduce", "cross_entropy_loss_fusion",
    "cross_entropy_fusion_impl", "deterministic_mode",
})
"""Which kernel computes the same math. Megatron's fused kernels need CUDA and apex or TE; our
own layers run the unfused ops, which is what turning a fusion off asks for."""

MOE = frozenset({
    "num_experts", "expert_model_parallel_size", "moe_extended_tp", "moe_shared_expert_gate",
    "moe_shared_expert_overlap", "moe_layer_freq", "moe_ffn_hidden_size",
    "moe_router_load_balancing_type", "moe_router_topk", "moe_enable_routing_replay",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_score_function", "moe_router_dtype",
    "moe_router_bias_update_rate", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm",
    "moe_aux_loss_coeff", "moe_token_dispatcher_type", "moe_flex_dispatcher_backend",
    "moe_per_layer_logging", "moe_expert_capacity_factor", "moe_token_drop_policy",
    "moe_apply_probs_on_input", "moe_deepep_num_sms",
    "moe_hybridep_num_sms", "use_fused_weighted_squared_relu",
    "expert_tensor_parallel_num_weight_shards", "high_priority_a2a_comm_stream",
    "moe_shared_expert_glu_interleave_size", "moe_router_quantile_balancing_ema",
    "moe_permute_fusion_into_hybridep", "moe_hybridep_pad_uneven_dispatch_inputs",
    "moe_pad_experts_for_cuda_graph_inference", "moe_flex_dispatcher_num_sms",
    "moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute",
    "moe_hybridep_num_sms_preprocessing", "moe_ncclep_static_shape", "moe_ncclep_zero_copy",
    "moe_mlp_glu_interleave_size", "moe_expert_rank_capacity_factor", "moe_paged_stash_page_size",
    "moe_paged_stash_buffer_size_factor_cuda", "moe_paged_stash_buffer_size_factor_cpu",
})
"""Megatron-Core's MoE options (issue 51): every MoE build is Megatron's own ``MoELayer`` on the
local spec (our ``megatron`` spec through ``specs``, or the checkout's provider for a stock run), so
they act there as in stock, and under ``--schedule oases`` too, whose MoE tape
(``schedules/oases/moe_tape.py``) calls Megatron's router, dispatcher and experts between its
own collectives. ``moe.validate_moe_config`` refuses MoE layers under the builds that replace
layers (plans, ATP, 3-D), what the local spec cannot run (``flex``, grouped GEMM), and what the
Oases executor cannot make equal to stock (``describe.moe.moe_refusal``: another dispatcher, a
capacity factor, per-sequence or global load balancing); ``REFUSED`` holds those that need
Transformer Engine or CUDA kernels, an expert TP size other than TP's, and the router and expert
options the Oases tape does not split by sub-batch (z-loss, input jitter, expert bias, forced
routing, shared experts, latent projections, ``--moe-layer-recompute``)."""

GATED = {
    # Read only when an option we refuse (or Transformer Engine, which we refuse) is on.
    **{name: "experimental_attention_variant" for name in (
        "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
        "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "linear_attention_freq",
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "dsa_indexer_topk_freq",
        "dsa_indexer_skip_topk_offset", "dsa_kernel_backend", "dsa_indexer_rope_interleaved",
        "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu", "dsa_indexer_k_norm_epsilon",
        "dsa_indexer_k_norm_fp32")},
    **{name: "fp8" for name in (
        "fp8_recipe", "fp8_quantizer_factory", "fp8_margin", "fp8_interval",
        "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "first_last_layers_bf16",
        "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp8_param_gather",
        "fp8_output_proj")},
    **{name: "fp4" for name in ("fp4_recipe", "fp4_param", "fp4_quantizer_factory",
                                "fp4_param_gather")},
    **{name: "mtp_num_layers" for name in ("mtp_loss_scaling_factor", "mtp_standalone",
                                           "mtp_use_repeated_layer", "mtp_detach_heads",
                                           "mtp_hybrid_override_pattern")},
    **{name: "use_mup" for name in ("mup_width_mult", "mup_base_hidden_size", "mup_embedding_mult",
                                    "mup_output_mult", "mup_base_head_dim",
                                    "mup_attn_scale_power")},
    **{name: "context_parallel_size" for name in (
        "hierarchical_context_parallel_sizes", "max_seqlen_per_dp_cp_rank",
        "hybrid_context_parallel", "cp_comm_type")},
    **{name: "position_embedding_type" for name in ("mrope_section",)},
    **{name: "transformer_impl" for name in (
        "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag",
        "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_split_rs",
        "tp_comm_bootstrap_backend", "symmetric_ar_type", "log_max_attention_logit",
        "use_kitchen_attention", "kitchen_attention_backend", "init_model_with_meta_device",
        "flash_attention_version", "fused_residual_rmsnorm", "use_transformer_engine_op_fuser",
        "use_grouped_gemm_for_dense_mlp")},
    **{name: "cuda_graph_impl" for name in ("cuda_graph_warmup_steps", "cuda_graph_scope",
                                            "cuda_graph_modules")},
    **{name: "cpu_offloading_num_layers" for name in ("cpu_offloading_retain_pinned_cpu_buffers",)},
    **{name: "defer_embedding_wgrad_compute" for name in ("wgrad_deferral_limit",)},
    **{name: "qk_clip" for name in ("qk_clip_alpha", "qk_clip_threshold")},
    **{name: "window_size" for name in ("window_attn_skip_freq",)},
    **{name: "fine_grained_activation_offloading" for name in (
        "offload_modules", "min_offloaded_tensor_size", "delay_offload_until_cuda_graph",
        "delta_offload_bytes_across_pp_ranks", "activation_offload_fraction",
        "fine_grained_offloading_max_inflight_offloads")},
}
"""Options read only while another option is on; that option is refused for our builds (or, for
``transformer_impl``, must be ``local``), so these have no effect on stock's local layers either."""

INERT = frozenset({
    "apply_residual_connection_post_layernorm", "is_hybrid_model", "mamba_state_dim",
    "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "use_mamba_mem_eff_path",
    "mlp_chunks_for_prefill", "flash_decode", "inference_rng_tracker",
    "inference_fuse_tp_communication", "inference_cuda_graph_scope", "nccl_all_reduce_for_prefill",
    "inference_disable_triton_nvls_kernels", "inference_grouped_gemm_backend",
    "inference_moe_disable_fused_quant_kernels", "inference_moe_token_dispatcher_type",
    "mamba_training_ssm_states_dtype",
})
"""Megatron-Core 0.16's GPT model does not read them in training (Mamba, inference-only, or no
reader at all): stock ignores them as our builds do."""

REFUSED: dict[str, tuple[str, frozenset]] = {
    # Alternative models and layer specs.
    "use_legacy_models": ("--use-legacy-models", ALL),
    "spec": ("--spec", ALL),
    "yaml_cfg": ("--yaml-cfg", ALL),
    "multi_latent_attention": ("--multi-latent-attention", ALL),
    "experimental_attention_variant": ("--experimental-attention-variant", ALL),
    "heterogeneous_layers_config_path": ("--heterogeneous-layers-config-path", ALL),
    "mtp_num_layers": ("--mtp-num-layers", ALL),
    "hybrid_layer_pattern": ("--hybrid-layer-pattern", ALL),  # core_v0.19: hybrid (Mamba/DSA) layers
    "modelopt_enabled": ("--modelopt-enabled", ALL),
    # Precision recipes of Transformer Engine / Kitchen.
    "fp8": ("--fp8-format", ALL),
    "fp4": ("--fp4-format", ALL),
    "te_precision_config_file": ("--te-precision-config-file", ALL),
    "kitchen_config_file": ("--kitchen-config-file", ALL),
    "kitchen_recipe_number": ("--kitchen-recipe-number", ALL),
    "fp16_lm_cross_entropy": ("--fp16-lm-cross-entropy", ALL),
    # Position embeddings and activations our layers do not implement.
    "use_rope_scaling": ("--use-rope-scaling", ALL),
    "rotary_seq_len_interpolation_factor": ("--rotary-seq-len-interpolation-factor", ALL),
    "rotary_interleaved": ("--rotary-interleaved", ALL),
    "no_rope_freq": ("--no-rope-freq", ALL),
    "qk_l2_norm": ("--qk-l2-norm", ALL),
    "squared_relu": ("--squared-relu", ALL),
    "quick_geglu": ("--quick-geglu", ALL),
    "glu_linear_offset": ("--glu-linear-offset", ALL),
    "activation_func_clamp_value": ("--activation-func-clamp-value", ALL),
    "use_te_activation_func": ("--use-te-activation-func", ALL),
    # Attention features of Megatron's SelfAttention / softmax that are not parity-tested under
    # our builds (the Oases tape calls SelfAttention whole, but its masks and sub-batch split
    # are ours) or that ATP / 3-D attention does not implement.
    "window_size": ("--window-size", ALL),
    "softmax_type": ("--softmax-type", ALL),
    "attention_output_gate": ("--attention-output-gate", ALL),
    "qk_clip": ("--qk-clip", ALL),
    "test_mode": ("--test-mode", ALL),
    "batch_invariant_mode": ("--batch-invariant-mode", ALL),
    "add_qkv_bias": ("--add-qkv-bias", OWN_ATTENTION),
    "kv_channels": ("--kv-channels", OWN_ATTENTION),
    "layernorm_zero_centered_gamma": ("--apply-layernorm-1p", frozenset({"3d"})),
    "fp32_residual_connection": ("--fp32-residual-connection", ALL),
    # Memory and scheduling features that act inside Megatron's TransformerLayer/Block forward,
    # which the Oases schedule replaces and ATP / 3-D layers are not tested under.
    "distribute_saved_activations": ("--distribute-saved-activations", ALL),
    "recompute_modules": ("--recompute-modules", ALL),
    "cpu_offloading_num_layers": ("--cpu-offloading-num-layers", ALL),
    "fine_grained_activation_offloading": ("--fine-grained-activation-offloading", ALL),
    "delay_wgrad_compute": ("--delay-wgrad-compute", ALL),
    "defer_embedding_wgrad_compute": ("--defer-embedding-wgrad-compute", ALL),
    "enable_cuda_graph": ("--enable-cuda-graph", ALL),
    "external_cuda_graph": ("--external-cuda-graph", ALL),
    "cuda_graph_impl": ("--cuda-graph-impl", ALL),
    # megatron-core 0.17-0.19: weight sharding beyond TP (GTP), MuP scaling, MLP chunking.
    "tensor_parallel_num_weight_shards": ("--tensor-parallel-num-weight-shards", ALL),
    "use_mup": ("--use-mup", ALL),
    "mlp_chunks_for_training": ("--mlp-chunks-for-training", ALL),
    # Data-parallel wrappers that shard the parameters: their unshard hooks fire on a module's
    # forward, which the Oases tape and the ATP / 3-D layers call in parts (as for
    # --overlap-param-gather), and no build of ours is parity-tested on sharded parameters.
    # (Megatron-LM has no --use-custom-fsdp flag: it is set from --use-megatron-fsdp.)
    "use_torch_fsdp2": ("--use-torch-fsdp2", ALL),
    "use_megatron_fsdp": ("--use-megatron-fsdp", ALL),
    # MoE options of Transformer Engine, DeepEP / fused CUDA kernels, or an expert TP size other
    # than TP's (moe.validate_moe_config's expert-parallel split assumes Megatron-LM's default).
    "expert_tensor_parallel_size": ("--expert-tensor-parallel-size", ALL),
    "overlap_moe_expert_parallel_comm": ("--overlap-moe-expert-parallel-comm", ALL),
    "ep_overlap_early_attn_memory_release": ("--ep-overlap-early-attn-memory-release", ALL),
    "overlap_dispatch_backward_with_experts_wgrad": ("--overlap-dispatch-backward-with-experts-wgrad", ALL),
    "moe_enable_deepep": ("--moe-enable-deepep", ALL),
    "moe_permute_fusion": ("--moe-permute-fusion", ALL),
    "moe_router_fusion": ("--moe-router-fusion", ALL),
    "use_grouped_gemm_for_shared_expert": ("--use-grouped-gemm-for-shared-expert", ALL),
    "moe_single_grouped_weight": ("--moe-single-grouped-weight", ALL),
    "moe_single_grouped_bias": ("--moe-single-grouped-bias", ALL),
    "moe_paged_stash": ("--moe-paged-stash", ALL),
    # Router and expert options the Oases MoE tape does not split by sub-batch (a z-loss or an
    # expert bias over the whole micro-batch, jitter drawn per call, shared experts and latent
    # projections outside the tape's steps; --moe-layer-recompute acts in MoELayer.forward, which
    # the tape does not call: Oases recomputes by its own flags): schedules/oases/moe_tape.py
    # refuses the others again for a model built another way.
    "moe_layer_recompute": ("--moe-layer-recompute", OASES_MOE),
    "moe_shared_expert_intermediate_size": ("--moe-shared-expert-intermediate-size", OASES_MOE),
    "moe_latent_size": ("--moe-latent-size", OASES_MOE),
    "moe_z_loss_coeff": ("--moe-z-loss-coeff", OASES_MOE),
    "moe_input_jitter_eps": ("--moe-input-jitter-eps", OASES_MOE),
    "moe_router_enable_expert_bias": ("--moe-router-enable-expert-bias", OASES_MOE),
    "moe_router_force_load_balancing": ("--moe-router-force-load-balancing", OASES_MOE),
    "moe_router_force_biased": ("--moe-router-force-biased", OASES_MOE),
    "moe_router_padding_for_quantization": ("--moe-router-padding-for-quantization", OASES_MOE),
    "moe_router_padding_for_fp8": ("--moe-router-padding-for-fp8", OASES_MOE),
    "moe_pad_expert_input_to_capacity": ("--moe-pad-expert-input-to-capacity", OASES_MOE),
}
"""``dest: (flag, builds that refuse it)``: refused when the run uses one of those builds and the
option differs from Megatron-LM's default."""

ACCEPTED_VALUES = {"spec": (["local"],)}
"""Values of a refused option that ask for what our builds do anyway: ``--spec local`` names
Megatron's local layer spec, which our builds assemble their layers on, and Megatron-LM's
``validate_args`` requires it with ``--attention-backend local``."""

PROVIDER = frozenset({"record_memory_history", "memory_snapshot_path"})
"""Read by the checkout's ``model_provider``, which builds our models too
(``ModelProvider`` hands it our builder in place of ``gpt_builder``)."""

NOT_FLAGS = frozenset({
    "virtual_pipeline_model_parallel_size", "timers", "finalize_model_grads_func",
    "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func", "enable_autocast",
    "autocast_dtype", "num_microbatches_with_partial_activation_checkpoints",
    "use_te_rng_tracker", "tp_comm_atomic_ag", "tp_comm_atomic_rs",
    "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1", "pipeline_dtype",
    "variable_seq_lengths", "batch_p2p_comm", "batch_p2p_sync", "deallocate_pipeline_outputs",
    "cpu_offloading", "_cpu_offloading_context", "cpu_offloading_activations",
    "cpu_offloading_weights", "cpu_offloading_double_buffering",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "softmax_scale",
    "gated_linear_unit", "activation_func", "activation_func_fp8_input_store", "num_moe_experts",
    "init_method", "output_layer_init_method", "embedding_init_method", "bias_activation_fusion",
    "persist_layer_norm", "memory_efficient_layer_norm", "fused_single_qkv_rope", "fp8_param",
    "fp8_dot_product_attention", "fp8_multi_head_attention", "tp_only_amax_red", "use_kitchen",
    "moe_router_topk_limited_devices", "moe_token_dropping", "cuda_graph_use_single_mempool",
    "cuda_graph_retain_backward_graph", "disable_parameter_transpose_cache",
    "inference_sampling_seed", "use_inference_optimized_layers", "heterogeneous_block_specs",
    "hetereogenous_dist_checkpoint", "quant_recipe",
    # megatron-core 0.17-0.19: derived by Megatron or set by its training loop
    "gtp_weight_remat_size", "expert_gtp_weight_remat_size", "moe_grad_scale_func",
    "mtp_grad_scale_func", "experimental_attention_variant_loss_scale_func",
})
"""``TransformerConfig`` fields Megatron-LM has no flag for: set from other args (mapped above:
``gated_linear_unit`` from ``swiglu``, ``persist_layer_norm`` from ``no_persist_layer_norm``, ...)
or by its training loop (gradient hooks, timers), or left at Megatron-Core's default."""


def classes() -> dict[str, str]:
    """Every classified name -> its class; a name in two classes is a bug (test)."""
    out: dict[str, str] = {}
    for cls, names in (("model", MODEL), ("shared", SHARED), ("kernel", KERNEL_CHOICE), ("moe", MOE),
                       ("gated", GATED), ("inert", INERT), ("refused", REFUSED),
                       ("provider", PROVIDER),
                       ("not-a-flag", NOT_FLAGS)):
        for name in names:
            if name in out:
                raise AssertionError(f"{name} is both {out[name]} and {cls}")
            out[name] = cls
    return out


def builds_of(cfg: RunConfig) -> frozenset:
    """Which of ``BUILDS`` a run uses (empty: stock Megatron-LM)."""
    out = set()
    if cfg.schedule == "oases":
        out.add("oases")
    if cfg.oases_plan is not None:
        out.add("plan")
    if not backend(cfg.tp_backend).megatron_modules:
        out.add(cfg.tp_backend)
    return frozenset(out)


def refusal(args: argparse.Namespace, cfg: RunConfig, defaults: dict | None,
            what: str) -> str | None:
    """The one-line refusal for the first refused option this run sets, or None.

    ``args``: Megatron-LM's namespace, whose own options (``REFUSED``, which ``RunConfig`` does
    not carry) are read by name; ``cfg``: its ``RunConfig``. ``defaults``: Megatron-LM's parser
    defaults (dest -> default); without them (a namespace not from Megatron-LM's parser) an
    option counts as set when it is truthy.
    """
    from megatron_oases.run_config import options_present

    builds = builds_of(cfg) or frozenset({"megatron"})  # a stock run that we build
    values = options_present(args, REFUSED)
    for name, (flag, refused_by) in REFUSED.items():
        if not (builds & refused_by) or name not in values:
            continue
        value = values[name]
        if any(value == ok for ok in ACCEPTED_VALUES.get(name, ())):
            continue
        set_ = (value != defaults[name]) if defaults and name in defaults else bool(value)
        if set_:
            return (f"{what} builds its own layers and does not support {flag}; drop one of "
                    f"them (docs/megatron_lm.md lists what each build honours)")
    return None
