"""Rank function for the saved-bytes budget of the Oases schedule."""
from __future__ import annotations


def oases_saved_bytes_after_one_step(argv: list[str]):
    """Bytes the Oases blocks kept for backward in their last forward (one micro-batch)."""
    from megatron_oases.schedules.oases.block import oases_saved_bytes
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser

    tr = setup(build_parser().parse_args(argv))
    train_step(tr, 1)
    return oases_saved_bytes(tr.model)
