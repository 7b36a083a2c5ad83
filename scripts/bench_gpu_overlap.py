"""The one-GPU overlap benchmark (issue 34, item 4): stock Megatron and the Oases executor as rank 0
of a TP-t model, every TP collective replaced by a stand-in of priced duration on a side stream
(sleep, copy, channels and nccl kernels), against compute alone, communication switched off
(comm-disabled) and the stand-ins alone. Benchmark only.

    python scripts/bench_gpu_overlap.py --tp 2 --out overlap.json -- \\
        --device cuda --bf16 --num-layers 4 --hidden-size 4096 --num-attention-heads 32 \\
        --seq-length 4096 --micro-batch-size 2

Flags before ``--`` are the benchmark's (``--help``), the rest the reference trainer's.
See benchmarks/standin/ and docs/gpu.md.
"""
import sys

from benchmarks.standin.measure import main  # (imports no Megatron)

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--" in argv:  # benchmark flags, then the trainer's
        i = argv.index("--")
        argv = argv[:i] + argv[i + 1:]
    sys.exit(main(argv))
