"""Rank function for the saved-bytes budget of the Oases schedule."""
from __future__ import annotations


def oases_saved_bytes_after_one_step(argv: list[str]):
    """Bytes the Oases blocks kept for backward in their last forward (one micro-batch)."""
    from megatron_oases.schedules.oases.block import oases_saved_bytes
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser

    tr = setup(run_config(build_parser().parse_args(argv)))
    train_step(tr, 1)
    return oases_saved_bytes(tr.model)


def saved_bytes_of_one_forward(argv: list[str]) -> int:
    """Bytes one micro-batch's forward keeps for its backward on this rank (single stage):
    autograd's live saved storages plus the Oases executor's step state, parameters excluded."""

    from megatron_oases.runtime.saved_tensors import SavedTensorLedger
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup
    from megatron_oases.train_args import build_parser

    tr = setup(run_config(build_parser().parse_args(argv)))
    model = tr.model[0]
    model.train()
    batch = tr.data.train_batches(1)[0]
    params = [p for m in tr.model for p in m.parameters()]
    with SavedTensorLedger() as ledger:
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    kept = ledger.kept_bytes(out, params)
    out.float().mean().backward()  # release the graph (and run the Oases backward once)
    return kept


def saved_bytes_of_forwards(argvs: list[list[str]]) -> list[int]:
    """``saved_bytes_of_one_forward`` of each argv in turn, in one spawned group."""
    from tests.rank_turns import each_in_turn

    return each_in_turn(saved_bytes_of_one_forward, argvs)
