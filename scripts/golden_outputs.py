"""The simulator's, planner's and mesh picker's outputs for a fixed set of configurations.

A refactor must not change what the tools print: ``tests/test_outputs_unchanged.py`` runs these
commands and compares their stdout byte for byte with ``tests/data/golden_outputs.json``, written
by ``python scripts/golden_outputs.py --write`` before the refactor. Lines that report how long
the tool itself took are dropped (they are the only output that varies between runs)."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden_outputs.json"
MODELS = ROOT / "examples" / "models"
TWELVE = str(ROOT / "tests" / "data" / "twelve-a100.yaml")

GPT = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
       "--micro-batch-size", "4", "--vocab-size", "50257"]
LLAMA = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
         "--micro-batch-size", "2", "--vocab-size", "32000", "--swiglu", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "4", "--ffn-hidden-size", "5632"]

COMMANDS: dict[str, list[str]] = {
    "sim-megatron-tp4-pp2": ["sim", "--topology", "dgx-a100", *GPT, "--tensor-model-parallel-size", "4",
                             "--pipeline-model-parallel-size", "2", "--num-microbatches", "8"],
    "sim-oases-tp8-recompute": ["sim", "--topology", "oases-3090-8node", *GPT, "--tensor-model-parallel-size", "8",
                                "--schedule", "oases", "--recompute", "--num-microbatches", "4"],
    "sim-atp-2x2": ["sim", "--topology", "pcie-ic1", *GPT, "--tensor-model-parallel-size", "4",
                    "--gpu", "rtx-3090", "--tp-backend", "atp", "--atp-mesh", "2,2", "--num-microbatches", "4"],
    "sim-atp-oases-2x4": ["sim", "--topology", "dgx-a100", *GPT, "--tensor-model-parallel-size", "8",
                          "--tp-backend", "atp", "--atp-mesh", "2,4", "--schedule", "oases"],
    "sim-3d-cube8": ["sim", "--topology", "longhorn-v100", *GPT, "--tensor-model-parallel-size", "8",
                     "--tp-backend", "3d"],
    "sim-llama-sp-interleaved": ["sim", "--topology", "dgx-h100-ndr8", "--nodes", "2", *LLAMA,
                                 "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                                 "--num-layers-per-virtual-pipeline-stage", "2", "--data-parallel-size", "2",
                                 "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
                                 "--num-microbatches", "8", "--attention-backend", "flash", "--bf16"],
    "sim-llama-oases-te": ["sim", "--topology", "dgx-a100", *LLAMA, "--tensor-model-parallel-size", "8",
                           "--schedule", "oases", "--transformer-impl", "transformer_engine"],
    "sim-llama-selective": ["sim", "--topology", "dgx-a100", *LLAMA, "--tensor-model-parallel-size", "4",
                            "--data-parallel-size", "2", "--recompute-granularity", "selective",
                            "--use-flash-attn"],
    "sim-oases-odd-microbatch": ["sim", "--topology", "dgx-a100", *GPT[:8], "--micro-batch-size", "3",
                                 "--tensor-model-parallel-size", "8", "--schedule", "oases"],
    "sim-search-16": ["sim", "--topology", "dgx-h100-ndr8", "--nodes", "2", *GPT, "--search", "--gpus", "16",
                      "--global-batch-size", "64", "--top", "8", "--backends", "megatron,atp,3d",
                      "--schedules", "default,oases"],
    "plan-oases-h2048": ["plan", "--model", str(MODELS / "oases-h2048.yaml"), "--topology", "oases-3090-8node",
                         "--global-batch-size", "16", "--tensor-model-parallel-size", "8", "--quiet",
                         "--out", os.devnull, "--schedule", "oases"],
    "plan-families-tp8": ["plan", *GPT, "--topology", "dgx-a100", "--global-batch-size", "32",
                          "--tensor-model-parallel-size", "8", "--families", "megatron,atp,3d", "--schedule", "oases"],
    "plan-atp-tp6": ["plan", *GPT[:2], "--hidden-size", "1536", "--num-attention-heads", "24",
                     "--seq-length", "1024", "--micro-batch-size", "4", "--vocab-size", "50257",
                     "--topology", TWELVE, "--global-batch-size", "16", "--tensor-model-parallel-size", "6",
                     "--families", "atp", "--schedule", "oases"],
    "plan-atp-tp12": ["plan", *GPT[:2], "--hidden-size", "1536", "--num-attention-heads", "24",
                      "--seq-length", "1024", "--micro-batch-size", "4", "--vocab-size", "50257",
                      "--topology", TWELVE, "--global-batch-size", "16", "--tensor-model-parallel-size", "12",
                      "--families", "atp", "--granularity", "layer", "--schedule", "oases"],
    "plan-odd-microbatch": ["plan", *GPT[:8], "--micro-batch-size", "3", "--vocab-size", "50257",
                            "--topology", "dgx-a100", "--global-batch-size", "24", "--tensor-model-parallel-size", "8",
                            "--schedule", "oases"],
    "plan-llama-tp4": ["plan", *LLAMA, "--topology", "dgx-a100", "--global-batch-size", "16",
                       "--tensor-model-parallel-size", "4", "--granularity", "layer", "--sub-batches", "1"],
    "mesh-ic1-tp4": ["mesh", "--topology", "pcie-ic1", "--tp", "4", "--hidden", "2048", "--layers", "8",
                     "--micro-batch-size", "4", "--seq-length", "1024", "--num-attention-heads", "16", "--bf16"],
    "mesh-a100-tp8": ["mesh", "--topology", "dgx-a100", "--tp", "8", "--hidden", "4096", "--layers", "4",
                      "--micro-batch-size", "2", "--seq-length", "2048", "--num-attention-heads", "32", "--bf16"],
}

# sim's defaults are the trainer's (megatron_oases.flags: --attention-backend auto, --global-batch-size 8); the
# commands recorded before that state what they priced then: Megatron's local attention, one micro-batch
PINNED = ("--attention-backend", "local")
ONE_MICROBATCH = ("--num-microbatches", "1")
for _argv in COMMANDS.values():
    if _argv[0] == "sim" and not {"--attention-backend", "--use-flash-attn", "--transformer-impl"} & set(_argv):
        _argv += PINNED
    if _argv[0] == "sim" and not {"--num-microbatches", "--global-batch-size"} & set(_argv):
        _argv += ONE_MICROBATCH

_TIMING = re.compile(r"(\bin \d+(\.\d+)? ?(s|ms)\b|took \d|elapsed|wall|^solver: )", re.I)


def run(argv: list[str]) -> str:
    """The command's stdout and stderr and exit status, with the tool's own timing lines dropped."""
    from megatron_oases.cli import main

    if argv[0] == "plan" and "--out" not in argv:  # no plan.json left in the working directory
        argv = [*argv, "--out", os.devnull]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse errors
            rc = e.code
    text = out.getvalue() + "\n--stderr--\n" + err.getvalue() + f"\n--rc-- {rc}\n"
    return "\n".join(line for line in text.splitlines() if not _TIMING.search(line)) + "\n"


def outputs() -> dict[str, str]:
    return {name: run(argv) for name, argv in COMMANDS.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"write {GOLDEN.relative_to(ROOT)}")
    args = p.parse_args(argv)
    got = outputs()
    if args.write:
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {len(got)} outputs to {GOLDEN}")
        return 0
    want = json.loads(GOLDEN.read_text(encoding="utf-8"))
    bad = [k for k in want if got.get(k) != want[k]]
    print("unchanged" if not bad else f"changed: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
