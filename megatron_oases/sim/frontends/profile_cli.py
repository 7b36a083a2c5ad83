"""``megatron-oases profile``: measure the simulator's events on this machine into a ProfileDB.

    megatron-oases profile --out p.json --nproc 2 <model> --tp 2 --pp 1 --dp 1 ...      one strategy
    megatron-oases profile --out p.json --nproc 4 --search --global-batch-size G <model>  a search's events
    megatron-oases profile --out p.json -- <megatron-oases train flags>                 a trainer run's events
    megatron-oases profile --out p.json --emulate --topology T.yaml -- <train flags>    ... on its emulated cluster

Compute events run on the local device; collectives and P2P on ``--nproc`` local ranks, taken as
ranks 0..nproc-1 of ``--topology`` (default: one flat level named "local" of --nproc ranks, or
--gpus for --search). ``sim --profile p.json`` then prices from it with the same topology.
"""
from __future__ import annotations

import argparse
import os
import sys

from ...errors import ConfigError
from ...flags import add_flag
from ...output_paths import check_output_file
from ...topology import TopologyError, load_topology
from .cli import SimParser, _largest_tp, _set_flags, _split, add_model_args, add_search_args, add_strategy_args, \
    check_numbers, check_search_scope, model_from_args, search_space_from_args, strategy_from_args, \
    trainer_run_flags
from ..calibrate.profiler import resolve_topology
from ...pricing.device_model import ProfileDB, SimError


def build_parser() -> argparse.ArgumentParser:
    p = SimParser(prog="megatron-oases profile", description=__doc__.splitlines()[0],
                  allow_abbrev=False,  # as Megatron-LM: a flag is spelled out
                  formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--out", required=True, help="ProfileDB JSON to write")
    p.add_argument("--merge", action="store_true", help="keep the entries --out already has; measure only new ones")
    add_flag(p, "topology", note="the cluster the ranks at hand belong to (default: local)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    g = p.add_argument_group("ranks (the ranks at hand; --emulate starts the run's own)")
    g.add_argument("--nproc", type=int, default=None, help="ranks at hand (default: 2, or the trainer's world size)")
    add_flag(g, "device", note="with -- <train flags>, the trainer's --device")
    g.add_argument("--threads", type=int, default=None, help="torch threads for compute events")
    g.add_argument("--max-comm-mb", type=float, default=256.0, help="larger payloads are timed at this size and scaled")
    g = p.add_argument_group("emulate (--emulate)")
    g.add_argument("--emulate", action="store_true",
                   help="with -- <train flags>: profile on the run's own emulated cluster (--topology or the "
                        "trainer's; needs root): its ranks, links and CPU contention (sim.calibrate.emulated_profile)")
    g.add_argument("--nice", type=int, default=0, help="with --emulate: nice value of the profiling ranks")
    g.add_argument("--repeats", type=int, default=1,
                   help="with --emulate: profile this many times and keep every time's median over them "
                        "(ProfileDB.median_of): one profile's outliers do not reach the prediction")
    add_model_args(p)
    add_strategy_args(p)
    add_search_args(p)
    return p


def check_flag_scope(p: argparse.ArgumentParser, a: argparse.Namespace, train_argv: list[str]) -> None:
    """Refuse a flag the chosen mode would ignore, in one line naming it (as ``sim``'s
    ``check_flag_scope``): with ``-- <train flags>`` the run is the trainer's, so the model,
    strategy and search flags; ``--emulate`` (the trainer run's own ranks) the ranks-at-hand
    flags; ``--nice`` / ``--repeats`` without ``--emulate``; ``--jobs`` always (no search is
    simulated here); then ``sim``'s search / one-strategy scope. Numbers out of range first."""
    check_numbers(p, a)
    if a.jobs is not None:
        raise SimError("--jobs has no effect on profile, which lists a search's events and simulates none; drop it")
    if a.emulate and not train_argv:
        raise SimError("--emulate profiles a trainer run on its emulated cluster: give the trainer's flags after "
                       "`--`, or drop --emulate")
    if not a.emulate:
        given = _set_flags(p, a, "emulate", skip=frozenset({"emulate"}))
        if given:
            raise SimError(f"{given[0]} applies to --emulate only; drop it or add --emulate -- <train flags>")
    if train_argv:
        given = trainer_run_flags(p, a)
        if given:
            raise SimError(f"{given[0]} has no effect with `-- <train flags>`; drop it (the run profiled is what "
                           f"the trainer flags after `--` say)")
        given = _set_flags(p, a, "ranks") if a.emulate else []
        if given:
            raise SimError(f"{given[0]} has no effect with --emulate, which runs one profiling rank per trainer "
                           f"rank on the emulated cluster; drop it")
        return
    check_search_scope(p, a)


def profile_main(argv: list[str] | None = None) -> int:
    own, train_argv = _split(list(sys.argv[1:] if argv is None else argv))
    p = build_parser()
    a = p.parse_args(own)
    try:
        from ..calibrate.profiler import ProfileSettings, needed_events, profile_missing

        check_flag_scope(p, a, train_argv)
        check_output_file("--out", a.out)
        existing = ProfileDB.load(a.out) if a.merge and os.path.exists(a.out) else None
        common = dict(device=a.device, warmup=a.warmup, reps=a.reps, threads=a.threads,
                      max_comm_bytes=int(a.max_comm_mb * (1 << 20)))
        if train_argv:
            from ...train_args import build_parser as train_parser
            from .predict import profile_train_args, sim_inputs_from_train_args

            targs = train_parser().parse_args(train_argv)
            if a.emulate:
                from ..calibrate.emulated_profile import profile_emulated
                from ..core.events import build_stage_events, overlapped_keys, unique_events

                topo_name = a.topology or targs.topology
                if not topo_name:
                    raise SimError("--emulate needs --topology (or the trainer's --topology)")
                topo = load_topology(topo_name)
                model, strategy = sim_inputs_from_train_args(targs, topo.world_size)
                stages = build_stage_events(model, strategy, topo)
                events = unique_events(stages)
                if existing is not None:
                    events = {k: e for k, e in events.items() if k not in existing.events_ms}
                db = ProfileDB.median_of([profile_emulated(events, topo, strategy, warmup=a.warmup, reps=a.reps,
                                                           nice=a.nice, overlap=overlapped_keys(stages) & set(events))
                                          for _ in range(a.repeats)])
                db = existing.merged(db) if existing is not None else db
                db.save(a.out)
                print(f"{len(db.events_ms)} events measured on the emulated {topo.name} "
                      f"({len(db.contention)} with contention levels {db.meta.get('busy_levels')}, "
                      f"{len(db.overlapped)} also overlapped): {a.out}")
                return 0
            db = profile_train_args(targs, topology=a.topology, existing=existing, nproc=a.nproc, **common)
        else:
            nproc = a.nproc or 2
            named = load_topology(a.topology) if a.topology not in (None, "local") else None
            if a.search:
                gpus = a.gpus or (named.world_size if named else nproc)
                topo = resolve_topology(a.topology, gpus)
                model = model_from_args(a, _largest_tp(a, topo))  # as `sim --search` pads it
                from ..core.search import candidates

                strategies = [c.strategy for c in candidates(model, search_space_from_args(a, model, gpus))
                              if c.strategy is not None]
            else:
                strategy = strategy_from_args(a, named.world_size if named else None)
                model = model_from_args(a, strategy.tp)
                topo = resolve_topology(a.topology, strategy.world_size)
                strategies = [strategy]
            events = {}
            for s in strategies:
                try:
                    events.update(needed_events(model, [s], topo))
                except SimError:
                    if not a.search:
                        raise  # a search keeps going: that strategy is infeasible anyway
            db = profile_missing(events, topo, ProfileSettings(nproc=nproc, **common), existing)
        db.save(a.out)
    except (SimError, TopologyError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n_meas = sum(v == "measured" for v in db.sources.values())
    print(f"{len(db.events_ms)} events ({n_meas} measured, {len(db.events_ms) - n_meas} scaled or extrapolated) "
          f"on {db.device}: {a.out}")
    return 0
