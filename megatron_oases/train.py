"""Reference GPT trainer on Megatron-Core: the stock baseline, and the README's main job.

``megatron-oases train`` / ``python -m megatron_oases.train``. One process per rank: spawned here
with ``--nproc-per-node N`` or started by torchrun / srun. Prints a Megatron-style line per
iteration (loss, step ms, tokens/s, TFLOP/s per rank) and optionally JSON lines.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

from megatron_oases.errors import ConfigError
from megatron_oases.run_config import RunConfig, run_config
from megatron_oases.schedules.oases.options import oases_runs
from megatron_oases.train_args import build_parser, parallel_dims, validate_config, world_size_of
from megatron_oases.vocab import vocab_padding_note


@dataclasses.dataclass
class Trainer:
    """Everything one rank needs for a step."""

    cfg: RunConfig
    """The run's validated configuration (``train_args.validate_config``)."""
    runtime: object
    config: object
    model: list
    optimizer: object
    num_microbatches: int
    dp_rank: int
    dp_size: int
    data: object = None  # datasets.SyntheticData or MegatronData: train and validation batches
    consumed_valid_samples: int = 0
    """Megatron-LM's count of validation samples read so far (``evaluate.Validator``); saved in
    checkpoints, so a resumed run validates on the batches the uninterrupted one would."""


def setup(cfg: RunConfig) -> Trainer:
    """Process groups, model chunks (DDP-wrapped), optimizer for the validated ``cfg``. Call on
    every rank."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_oases.parallel.layout import tp_invariant_init_
    from megatron_oases.runtime import init_distributed, init_runtime
    from megatron_oases.specs import backend_groups, build_gpt_model, transformer_config_from_args

    from megatron_oases.runtime.cuda_env import ensure_cuda_device_max_connections

    ensure_cuda_device_max_connections(cfg.device)  # before CUDA initialises
    runtime = init_runtime(cfg.device)
    init_distributed(runtime, timeout_s=cfg.dist_timeout)
    world = torch.distributed.get_world_size()
    cfg = validate_config(cfg, world, runtime.is_cuda)  # again: the launcher's world may differ
    dims = parallel_dims(cfg, world)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vp,
        expert_model_parallel_size=cfg.expert_model_parallel_size,  # the experts' TP size: TP's
        distributed_timeout_minutes=cfg.dist_timeout / 60.0)  # Megatron's groups: ours too
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)
    config = transformer_config_from_args(cfg, cuda=runtime.is_cuda)
    if dims.pp == 2 and dims.vp:
        # Interleaved PP=2: the previous and the next stage are the same peer, and in the steady
        # state a rank sends an activation (next) and a gradient (prev) to it in one exchange.
        # Megatron's batched p2p posts send_prev before send_next but recv_prev before
        # recv_next, so the peer's in-order matching (same tag, same shape) swaps activation and
        # gradient whenever there are more micro-batches than stages. The unbatched path posts
        # both directions in a matching order on separate groups.
        config.batch_p2p_comm = False

    groups = backend_groups(cfg)
    chunks = []
    for vp_stage in (range(dims.vp) if dims.vp else [None]):
        chunk = build_gpt_model(
            cfg, config, vp_stage=vp_stage, groups=groups,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
        chunk.to(runtime.device)
        chunks.append(chunk)
    if cfg.tp_invariant_init:
        tp_invariant_init_(chunks, seed=cfg.seed, init_method_std=cfg.init_method_std,
                           num_layers=cfg.num_layers)
    planned = bool(cfg.oases_layer_degrees)
    if planned:
        from megatron_oases.layers.planned_layer import sync_replica_params

        sync_replica_params(chunks)
    if cfg.bf16 or cfg.fp16:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.bf16 or cfg.fp16,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        use_distributed_optimizer=cfg.use_distributed_optimizer)
    model = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0)
             for i, c in enumerate(chunks)]
    for m in model:
        m.broadcast_params()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer=cfg.optimizer, lr=cfg.lr, sgd_momentum=cfg.sgd_momentum,
                        weight_decay=cfg.weight_decay,
                        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                        clip_grad=cfg.clip_grad, bf16=cfg.bf16, fp16=cfg.fp16,
                        loss_scale=cfg.loss_scale, initial_loss_scale=cfg.initial_loss_scale,
                        use_distributed_optimizer=cfg.use_distributed_optimizer,
                        params_dtype=config.params_dtype),
        model, use_gloo_process_groups=not runtime.is_cuda)
    config.finalize_model_grads_func = finalize_model_grads
    if planned:
        from megatron_oases.layers.planned_layer import finalize_with_replica_grads

        config.finalize_model_grads_func = finalize_with_replica_grads(finalize_model_grads)
    config.grad_scale_func = optimizer.scale_loss
    if cfg.overlap_grad_reduce:
        no_sync = [m.no_sync for m in model]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    from megatron_oases.datasets import build_data

    return Trainer(cfg=cfg, runtime=runtime, config=config, model=model, optimizer=optimizer,
                   num_microbatches=dims.check_batch(cfg.micro_batch_size, cfg.global_batch_size),
                   dp_rank=ps.get_data_parallel_rank(), dp_size=dims.dp,
                   data=build_data(cfg, ps.get_data_parallel_rank(), dims.dp, runtime.device))


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


def forward_backward(tr: Trainer, batches: list, forward_only: bool = False) -> list:
    """Forward and backward of one global batch's micro-batches through Megatron's schedule, the
    model's gradient buffers zeroed first; no host synchronisation inside. Returns the schedule's
    per-micro-batch loss dicts (last stage). The trainer's step and the one-GPU overlap benchmark
    (``benchmarks.standin``) both run it; the benchmark also times the forward pass alone
    (``forward_only``: autograd still records, as in the step, but nothing runs backward)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for m in tr.model:
        m.zero_grad_buffer()
    data = [iter(batches) for _ in tr.model] if len(tr.model) > 1 else iter(batches)
    return get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=data,
        model=tr.model if len(tr.model) > 1 else tr.model[0],
        num_microbatches=tr.num_microbatches, seq_length=tr.cfg.seq_length,
        micro_batch_size=tr.cfg.micro_batch_size, forward_only=forward_only)


def train_step(tr: Trainer, iteration: int) -> dict:
    """One optimizer step over the global batch; returns loss (on the last stage) and grad norm."""
    import torch
    from megatron.core import parallel_state as ps

    batches = tr.data.train_batches(iteration)
    tr.optimizer.zero_grad()
    t0 = time.perf_counter()
    losses = forward_backward(tr, batches)
    issued = time.perf_counter()
    tr.runtime.synchronize()
    t1 = time.perf_counter()
    ok, grad_norm, _ = tr.optimizer.step()
    tr.runtime.synchronize()
    t2 = time.perf_counter()
    loss = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        value = torch.stack([d["lm loss"] for d in losses]).mean()
        torch.distributed.all_reduce(value, group=ps.get_data_parallel_group())
        loss = (value / tr.dp_size).item()
    return {"loss": loss, "grad_norm": None if grad_norm is None else float(grad_norm),
            "update_successful": bool(ok),
            # Phases of the step, for comparing with the simulator (forward-backward includes
            # finalize_model_grads: DP, tied-embedding and replica gradient reductions).
            "forward_backward_ms": (t1 - t0) * 1e3, "optimizer_ms": (t2 - t1) * 1e3,
            # the host's share: until forward-backward returned, before waiting for the device
            # (on a GPU, about forward_backward_ms when the step is host-bound; on CPU the same)
            "forward_backward_host_ms": (issued - t0) * 1e3}


class TrainingStopped(RuntimeError):
    """Every rank stops training at once; the message is the run's one line (exit 1)."""


def nonfinite_stop(tr: Trainer, iteration: int, out: dict) -> str | None:
    """``--check-for-nan-in-loss-and-grad`` (on by default, as in Megatron-LM): the line that
    stops training when this iteration's loss (known on the last stage) or gradient norm is NaN
    or Inf, else None. A step the fp16 loss scaler skipped has no norm to check (inf gradients
    are its signal), as in Megatron; its loss still counts. Collective: one MAX all-reduce over
    the world, so every rank stops after the same iteration, before anything is saved."""
    import math

    import torch

    if not tr.cfg.check_for_nan_in_loss_and_grad:
        return None
    norm = out["grad_norm"] if out["update_successful"] else None
    bad = [v is not None and kind(v)
           for v in (out["loss"], norm) for kind in (math.isnan, math.isinf)]
    flags = torch.tensor([float(b) for b in bad], device=tr.runtime.device)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    nan_loss, inf_loss, nan_norm, inf_norm = (bool(f) for f in flags.tolist())
    what = [f"the {name} is {'NaN' if nan else 'Inf'}" for name, nan, inf in (
        ("loss", nan_loss, inf_loss), ("gradient norm", nan_norm, inf_norm)) if nan or inf]
    return _nonfinite_line(tr.cfg, iteration, what) if what else None


def _nonfinite_line(cfg: RunConfig, iteration: int, what: list[str]) -> str:
    """The stop's one line: what was not finite, and the ways out that fit this run."""
    fix = f"lower --lr (now {cfg.lr:g})"
    if cfg.load:
        fix += (", or resume from an earlier checkpoint (--ckpt-step N"
                + ("" if cfg.verify_integrity else "; drop --no-verify-integrity to check its files")
                + ")")
    if cfg.data_path:
        fix += ", or check the --data-path files"
    return (f"iteration {iteration}: {' and '.join(what)}; stopped without saving it "
            f"(--check-for-nan-in-loss-and-grad): try a {fix}; "
            f"--no-check-for-nan-in-loss-and-grad trains on regardless")


def is_logging_rank() -> bool:
    """Megatron prints from the last rank (last pipeline stage, first TP/DP rank there)."""
    import torch.distributed as dist

    return dist.get_rank() == dist.get_world_size() - 1


def run(cfg: RunConfig) -> tuple[Trainer, list[dict]]:
    """Set up and train ``--train-iters`` steps on this rank; returns the trainer and the
    per-iteration records (``lm_loss`` is set on the last pipeline stage only)."""
    import torch

    from megatron_oases.evaluate import Validator
    from megatron_oases.flops import gpt_flops_per_iteration
    from megatron_oases.mcore_compat import report_moe_losses
    from megatron_oases.moe import flops_ffn_hidden_size, moe_loss_names, moe_runs
    from megatron_oases.train_args import query_groups
    from megatron_oases.runtime.spawn import report_progress
    from megatron_oases.vocab import padded_vocab_size

    from megatron_oases.runtime.exit_signal import ExitConditions

    exits = ExitConditions(cfg)  # first: a signal during start-up stops after iteration one
    tr = setup(cfg)
    cfg = tr.cfg  # as validated: ffn size and the rest filled in
    if torch.distributed.get_rank() == 0:
        from megatron_oases.specs import build_line

        print(build_line(cfg, world=torch.distributed.get_world_size(),
                         device=tr.runtime.device.type, dist_backend=tr.runtime.backend),
              flush=True)
    from megatron_oases import checkpoint

    first = checkpoint.load_checkpoint(tr) + 1 if cfg.load else 1
    exits.begin(tr.runtime.device)
    report_progress()
    flops = gpt_flops_per_iteration(
        global_batch_size=cfg.global_batch_size, seq_length=cfg.seq_length,
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=flops_ffn_hidden_size(cfg),
        padded_vocab_size=padded_vocab_size(cfg), num_query_groups=query_groups(cfg),
        gated_mlp=cfg.swiglu)
    world = torch.distributed.get_world_size()
    log = is_logging_rank()
    json_file = open(cfg.log_json, "w", encoding="utf-8") if (log and cfg.log_json) else None
    records = []
    validator = Validator(tr, log)
    try:
        for it in range(first, cfg.train_iters + 1):
            torch.distributed.barrier()
            start = time.perf_counter()
            out = train_step(tr, it)
            tr.runtime.synchronize()
            step_s = time.perf_counter() - start
            report_progress()
            rec = {"iteration": it, "lm_loss": out["loss"], "grad_norm": out["grad_norm"],
                   "step_ms": step_s * 1e3,
                   "tokens_per_s": cfg.global_batch_size * cfg.seq_length / step_s,
                   "tflops_per_rank": flops / step_s / world / 1e12,
                   "peak_mem_mb": tr.runtime.max_memory_allocated() / 2**20,
                   "forward_backward_ms": out["forward_backward_ms"],
                   "optimizer_ms": out["optimizer_ms"],
                   "forward_backward_host_ms": out["forward_backward_host_ms"]}
            if moe_runs(cfg):  # Megatron-LM's MoE loss fields (collective: every rank)
                rec.update(report_moe_losses(num_microbatches=tr.num_microbatches, iteration=it,
                                             num_layers=cfg.num_layers, moe_layer_freq=cfg.moe_layer_freq,
                                             track_names=moe_loss_names(cfg)))
            if oases_runs(cfg):
                from megatron_oases.schedules.oases.block import oases_saved_bytes

                rec["oases_saved_mb"] = oases_saved_bytes(tr.model) / 2**20
            records.append(rec)
            if log and it % cfg.log_interval == 0:
                # fp16: a step the loss scaler skips (inf/nan gradients) has no grad norm.
                norm = "skipped" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}"
                print(f" iteration {it:8d}/{cfg.train_iters:8d} | lm loss: {rec['lm_loss']:.6E} | "
                      f"grad norm: {norm} | elapsed time per iteration (ms): "
                      f"{rec['step_ms']:.1f} | tokens/s: {rec['tokens_per_s']:.1f} | "
                      f"TFLOP/s per rank: {rec['tflops_per_rank']:.4f}"
                      + "".join(f" | {name}: {rec[name]:.6E}" for name in moe_loss_names(cfg) if name in rec),
                      flush=True)
            stopped = nonfinite_stop(tr, it, out)
            if not stopped:
                rec.update(validator.after_iteration(it))  # --eval-interval: validation loss fields
            if json_file:
                json_file.write(json.dumps(rec) + "\n")
                json_file.flush()
            if stopped:
                raise TrainingStopped(stopped)
            stop = exits.reason(it, tr.runtime.device) if exits.active else None
            if checkpoint.should_save(cfg, it) or (stop and cfg.save):
                checkpoint.save_checkpoint(tr, it)
            if stop:
                if torch.distributed.get_rank() == 0:
                    print(f" {stop}", flush=True)
                break
    finally:
        if json_file:
            json_file.close()
    return tr, records


def _spawned_rank(cfg: RunConfig) -> str | None:
    """One spawned rank's run; the line of a ``TrainingStopped``, for the launcher to print."""
    try:
        run(cfg)
    except TrainingStopped as exc:
        return str(exc)
    return None


def _ended_by_signal(cfg: RunConfig, signals: tuple[int, ...]) -> str:
    """The launcher's one line when its ranks died of a signal it forwarded to them."""
    import signal

    name = signal.Signals(signals[-1]).name
    if not cfg.exit_signal_handler or name != cfg.exit_signal:
        return (f"the ranks ended on {name} without saving (--exit-signal-handler --save DIR makes "
                f"them finish the iteration, save and exit 0)")
    if signals.count(signals[-1]) == 1:  # it reached a rank before its handler was installed
        return (f"the ranks ended on {name} while starting, before they could catch it; nothing "
                f"was saved")
    return (f"a second {name} ended the ranks at once; a save in progress was abandoned and the "
            f"previous checkpoint in {cfg.save} is the one that loads")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from megatron_oases.runtime.quiet import quiet_known_warnings

    quiet_known_warnings(cpu=False)  # before validation imports Megatron (its import-time notes)
    try:
        cfg = run_config(args)  # the one RunConfig of this run; nothing below sees ``args``
        world = world_size_of(cfg)
        cfg = validate_config(cfg, world, cuda=None)  # torch loads after the checks without it
    except ConfigError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    import torch

    quiet_known_warnings(cpu=not torch.cuda.is_available())
    note = vocab_padding_note(cfg)
    if note and os.environ.get("RANK", "0") == "0":
        print(f"{parser.prog}: {note}", flush=True)
    if cfg.nproc_per_node is not None and "RANK" not in os.environ:
        from megatron_oases.runtime import exit_signal
        from megatron_oases.runtime.spawn import RankFailure, run_on_ranks

        from megatron_oases.runtime.device import detect_runtime

        # spawned ranks keep this choice
        cfg = dataclasses.replace(cfg, device=detect_runtime(cfg.device).device.type)
        if cfg.device == "cuda":
            from megatron_oases.runtime.device import local_ranks_refusal

            refusal = local_ranks_refusal(cfg.nproc_per_node, torch.cuda.device_count())
            if refusal:
                print(f"{parser.prog}: error: --nproc-per-node {cfg.nproc_per_node}: {refusal}; "
                      f"lower --nproc-per-node or use --device cpu", file=sys.stderr)
                return 2
        try:
            # No bound on the run's length: a rank that makes no progress (an iteration) for
            # --dist-timeout + 60 s ends it, named; a hung collective raises after --dist-timeout.
            stopped = run_on_ranks(
                _spawned_rank, cfg.nproc_per_node, args=(cfg,), timeout_s=None,
                stall_timeout_s=cfg.dist_timeout + 60, env=exit_signal.launcher_env(),
                forward_signals=exit_signal.forwarded_signals(cfg))[0]
        except RankFailure as exc:
            if exc.killed_by and exc.killed_by <= set(exc.signals) and not exc.tracebacks:
                # the ranks died of a signal the launcher forwarded: one line, not a report
                print(f"{parser.prog}: {_ended_by_signal(cfg, exc.signals)}", file=sys.stderr)
                return 128 + exc.signals[-1]
            print(f"{parser.prog}: {exc}", file=sys.stderr)
            return 1
    else:
        stopped = _spawned_rank(cfg)  # this process is one rank (torchrun, srun)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if stopped and os.environ.get("RANK", "0") == "0":
        print(f"{parser.prog}: error: {stopped}", file=sys.stderr, flush=True)
    return 1 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
