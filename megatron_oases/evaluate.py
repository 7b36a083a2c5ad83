"""Validation for the reference trainer: ``--eval-interval N --eval-iters K``, as Megatron-LM.

Every N iterations, and once more after the last one, K global batches of the validation data run
forward-only through ``get_forward_backward_func`` (the same schedule as training, so PP and the
Oases executor see the layout they train with). The loss is Megatron-LM's: the token-weighted
mean over all K batches, micro-batches and data-parallel ranks (sum of masked token losses over
the sum of the loss mask), printed in Megatron's format on the logging rank, and PPL =
exp(min(20, loss)). Validation batches follow each other over the run: the e-th validation uses
validation batches e*K .. e*K+K-1, so no two validations repeat data (Megatron's valid iterator
does the same). Where the next validation starts is the trainer's ``consumed_valid_samples``
(Megatron-LM's name), which checkpoints keep, so a resumed run goes on where the saved one was.
"""
from __future__ import annotations

import math


def _eval_loss_func(loss_mask, output_tensor):
    import torch

    losses = output_tensor.float()
    total = (losses * loss_mask).sum()
    count = loss_mask.sum()
    # The schedule scales the first output in place; the reported pair is a separate tensor.
    return total / count.clamp_min(1), {"lm loss": torch.stack([total.detach(), count.detach()])}


def _eval_forward_step(data_iterator, model):
    import functools

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_eval_loss_func, batch["loss_mask"])


def evaluate(tr, first_batch: int, num_batches: int) -> float | None:
    """Forward-only loss over validation batches ``first_batch ..`` (``num_batches`` of them);
    the value on the last pipeline stage, None elsewhere. Collective: call on every rank."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = tr.cfg
    sums = torch.zeros(2, dtype=torch.float64, device=tr.runtime.device)
    for m in tr.model:
        m.eval()
    try:
        with torch.no_grad():
            for b in range(first_batch, first_batch + num_batches):
                batches = tr.data.valid_batches(b)
                data = [iter(batches) for _ in tr.model] if len(tr.model) > 1 else iter(batches)
                out = get_forward_backward_func()(
                    forward_step_func=_eval_forward_step, data_iterator=data,
                    model=tr.model if len(tr.model) > 1 else tr.model[0],
                    num_microbatches=tr.num_microbatches, seq_length=cfg.seq_length,
                    micro_batch_size=cfg.micro_batch_size, forward_only=True)
                for d in out:
                    sums += d["lm loss"].to(torch.float64)
    finally:
        for m in tr.model:
            m.train()
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    torch.distributed.all_reduce(sums, group=ps.get_data_parallel_group())
    return float(sums[0] / sums[1])


def validation_line(where: str, loss: float) -> str:
    """Megatron-LM's line (``evaluate_and_print_results``), without its dashed frame."""
    return (f" validation loss at {where} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {math.exp(min(20.0, loss)):.6E} | ")


class Validator:
    """When to validate and on which batches; ``after_iteration`` returns the record fields."""

    def __init__(self, tr, log: bool):
        from megatron_oases.datasets import eval_enabled

        self.tr, self.log = tr, log
        self.enabled = eval_enabled(tr.cfg)

    def _run(self, where: str) -> float | None:
        cfg = self.tr.cfg
        first = self.tr.consumed_valid_samples // cfg.global_batch_size  # 0, or where a load left it
        loss = evaluate(self.tr, first, cfg.eval_iters)
        self.tr.consumed_valid_samples += cfg.eval_iters * cfg.global_batch_size
        if self.log and loss is not None:
            line = validation_line(where, loss)
            print("-" * len(line), line, "-" * len(line), sep="\n", flush=True)
        return loss

    def after_iteration(self, iteration: int) -> dict:
        """Validate at every --eval-interval and after --train-iters (both at the last iteration
        when it is a multiple of the interval, as Megatron-LM). Collective on every rank."""
        if not self.enabled:
            return {}
        rec = {}
        cfg = self.tr.cfg
        if iteration % cfg.eval_interval == 0:
            loss = self._run(f"iteration {iteration}")
            rec.update(valid_lm_loss=loss, valid_lm_ppl=_ppl(loss))
        if iteration == cfg.train_iters:
            loss = self._run(f"iteration {iteration} on validation set")
            rec.update(end_valid_lm_loss=loss, end_valid_lm_ppl=_ppl(loss))
        return rec


def _ppl(loss: float | None) -> float | None:
    return None if loss is None else math.exp(min(20.0, loss))
