"""The runtime layer: CPU compatibility shims for Megatron-Core and the rank launcher."""
from __future__ import annotations

import os
import time

import pytest

from megatron_oases.runtime import detect_runtime
from megatron_oases.runtime.spawn import RankFailure
from tests import rank_fns


def test_detect_runtime_cpu_is_gloo():
    rt = detect_runtime("cpu")
    assert rt.backend == "gloo" and not rt.is_cuda
    # Streams and events are no-ops on CPU, with the same interface as CUDA's.
    s = rt.stream()
    s.wait_stream(rt.stream())
    e = rt.event()
    e.record()
    e.synchronize()
    with rt.use_stream(s):
        pass


def test_detect_runtime_rejects_unknown_device():
    with pytest.raises(ValueError, match="--device"):
        detect_runtime("tpu")


def test_dropout_mask_same_in_forward_and_recompute(on_ranks):
    out = on_ranks(rank_fns.dropout_forward_vs_recompute, 1)[0]
    assert out["same_out"] and out["same_grad"]
    assert 0.3 < out["zero_fraction"] < 0.7  # dropout really dropped


def test_global_memory_buffer_lives_on_cpu(on_ranks):
    assert on_ranks(rank_fns.global_memory_buffer_on_cpu, 1) == ["cpu"]


def test_launcher_returns_per_rank_results(on_ranks):
    assert on_ranks(rank_fns.env_rank, 3) == [(0, 3), (1, 3), (2, 3)]


def test_launcher_surfaces_rank_traceback(on_ranks):
    with pytest.raises(RankFailure, match="(?s)rank 1 traceback.*boom on rank one"):
        on_ranks(rank_fns.raise_on_rank_one, 2)


def test_launcher_fails_fast_on_hang(on_ranks):
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0\] did not finish within 5 s"):
        on_ranks(rank_fns.hang_on_rank_zero, 2, timeout_s=5)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("world", [2, 3])
def test_collective_pairs_and_counter(on_ranks, world):
    out = on_ranks(rank_fns.collectives_pairs, world)
    for rank_checks in out:
        assert all(v for k, v in rank_checks.items() if k not in ("kinds", "ag_payload")), rank_checks
        assert rank_checks["kinds"] == ["all_gather", "all_reduce", "reduce_scatter"]
        assert rank_checks["ag_payload"] == 4 * world * 6 * 4  # fp32 bytes of the gathered tensor


def test_optional_packages_are_lazy_and_named_in_errors():
    from megatron_oases.runtime import optional

    assert isinstance(optional.HAVE_APEX, bool) and isinstance(optional.HAVE_TE, bool)
    if not optional.HAVE_TE:
        with pytest.raises(ImportError, match="--transformer-impl transformer_engine needs transformer_engine"):
            optional.require("te", "--transformer-impl transformer_engine")


def test_upstream_signatures_the_cpu_layer_replaces_are_unchanged():
    """The CPU layer swaps three Megatron-Core functions; fail loudly if upstream changes them."""
    import inspect

    from megatron.core.optimizer import optimizer
    from megatron.core.tensor_parallel import random

    def params(fn):
        return list(inspect.signature(fn).parameters)

    assert params(random._get_cuda_rng_state) == ["device", "clone", "graph_safe"]
    assert params(random._set_cuda_rng_state) == ["new_state", "device", "graph_safe"]
    assert params(optimizer.clip_grad_by_total_norm_fp32) == [
        "parameters", "max_norm", "total_norm", "use_decoupled_grad"]


@pytest.mark.parametrize("env, visible, want", [
    ({"LOCAL_RANK": "3", "SLURM_LOCALID": "1"}, 4, (3, "LOCAL_RANK=3")),  # torchrun
    ({"SLURM_LOCALID": "5"}, 8, (5, "SLURM_LOCALID=5")),  # plain srun, all GPUs visible
    ({"SLURM_LOCALID": "5"}, 1, (0, "SLURM_LOCALID=5 mod 1")),  # srun --gpus-per-task=1
    ({}, 8, (0, "neither")),
])
def test_cuda_device_from_launcher_environment(env, visible, want, monkeypatch):
    """srun sets no LOCAL_RANK: every rank landed on cuda:0 (or an invalid index)."""
    import torch

    from megatron_oases.runtime.device import detect_runtime

    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    rt = detect_runtime("cuda")
    assert (rt.device.index, rt.backend) == (want[0], "nccl")
    assert want[1] in rt.chosen_by


def test_launcher_refuses_more_cuda_ranks_than_visible_gpus(monkeypatch, capsys):
    """``--nproc-per-node 4`` on 2 visible GPUs gave ranks 2 and 3 the GPUs of ranks 0 and 1
    (``LOCAL_RANK mod visible``), which NCCL refuses ("Duplicate GPU detected") only after every
    rank has started; now one error line before any rank starts."""
    import torch

    from megatron_oases import train
    from megatron_oases.runtime import spawn

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    started = []
    # a launch returns each rank's result: None, no rank stopped on a NaN (train._spawned_rank)
    monkeypatch.setattr(spawn, "run_on_ranks", lambda *a, **k: started.append(a) or [None] * a[1])
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128",
             "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1",
             "--device", "cuda"]
    assert train.main(flags + ["--nproc-per-node", "4"]) == 2
    err = capsys.readouterr().err
    assert "--nproc-per-node 4" in err and "2 are visible" in err and "--device cpu" in err
    assert not started
    assert train.main(flags + ["--nproc-per-node", "2"]) == 0  # one GPU each: it launches
    assert len(started) == 1



@pytest.mark.parametrize("bound, types, want", [
    (None, ("cuda",), "cuda"),  # nccl world, no device_id (Megatron-LM's init_process_group)
    ("cuda:0", ("cuda",), "cuda"),  # nccl world bound to its device (our trainer)
    (None, ("cuda", "cpu"), "cpu"),  # gloo world (CPU runs)
])
def test_world_timeout_reads_a_backend_the_world_group_has(bound, types, want, monkeypatch):
    """An ``nccl`` world group has only a CUDA backend; asking it for the CPU one (what an
    unbound group used to get) raises, so every ATP / 3-D / plan group creation failed."""
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_oases.runtime.device import world_timeout

    class Backend:
        options = type("Options", (), {"_timeout": datetime.timedelta(seconds=42)})()

    class World:
        bound_device_id = None if bound is None else torch.device(bound)
        _device_types = [torch.device(t) for t in types]

        def _get_backend(self, device):
            if device.type not in types:
                raise RuntimeError(f"No backend type associated with device type {device.type}")
            assert device.type == want
            return Backend()

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", World)
    assert world_timeout() == datetime.timedelta(seconds=42)


_PRELOAD_PROBE = """
import importlib, torch
calls = []
torch.cuda._lazy_init = torch.cuda.init = lambda: calls.append(1)
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 8
torch.cuda.is_initialized = lambda: False
import sys
from megatron_oases.runtime.spawn import _PRELOAD
for name in _PRELOAD + ["megatron_oases.train", "megatron_oases.specs",
                        "megatron_oases.schedules.oases.executor"]:
    importlib.import_module(name)
before = set(sys.modules)
from tests.rank_preload import RANK_PRELOAD
for name in RANK_PRELOAD:
    importlib.import_module(name)
print("cuda initialisations:", len(calls))
print("other modules of the suite's preloads:", sorted(m for m in set(sys.modules) - before
                                                       if not m.startswith(("megatron_oases", "tests"))))
"""


def test_forkserver_preloads_do_not_initialise_cuda():
    """The launcher's forkserver imports _PRELOAD once and forks every rank from it: a CUDA
    context made there would be inherited by the forks ("Cannot re-initialize CUDA in forked
    subprocess"). With CUDA reported present, importing them must not initialise it. The suite's
    own preloads (tests/rank_preload.py) load none either, and no module beyond our package: the
    Megatron modules the CPU layer proxies stay those of a launch."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PRELOAD_PROBE], capture_output=True, text=True,
                         timeout=180, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cuda initialisations: 0" in out.stdout
    assert "other modules of the suite's preloads: []" in out.stdout, out.stdout


def test_ranks_start_in_fresh_interpreters_where_cuda_is_present(monkeypatch):
    """With CUDA present the launcher spawns each rank (a forkserver's preloads leave it unsafe
    to fork, seen on an H200); without, ranks fork from the preloaded forkserver. The spawned
    path must run the same rank functions."""
    import torch

    from megatron_oases.runtime import spawn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert spawn.start_method() == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert spawn.start_method() == "forkserver"
    monkeypatch.setattr(spawn, "start_method", lambda: "spawn")
    assert spawn.run_on_ranks(rank_fns.env_rank, 2, timeout_s=120) == [(0, 2), (1, 2)]


def test_upstream_optimizer_type_checks_the_cpu_layer_answers_are_unchanged():
    """``cuda_type_names`` answers ``param.type()`` inside two Megatron optimizer constructors
    (Megatron-Core 0.16). Fail loudly if upstream changes where the parameters come from or how
    it checks them (then the shim must follow, or can go)."""
    import inspect

    from megatron.core.optimizer import distrib_optimizer, optimizer

    from megatron_oases.runtime.cpu_compat import CUDA_TYPE_CHECKING_INITS

    assert CUDA_TYPE_CHECKING_INITS == (
        ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"))
    fp16 = inspect.unwrap(optimizer.Float16OptimizerWithFloat16Params.__init__)
    dist = inspect.unwrap(distrib_optimizer.DistributedOptimizer.__init__)
    assert list(inspect.signature(fp16).parameters) == [
        "self", "optimizer", "config", "grad_scaler", "init_state_fn"]
    assert list(inspect.signature(dist).parameters)[:2] == ["self", "optimizer"]
    assert "model_chunks" in inspect.signature(dist).parameters
    checks = "param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']"
    assert checks in inspect.getsource(fp16) and checks in inspect.getsource(dist)
    assert "param.type() == 'torch.cuda.FloatTensor'" in inspect.getsource(fp16)
    # The distributed optimizer's other check sits in a helper that only its __init__ calls.
    build = distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups
    assert "model_param.type() == 'torch.cuda.FloatTensor'" in inspect.getsource(build)
    source = inspect.getsource(distrib_optimizer)
    assert source.count("_build_model_and_main_param_groups(") == 2  # its def and one call
    assert "self._build_model_and_main_param_groups(" in inspect.getsource(dist)


def test_cuda_type_names_is_scoped_to_the_given_tensors():
    import torch

    from megatron_oases.runtime.cpu_compat import cuda_type_names

    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    q, other = torch.zeros(3), torch.zeros(3, dtype=torch.float16)
    with cuda_type_names([p, q]):
        assert (p.type(), q.type()) == ("torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor")
        assert other.type() == "torch.HalfTensor"  # not in the list: untouched
        assert p.type(torch.float32).dtype == torch.float32  # a conversion is the real one
        assert p.type("torch.DoubleTensor").dtype == torch.float64
    assert (p.type(), q.type()) == ("torch.BFloat16Tensor", "torch.FloatTensor")
    assert "type" not in p.__dict__ and "type" not in q.__dict__
    try:
        with cuda_type_names([p]):
            raise KeyError("inside")
    except KeyError:
        pass
    assert p.type() == "torch.BFloat16Tensor" and "type" not in p.__dict__
