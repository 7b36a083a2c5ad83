"""Rank functions for tests/test_mixed_precision.py: several trainer runs in one spawned group.

Spawning ranks costs more than training these tiny models, so one spawn trains a list of named
variants one after another in the same process group, each on process groups of its own
(``tests/rank_turns.py``; every run seeds itself, so order does not matter).
"""
from __future__ import annotations

import os


def _param_dtypes(model) -> list[str]:
    """dtypes of the parameters the model computes with (inside Float16Module/DDP)."""
    return sorted({str(p.dtype).replace("torch.", "") for m in model for p in m.parameters()})


def train_variants(variants: list[tuple[str, list[str]]], gather_params: tuple[str, ...] = ()):
    """Train each ``(name, argv)`` in turn. Returns ``{name: record}`` with per-iteration losses
    (last rank), grad norms and update flags, the parameter dtypes, the optimizer classes, and for
    the names in ``gather_params`` the global parameters after the first and the last iteration
    (rank 0; fp32 copies)."""
    from megatron_oases.parallel.layout import gather_global
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser
    from tests.rank_turns import each_in_turn

    rank = int(os.environ["RANK"])

    def variant(named):
        name, argv = named
        args = build_parser().parse_args(argv)
        tr = setup(run_config(args))
        rec = {"losses": [], "norms": [], "ok": [], "dtypes": _param_dtypes(tr.model),
               "optimizers": sorted({type(o).__name__ for o in
                                     getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])})}
        for it in range(1, args.train_iters + 1):
            step = train_step(tr, it)
            rec["losses"].append(step["loss"])
            rec["norms"].append(step["grad_norm"])
            rec["ok"].append(step["update_successful"])
            if name in gather_params and it in (1, args.train_iters):
                params = gather_global(tr.model, what="param")
                rec["params" if it == args.train_iters else "params_first"] = (
                    params if rank == 0 else None)
        return name, rec

    return dict(each_in_turn(variant, variants))
