"""The element type a pricing tool prices: the one rule ``sim`` and ``plan`` read their precision
flags by.

A launch states its precision with Megatron-LM's ``--bf16`` / ``--fp16`` (the flag table's), which
both tools take, so the launch's own command line prices its own precision; each tool also takes
``--dtype`` for a run not written as a launch (``--fp32``, which Megatron-LM lacks, is refused by
every front end: ``flags.py``). With none of them they
price fp32, as the trainer, ``mesh`` and Megatron-LM run a launch without ``--bf16`` / ``--fp16``:
one command line means one precision in every tool (``sim --predict`` and ``--atp-mesh auto``
read the trainer's config, so they price what it trains).
"""
from __future__ import annotations

import argparse

PRECISION_FLAGS = ("bf16", "fp16")
"""The switches that name an element type (Megatron-LM's)."""

UNSTATED = "fp32"
"""The element type of a run that names none: Megatron-LM's (``--bf16`` / ``--fp16`` absent)."""


def priced_dtype(a: argparse.Namespace, error: type[Exception]) -> str:
    """``a``'s element type: the one of ``--bf16`` / ``--fp16`` / ``--dtype`` given,
    else fp32 (``UNSTATED``). Two switches, or a switch and another ``--dtype``, are refused with
    ``error`` (the caller's one-line class)."""
    given = [name for name in PRECISION_FLAGS if getattr(a, name, False)]
    if len(given) > 1:
        raise error(f"--{given[0]} and --{given[1]} are exclusive; pick one")
    dtype = getattr(a, "dtype", None)
    if given and dtype is not None and dtype != given[0]:
        raise error(f"--{given[0]} and --dtype {dtype} contradict each other; give one")
    return given[0] if given else dtype or UNSTATED
