"""Benchmark only, never a training default: the one-GPU overlap benchmark (issue 34, item 4).

NCCL refuses two ranks on one GPU, so one process runs as rank 0 of a TP-t group on torch's fake
process group (``fake_world``): its layers compute exactly rank 0's shard of a TP-t model. Every
TP collective is then replaced by a stand-in of priced duration with NCCL's stream semantics
(``standins``), and ``measure`` times stock Megatron and the Oases executor with stand-ins, compute
alone, with communication switched off and the stand-ins alone (``scripts/bench_gpu_overlap.py``;
docs/gpu.md); ``summary`` lists runs as one record per stand-in kind.
"""
