"""The rest of our package a CPU rank imports, preloaded once in ``run_on_ranks``' forkserver.

The suite forks a few thousand CPU ranks from the launcher's forkserver, which imports
``spawn._PRELOAD`` once (torch, Megatron-Core and the trainer's entry modules). A rank that
builds and trains a model then still imports the modules below (layers, the Oases executor, the
3-D cube, groups, data, the saved-bytes ledger): about 0.06 s of CPU in every rank on 2 cores
(``tests/test_saved_bytes_budget.py``, 121 two-rank spawns: 65-79 s without, 50-59 s with them).

Only our own modules: importing them loads no further Megatron-Core module, so the Megatron
modules that get the CPU layer's proxy (``runtime.cpu_compat``: those loaded when it is
installed) are the ones they are in a launch (``tests/test_runtime.py`` checks both, and that
no CUDA context is made). A candidate for ``spawn._PRELOAD`` itself, which would speed up
``megatron-oases train --nproc-per-node`` the same way.
"""
from __future__ import annotations

RANK_PRELOAD = [
    "megatron_oases.data", "megatron_oases.datasets", "megatron_oases.exit_flags",
    "megatron_oases.describe.optimizer", "megatron_oases.describe.moe_oases",
    "megatron_oases.layers.atp_spec", "megatron_oases.layers.atp_attention",
    "megatron_oases.layers.atp_linear", "megatron_oases.layers.atp_mlp", "megatron_oases.layers.atp_norm",
    "megatron_oases.layers.gated_rows", "megatron_oases.layers.qkv_heads", "megatron_oases.layers.torch_norm",
    "megatron_oases.layers.planned_layer", "megatron_oases.layers.tp3d_spec",
    "megatron_oases.layers.tp3d_attention", "megatron_oases.layers.tp3d_mlp", "megatron_oases.layers.linear3d",
    "megatron_oases.layers.core_attention", "megatron_oases.layers.sharded_dropout",
    "megatron_oases.parallel.layout", "megatron_oases.parallel.degree_groups", "megatron_oases.parallel.cube",
    "megatron_oases.parallel.collectives_uneven", "megatron_oases.plan.plan_file",
    "megatron_oases.runtime.cpu_compat", "megatron_oases.runtime.cpu_moe_compat",
    "megatron_oases.runtime.cuda_env", "megatron_oases.runtime.exit_signal", "megatron_oases.runtime.saved_tensors",
    "megatron_oases.schedules.oases.executor", "megatron_oases.schedules.oases.block",
    "megatron_oases.schedules.oases.moe_tape", "megatron_oases.schedules.oases.head_tape",
]


def extend_forkserver_preload() -> None:
    """Add ``RANK_PRELOAD`` to the launcher's preload list (read when its forkserver starts, at
    the first ``run_on_ranks`` of a pytest process)."""
    from megatron_oases.runtime import spawn

    spawn._PRELOAD.extend(m for m in RANK_PRELOAD if m not in spawn._PRELOAD)
