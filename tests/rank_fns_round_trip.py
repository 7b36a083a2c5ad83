"""Rank function of the round-trip contract (``tests/test_round_trip.py``): build each command
line's model with the trainer's own ``train.setup`` and read, on this rank, what one micro-batch
through its model chunk really does."""
from __future__ import annotations

import os

from tests.rank_turns import each_in_turn


def chunk_readings(argv: list[str]) -> dict:
    """One micro-batch's forward and backward through this rank's model chunk (stage): the
    collectives issued per pass (``CommCounter``: kind, group size, payload bytes), the bytes the
    forward keeps for backward (``SavedTensorLedger``: autograd's saved storages and the Oases
    executor's step state, parameters excluded), the parameters of each decoder layer and of
    the whole chunk.
    A later pipeline stage takes a random hidden state as its input (``set_input_tensor``)."""
    import torch

    from megatron_oases.parallel.collectives import CommCounter
    from megatron_oases.parallel.layout import _unwrap
    from megatron_oases.run_config import run_config
    from megatron_oases.runtime.saved_tensors import SavedTensorLedger
    from megatron_oases.train import setup
    from megatron_oases.train_args import build_parser

    tr = setup(run_config(build_parser().parse_args(argv)))
    model = tr.model[0]
    gpt = _unwrap(model)
    model.train()
    batch = tr.data.train_batches(1)[0]
    cfg = gpt.config
    if not gpt.pre_process:  # a later stage: Megatron's replicated [s, b, h] (s / t under SP)
        seq = batch["tokens"].shape[1]
        seq //= cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
        gpt.set_input_tensor(torch.randn(seq, batch["tokens"].shape[0], cfg.hidden_size, requires_grad=True))
    params = [p for m in tr.model for p in m.parameters()]
    labels = batch["labels"] if gpt.post_process else None
    with CommCounter() as fwd, SavedTensorLedger() as ledger:
        out = model(batch["tokens"], batch["position_ids"], None, labels=labels)
    kept = ledger.kept_bytes(out, params)
    with CommCounter() as bwd:
        out.float().mean().backward()
    rows = lambda c: sorted((r.kind, r.group_size, r.payload_bytes) for r in c.records  # noqa: E731
                            if r.group_size > 1)  # a one-rank group issues nothing
    layers = [sum(p.numel() for p in layer.parameters()) for layer in gpt.decoder.layers]
    return {"forward": rows(fwd), "backward": rows(bwd), "saved": kept, "layer_params": layers,
            "params": sum(p.numel() for p in params), "rank": int(os.environ["RANK"])}


def readings_of(argvs: list[list[str]]) -> list[dict]:
    """``chunk_readings`` of each command line in turn, in one spawned group (spawning ranks costs
    more than these tiny models), each on process groups of its own (``rank_turns.each_in_turn``)."""
    from tests.rank_fns_contract import _rebind_megatron_collectives
    from megatron_oases.parallel.collectives import watch_torch_distributed

    watch_torch_distributed()  # Megatron's own all-gathers / reduce-scatters (sequence parallelism)
    _rebind_megatron_collectives()
    return each_in_turn(chunk_readings, argvs)


