"""From the reference trainer's flags to a simulation: predict the step time ``megatron-oases
train`` would print, from a ProfileDB measured for exactly those events.

    args = train_args.build_parser().parse_args([...])
    db = profile_train_args(args)                        # events measured on this machine
    r = predict_train_step(args, db)                     # r.iteration_ms ~ "elapsed time per iteration"

The trainer runs one GPTModel (tied embeddings unless --untie-embeddings-and-output-weights)
under Megatron's no-pipelining / 1F1B / interleaved schedule, finalize_model_grads (DP
all-reduce, tied-embedding all-reduce), then the optimizer step with grad-norm clipping; the
simulated step has the same pieces. Ranks are ranks 0..N-1 of one flat "local" topology unless a
topology is given, so the profile and the prediction agree on event keys.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ...describe.core_attention import attention_kernels_of, core_attention_of
from ...describe.ops import LOOP_EVENTS, is_loop_event
from ...describe.shapes import GPTShape, variant_from_flags
from ...run_config import RunConfig, dtype_name, run_config
from ...topology import Topology
from ...pricing.device_model import DeviceModel, ProfileDB, SimError, gpu_of_device_name, gpu_spec
from ...pricing.stack import stack_of
from ..core.events import build_stage_events, unique_events
from ..core.tape import CURRENT, OasesTape
from ..core.strategy import Strategy
from ..calibrate.profiler import ProfileSettings, profile_events, resolve_topology
from ..core.timeline import SimResult, simulate


def sim_inputs_from_train_args(args: argparse.Namespace, world_size: int | None = None
                               ) -> tuple[GPTShape, Strategy]:
    """Validate the trainer flags as the trainer does and map them to (GPTShape, Strategy)."""
    from ...errors import ConfigError
    from ...train_args import parallel_dims, validate_config, world_size_of
    from ...vocab import padded_vocab_size

    cfg = run_config(args)  # the entry of the trainer's flags into the simulator
    try:
        world = world_size or world_size_of(cfg)
        cfg = validate_config(cfg, world, cuda=cfg.device != "cpu")  # ffn size, mesh, plan filled in
        dims = parallel_dims(cfg, world)
    except ConfigError as e:
        raise SimError(str(e)) from None
    from ...run_config import gqa_groups

    rope = cfg.position_embedding_type == "rope"
    variant = variant_from_flags(num_query_groups=gqa_groups(cfg), swiglu=cfg.swiglu, normalization=cfg.normalization,
                                 add_bias_linear=cfg.add_bias_linear,
                                 position_embedding_type=cfg.position_embedding_type,
                                 rotary_percent=cfg.rotary_percent if rope else 1.0, qk_layernorm=cfg.qk_layernorm,
                                 error=SimError)
    backend = cfg.tp_backend
    if cfg.optimizer != "adam":
        raise SimError(f"--optimizer {cfg.optimizer} is not modeled by the simulator (it profiles and "
                       f"prices Adam's step); drop it or use --optimizer adam to predict")
    if cfg.atp_chunks > 1:  # validation refuses it without --tp-backend atp
        raise SimError("--atp-chunks > 1 (chunked ATP overlap) is not modeled by the simulator yet; use 1")
    dtype = dtype_name(cfg)
    core = run_core_attention(cfg)
    model = GPTShape(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                     num_attention_heads=cfg.num_attention_heads,
                     seq_length=cfg.seq_length, padded_vocab_size=padded_vocab_size(cfg),
                     micro_batch_size=cfg.micro_batch_size, ffn_hidden_size=cfg.ffn_hidden_size, dtype=dtype,
                     tied_embeddings=not cfg.untie_embeddings_and_output_weights,
                     hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout, variant=variant,
                     core_attention=core,
                     attention_kernels=attention_kernels_of(attention_backend=cfg.attention_backend,
                                                            core_attention=core),
                     moe=_moe_of(cfg))
    full = cfg.recompute_granularity == "full"
    block = full and cfg.recompute_method == "block"
    strategy = Strategy(tp=dims.tp, pp=dims.pp, dp=dims.dp,
                        num_microbatches=cfg.global_batch_size // (cfg.micro_batch_size * dims.dp),
                        pipeline_schedule="1f1b", virtual_stages=dims.vp or 1, recompute=full,
                        recompute_layers=cfg.recompute_num_layers if block else 0,
                        selective_recompute=cfg.selective_recompute,
                        schedule=cfg.schedule,  # where Oases runs: Strategy.oases_runs (describe.split)
                        fine_grained_recompute=cfg.oases_fine_grained_recompute,
                        backend=backend, layout=cfg.layout,
                        distributed_optimizer=bool(cfg.use_distributed_optimizer),
                        overlap_grad_reduce=bool(cfg.overlap_grad_reduce),  # train.py's DDP buckets and hooks
                        block_degrees=_plan_degrees(cfg), sequence_parallel=bool(cfg.sequence_parallel),
                        clip_grad=cfg.clip_grad > 0, ep=cfg.expert_model_parallel_size)
    return model, strategy


def run_core_attention(cfg: RunConfig) -> str:
    """The trainer run's core attention (``describe.core_attention``) from its ``--attention-backend``."""
    return core_attention_of(attention_backend=cfg.attention_backend, transformer_impl=cfg.megatron_lm.transformer_impl,
                              error=SimError)


def _moe_of(cfg: RunConfig):
    """The run's MoE layers as the trainer reads them (``megatron_oases.moe.moe_shape_of``, its aux
    loss included); ``sim`` prices ``--moe-layer-freq N``, not Megatron-LM's per-layer list."""
    from ...moe import moe_shape_of

    if isinstance(cfg.moe_layer_freq, (list, tuple)) and cfg.num_experts:
        raise SimError("--moe-layer-freq as a per-layer list is not priced by sim; use --moe-layer-freq N "
                       "(layers 0, N, 2N... MoE) to predict")
    return moe_shape_of(cfg)


def _plan_degrees(cfg: RunConfig) -> tuple[int, ...] | None:
    """``--oases-plan``'s block degrees (attention, mlp per layer) as ``train_args.validate_config`` reads them."""
    layers = cfg.oases_layer_degrees
    return tuple(d for pair in layers for d in pair) if layers else None


def _topology(topology: Topology | str | None, world: int) -> Topology:
    """The given topology, else the trainer's ``--topology``, else one flat level of ``world`` ranks."""
    if topology is None or isinstance(topology, str):

        return resolve_topology(topology, world)
    return topology


def profile_train_args(args: argparse.Namespace, *, world_size: int | None = None,
                       settings: ProfileSettings | None = None, topology: Topology | str | None = None,
                       existing: ProfileDB | None = None, loop_overhead: bool = True, **given: Any) -> ProfileDB:
    """Measure every event the trainer run needs, on ``world_size`` local ranks by default.

    On CPU each compute event runs with ``cpu_count // world_size`` threads, as the spawned ranks do.
    Without ``settings``: the run's (its ranks up to the topology's, its ``--device``, those
    threads), with the ``ProfileSettings`` fields ``given`` that are not None in their place
    (``megatron-oases profile --nproc/--device/--threads/--warmup/--reps/--max-comm-mb``).
    ``loop_overhead``: also the trainer's host work outside the events (``calibrate.loop_overhead``;
    a failure there is recorded in the profile's ``meta`` and leaves those events unmeasured).
    """
    import os

    model, strategy = sim_inputs_from_train_args(args, world_size)
    strategy = dataclasses.replace(strategy, loop_overhead=loop_overhead)
    cfg = run_config(args)  # an entry: the trainer's flags, from the sim CLIs and scripts
    topo = _topology(topology or cfg.topology, strategy.world_size)
    if settings is None:
        settings = ProfileSettings(**{"nproc": min(strategy.world_size, topo.world_size), "device": cfg.device,
                                      "threads": max(1, (os.cpu_count() or 1) // strategy.world_size),
                                      **{k: v for k, v in given.items() if v is not None}})
    events = unique_events(build_stage_events(model, strategy, topo))
    if existing is not None:
        events = {k: e for k, e in events.items() if k not in existing.events_ms}
    db = profile_events(events, topo, settings)
    loop = {events[k].name: k for k in events if is_loop_event(k)}
    if loop_overhead and loop:
        db = _with_loop_overhead(db, args, settings, loop)
    return existing.merged(db) if existing is not None else db


def _with_loop_overhead(db: ProfileDB, args: argparse.Namespace, settings: ProfileSettings,
                        keys: dict[str, str]) -> ProfileDB:
    """``db`` with the loop events ``keys`` (name -> key) measured (``calibrate.loop_overhead``)."""
    from ..calibrate.loop_overhead import LAYERS, forward_backward_ms, single_rank_args, split

    try:
        one = dataclasses.replace(settings, nproc=1)
        # one profile prices both runs (the larger one's events include the smaller one's), so
        # the difference between them is the layer's, not two profiles' noise; the run's own
        # events are reused (a TP-1 run's are all of them)
        small = profile_train_args(single_rank_args(args, max(LAYERS)), world_size=1, settings=one,
                                   existing=db, loop_overhead=False)
        runs = {}
        for layers in LAYERS:
            a = single_rank_args(args, layers)
            runs[layers] = {"trainer_ms": forward_backward_ms(run_config(a), settings.warmup, settings.reps,
                                                              settings.threads),
                            "events_ms": predict_train_step(a, small, world_size=1,
                                                            forward_backward_only=True).iteration_ms}
    except Exception as e:  # noqa: BLE001 -- the events' profile stands; the loop is priced 0
        return dataclasses.replace(db, meta={**db.meta, "loop_overhead_error": f"{type(e).__name__}: {e}"[:300]})
    values = dict(zip(LOOP_EVENTS, split(runs)))
    how = f"trainer forward-backward at {' and '.join(map(str, LAYERS))} layers (one rank) less their events"
    return dataclasses.replace(
        db, events_ms={**db.events_ms, **{k: values[n] for n, k in keys.items()}},
        sources={**db.sources, **{k: how for k in keys.values()}},
        meta={**db.meta, "loop_overhead_runs": {str(n): {k: round(v, 4) for k, v in r.items()}
                                                for n, r in runs.items()}})


def predict_train_step(args: argparse.Namespace, profile: ProfileDB, *, world_size: int | None = None,
                       topology: Topology | str | None = None, forward_backward_only: bool = False,
                       loop_overhead: bool = False) -> SimResult:
    """The simulated step of the trainer run ``args`` priced only from ``profile`` (every event
    must be in it; the error names the missing ones). ``loop_overhead``: with the trainer's host
    work outside the events as the profile measured it (``describe.ops.LOOP_EVENTS``; 0 where it
    did not). ``forward_backward_only``: the events of forward and backward alone (no optimizer)."""
    return _train_step(args, profile, world_size=world_size, topology=topology,
                       forward_backward_only=forward_backward_only, loop_overhead=loop_overhead)


def analytical_train_step(args: argparse.Namespace, *, topology: Topology, gpu: str | None = None,
                          world_size: int | None = None, forward_backward_only: bool = False,
                          **simulate_kw) -> SimResult:
    """The simulated step of the trainer run ``args`` priced by the analytical device model of
    ``gpu`` (default: the topology's ``device``) on ``topology``; as ``predict_train_step``
    otherwise (our builds' ``local`` stack). ``simulate_kw``: ``tape`` (``simulate``'s) and
    ``collective_beside_compute`` (the ``DeviceModel``'s), for a run of another executor or link."""
    return _train_step(args, None, world_size=world_size, topology=topology, gpu=gpu,
                       forward_backward_only=forward_backward_only, loop_overhead=False, **simulate_kw)


def _train_step(args: argparse.Namespace, profile: ProfileDB | None, *, world_size: int | None,
                topology: Topology | str | None, forward_backward_only: bool, loop_overhead: bool,
                gpu: str | None = None, tape: OasesTape = CURRENT,
                collective_beside_compute: float = 1.0) -> SimResult:
    model, strategy = sim_inputs_from_train_args(args, world_size)
    strategy = dataclasses.replace(strategy, loop_overhead=loop_overhead and not forward_backward_only,
                                   optimizer_step=strategy.optimizer_step and not forward_backward_only)
    cfg = run_config(args)  # an entry: the trainer's flags, from the sim CLIs and scripts
    topo = _topology(topology or cfg.topology, strategy.world_size)
    # our builds carry no Apex: the local layer runs the ``local`` stack (pricing/stack.py)
    stack = stack_of(transformer_impl=cfg.megatron_lm.transformer_impl, apex=False, error=SimError)
    # the card's peak (the MFU shown) is that of the card the profile ran on, where the table has it
    gpu = gpu or topo.device or (profile is not None and gpu_of_device_name(profile.device)) or "a100-80gb"
    dm = DeviceModel(gpu=gpu_spec(gpu), topology=topo, profile=profile,
                     bytes_per_element=model.bytes_per_element, fused_attention=model.fused_attention,
                     stack=stack, collective_beside_compute=collective_beside_compute)
    return simulate(model, strategy, dm, memory_limit_GB=0, tape=tape)
