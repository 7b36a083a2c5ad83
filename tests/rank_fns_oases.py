"""Rank functions for the Oases schedule tests (importable by the forkserver children)."""
from __future__ import annotations

import os


def train_losses_and_grads(argv: list[str]):
    """Train step by step; return per-iteration losses (last rank) and, on rank 0, the global
    gradients of every iteration and the final parameters."""
    from megatron_oases.parallel.layout import gather_global
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)

    tr = setup(run_config(args))
    losses, grads = [], []
    for it in range(1, args.train_iters + 1):
        out = train_step(tr, it)
        losses.append(out["loss"])
        grads.append(gather_global(tr.model, what="grad"))
    params = gather_global(tr.model, what="param")
    rank = int(os.environ["RANK"])
    return {"losses": losses, "grads": grads if rank == 0 else None,
            "params": params if rank == 0 else None}


def run_training(n: int, argv: list[str], timeout_s: float = 240) -> dict:
    """``train_losses_and_grads`` on ``n`` ranks: losses (last rank) and gradients (rank 0)."""
    from megatron_oases.runtime.spawn import run_on_ranks

    out = run_on_ranks(train_losses_and_grads, n, args=(argv,), timeout_s=timeout_s)
    return {"losses": out[-1]["losses"], "grads": out[0]["grads"]}


_CACHE: dict = {}


def cached_training(n: int, argv: list[str]) -> dict:
    """``run_training`` once per (ranks, argv) in this test process (stock references)."""
    key = (n, tuple(argv))
    if key not in _CACHE:
        _CACHE[key] = run_training(n, argv)
    return _CACHE[key]


def count_recompute_collectives(argv: list[str]):
    """One training step under a CommCounter: collectives by tag ("" forward/backward,
    "recompute") on this rank."""
    from megatron_oases.parallel.collectives import CommCounter
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)
    tr = setup(run_config(args))
    with CommCounter() as counter:
        train_step(tr, 1)
    tags = {}
    for r in counter.records:
        tags[r.tag] = tags.get(r.tag, 0) + 1
    return tags


def megatron_tape_steps():
    """(step kind, name) of the tape of one stock local-spec TransformerLayer (one rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from megatron_oases.runtime import init_distributed, init_runtime
    from megatron_oases.schedules.oases.tape import megatron_layer_tape

    init_distributed(init_runtime("cpu"), timeout_s=60)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               use_cpu_initialization=True)
    layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)
    return [(type(s).__name__, s.name) for s in megatron_layer_tape(layer, 0).steps]


def oases_state_at(argv: list[str]):
    """(Oases blocks in the model?, Megatron recompute granularity) after ``train.setup``."""
    from megatron_oases.schedules.oases.block import OasesBlockMixin
    from megatron_oases.run_config import run_config
    from megatron_oases.train import run
    from megatron_oases.train_args import build_parser

    tr, records = run(run_config(build_parser().parse_args(argv + ["--train-iters", "1"])))
    blocks = any(isinstance(m, OasesBlockMixin) for chunk in tr.model for m in chunk.modules())
    return blocks, tr.config.recompute_granularity


def _one_step_records(argv: list[str]):
    """The ``CommCounter`` records of one training step of the trainer built from ``argv``."""
    from megatron_oases.parallel.collectives import CommCounter
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser

    tr = setup(run_config(build_parser().parse_args(argv)))
    with CommCounter() as counter:
        train_step(tr, 1)
    return counter.records


def _calls_and_sizes(records, key) -> dict:
    out: dict = {}
    for r in records:
        calls, sizes = out.get(key(r), (0, set()))
        out[key(r)] = (calls + 1, sizes | {r.payload_bytes})
    return out


def collectives_by_tag_and_kind(argv: list[str]):
    """One training step under a CommCounter: ``{(tag, kind): (calls, payload sizes)}`` of the
    collectives the Oases executor issued on this rank (tag "" forward/backward, "recompute")."""
    return _calls_and_sizes(_one_step_records(argv), lambda r: (r.tag, r.kind))


def all_collectives_of_one_step(argv: list[str]):
    """Every collective of one training step on this rank, ours and Megatron's own (embedding,
    loss, linears, gradients): ``{(kind, group size): (calls, payload sizes)}``."""
    from megatron_oases.parallel.collectives import watch_torch_distributed
    from tests.rank_fns_contract import _rebind_megatron_collectives

    watch_torch_distributed()
    _rebind_megatron_collectives()
    return _calls_and_sizes(_one_step_records(argv), lambda r: (r.kind, r.group_size))


def main_grad_writes(argv: list[str], in_gemm: bool = True):
    """One training step: ``{op: calls}`` of the ``add_`` and ``addmm_`` kernels that write the
    ``main_grad`` of a linear weight (the layers' and the output layer's), on this rank.
    ``in_gemm=False``: the executor without ``wgrad.accumulate_in_gemm`` (as before it)."""
    import collections
    import contextlib

    if not in_gemm:
        from megatron_oases.schedules.oases import wgrad

        wgrad.accumulate_in_gemm = lambda linears, weights: contextlib.nullcontext()

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser

    tr = setup(run_config(build_parser().parse_args(argv)))
    grads = {p.main_grad.data_ptr() for chunk in tr.model for n, p in chunk.named_parameters()
             if p.dim() == 2 and hasattr(p, "main_grad") and ("layers." in n or "output_layer" in n)}
    ops = {torch.ops.aten.add_.Tensor: "add_", torch.ops.aten.addmm_.default: "addmm_"}
    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in ops and args[0].data_ptr() in grads:
                counts[ops[func]] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        train_step(tr, 1)
    return dict(counts), len(grads)


def oases_heads(argv: list[str]):
    """(pipeline rank, [each model chunk's Oases block ``oases_head``: (entry, exit)])."""
    from megatron.core import parallel_state as ps

    from megatron_oases.run_config import run_config
    from megatron_oases.schedules.oases.block import OasesBlockMixin
    from megatron_oases.train import setup
    from megatron_oases.train_args import build_parser

    tr = setup(run_config(build_parser().parse_args(argv)))
    heads = [m.oases_head for chunk in tr.model for m in chunk.modules() if isinstance(m, OasesBlockMixin)]
    return ps.get_pipeline_model_parallel_rank(), heads
