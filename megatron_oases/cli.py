"""``megatron-oases <command>``: one entry point for the trainer and the tools around it."""
from __future__ import annotations

import sys

COMMANDS = {
    "train": ("megatron_oases.train", "main", "reference GPT trainer on Megatron-Core (the stock baseline)"),
    "mesh": ("megatron_oases.plan.mesh_cli", "mesh_main",
             "pick ATP's 2-D device mesh for a TP group on a topology (hierarchical comm matrix)"),
    "plan": ("megatron_oases.plan.plan_cli", "plan_main",
             "Oases planner: a TP degree per block under a memory budget (Eq. 5-6), plan JSON, launch flags"),
    "sim": ("megatron_oases.sim.frontends.cli", "sim_main",
            "simulate one training iteration (DP x TP x PP, 1F1B/GPipe, Oases overlap): summary, trace"),
    "profile": ("megatron_oases.sim.frontends.profile_cli", "profile_main",
                "measure the simulator's events on this machine (compute + collectives) into a profile JSON"),
    "emulate": ("megatron_oases.topology.emulate", "emulate_main",
                "run a command on an emulated cluster (network namespaces + tc) from a topology YAML"),
}


def _usage() -> str:
    lines = ["usage: megatron-oases <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "megatron-oases <command> --help shows a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv:  # no command: the usage on stderr, exit 2 (as argparse does for a missing argument)
        print(f"megatron-oases: error: a command is required\n\n{_usage()}", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"megatron-oases: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    import importlib

    try:
        rc = int(getattr(importlib.import_module(module_name), func_name)(rest) or 0)
        sys.stdout.flush()  # the last buffered write fails here, inside the try, not at exit
        return rc
    except BrokenPipeError:
        # the reader went away (``megatron-oases sim ... | head``): stop quietly, as Python's docs
        # advise, instead of a traceback; stdout goes to devnull so the exit flush cannot fail again
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
