"""The core attention a run uses reaches the profiler, the event keys, the time model and the
planner (``describe.core_attention``): a profile of a fused-attention (SDPA) run is timed on SDPA
and keyed apart from Megatron's local attention, whose keys (old profiles) keep their meaning."""
from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch

from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
from megatron_oases.pricing.device_model import ProfileDB, SimError
from megatron_oases.sim.core.events import build_stage_events, unique_events
from megatron_oases.sim.calibrate.profiler import local_topology
from megatron_oases.describe.atp_2d import atp_layout

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--nproc-per-node", "1", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--device", "cpu"]
ATTENTION_EVENTS = ("attention", "attention.bwd", "attention.core")


def _run(backend: str, *extra: str):
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(TINY + ["--attention-backend", backend, *extra])
    model, strategy = sim_inputs_from_train_args(args)
    return args, model, unique_events(build_stage_events(model, strategy, local_topology(strategy.world_size)))


def test_event_keys_name_a_non_local_kind_and_keep_local_keys():
    _, local_model, local = _run("local")
    assert local_model.core_attention == "local" and not any("attn" in k for k in local)
    assert all("attn" not in dict(e.dims) for e in local.values())
    # local keys are the ones profiles had before the kind was named (GPTShape's default kind)
    default = dataclasses.replace(local_model, core_attention="local")
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser

    _, s = sim_inputs_from_train_args(build_parser().parse_args(TINY + ["--attention-backend", "local"]))
    assert set(unique_events(build_stage_events(default, s, local_topology(1)))) == set(local)
    layers = {}
    for backend, suffix in (("auto", "_fusedattn]"), ("flash", "_fusedattn_flash]"), ("fused", "_fusedattn_fused]")):
        _, model, events = _run(backend)
        assert model.core_attention == "fused" and model.attention_kernels == backend
        layer = {k for k, e in events.items() if k.startswith("compute:attention")}
        assert layer and all(k.endswith(suffix) and dict(events[k].dims)["attn"] == "fused" for k in layer)
        assert all(dict(events[k].dims).get("sdpa", "auto") == backend for k in layer)
        assert not layer & set(local)
        layers[backend] = layer
    # flash-only and cuDNN / efficient kernels take other times than torch's choice: never one key
    assert not (layers["auto"] & layers["flash"] or layers["auto"] & layers["fused"] or layers["flash"] & layers["fused"])
    _, _, unfused = _run("unfused")
    assert any(k.endswith("_unfusedattn]") for k in unfused)


class _Spy:
    """Counts calls of torch's SDPA and of Megatron's DotProductAttention while installed."""

    def __init__(self, monkeypatch):
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        self.sdpa = self.local = 0
        sdpa, local = torch.nn.functional.scaled_dot_product_attention, DotProductAttention.forward

        def counted_sdpa(*a, **k):
            self.sdpa += 1
            return sdpa(*a, **k)

        def counted_local(*a, **k):
            self.local += 1
            return local(*a, **k)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
        monkeypatch.setattr(DotProductAttention, "forward", counted_local)


@pytest.mark.parametrize("backend,schedule", [("auto", []), ("local", []), ("auto", ["--schedule", "oases"]),
                                              ("unfused", [])])
def test_profiler_runs_the_run_s_core_attention(monkeypatch, backend, schedule):
    """Every event holding the core attention runs the module the trainer builds for the run's
    ``--attention-backend`` (SDPA under auto / unfused, Megatron's DotProductAttention under local),
    the Oases executor's sub-batch steps included; checked by which module ran, not by time."""
    from megatron_oases.sim.calibrate.layer_workloads import single_rank_world
    from megatron_oases.sim.calibrate.workloads import compute_workload

    extra = ["--tensor-model-parallel-size", "2", "--nproc-per-node", "2", *schedule] if schedule else \
        ["--recompute-granularity", "selective"]
    _, _, events = _run(backend, *extra)
    mine = [e for e in events.values() if e.kind == "compute" and e.name in ATTENTION_EVENTS]
    assert {e.name for e in mine} == ({"attention", "attention.bwd"} if schedule else set(ATTENTION_EVENTS))
    spy = _Spy(monkeypatch)
    with single_rank_world():
        for e in mine:
            before = (spy.sdpa, spy.local)
            compute_workload(e.name, dict(e.dims), torch.device("cpu"))()
            ran = (spy.sdpa - before[0], spy.local - before[1])
            assert (ran[0] > 0, ran[1] > 0) == ((False, True) if backend == "local" else (True, False)), e.key


@pytest.mark.parametrize("backend", ["auto", "flash", "fused"])
def test_profiler_builds_the_run_s_sdpa_kernels(monkeypatch, backend):
    """A fused-attention event is timed on the kernels its run restricts SDPA to: the layer the
    profiler builds is the class ``--attention-backend backend`` builds in the trainer
    (``layers.core_attention.core_attention_class``), and the synthetic cores enter the same
    kernel context."""
    from megatron_oases.layers import core_attention as ca
    from megatron_oases.sim.calibrate.layer_workloads import core_attention_backend
    from megatron_oases.sim.calibrate.workloads import compute_workload

    _, _, events = _run(backend)
    layer = [e for e in events.values() if e.kind == "compute" and e.name == "attention"]
    assert layer and all(core_attention_backend(dict(e.dims)) == backend for e in layer)
    seen = []
    real = ca.backend_kernel_context
    monkeypatch.setattr(ca, "backend_kernel_context", lambda b, d: seen.append(b) or real(b, d))
    dims = {"b": 2, "s": 16, "h": 32, "a": 4, "f": 128, "t": 2, "d1": 2, "d2": 1, "v": 128, "dtype": "fp32",
            **{k: v for k, v in layer[0].dims if k in ("attn", "sdpa")}}
    dims_3d = {**dims, "t": 8, "d1": 8}  # the cube's core (p = 2)
    compute_workload("atp.core", dims, torch.device("cpu"))()
    compute_workload("3d.core", dims_3d, torch.device("cpu"))()
    assert seen == [backend, backend]


def test_synthetic_cores_follow_the_kind(monkeypatch):
    """ATP's and the cube's synthetic core attention run SDPA for a fused kind, as their real
    layers do (``layers.core_attention``), and Megatron's unfused core for local."""
    from megatron_oases.sim.calibrate.workloads import compute_workload

    spy = _Spy(monkeypatch)
    dims = {"b": 2, "s": 16, "h": 32, "a": 4, "f": 128, "t": 2, "d1": 2, "d2": 1, "v": 128, "dtype": "fp32"}
    for name in ("atp.core", "atp.core.bwd"):
        compute_workload(name, dims, torch.device("cpu"))()
        assert spy.sdpa == 0
        compute_workload(name, {**dims, "attn": "fused"}, torch.device("cpu"))()
        assert spy.sdpa > 0
        spy.sdpa = 0


def test_a_profile_lacking_the_kind_s_events_is_refused():
    """The simulator's prediction needs every event (``predict_train_step``): a local-attention
    profile cannot price a fused-attention run; it still prices its own run."""
    from megatron_oases.sim.frontends.predict import predict_train_step

    local_args, _, local = _run("local")
    auto_args, _, fused = _run("auto")
    db = ProfileDB(device="cpu", events_ms={k: 1.0 for k in local})
    assert predict_train_step(local_args, db).iteration_ms > 0
    missing = sorted(set(fused) - set(local))
    assert missing and all("attn]" in k for k in missing)
    with pytest.raises(SimError, match=f"lacks {len(missing)} event"):
        predict_train_step(auto_args, db)


def test_an_old_profile_prices_the_local_attention_run_it_measured():
    """examples/gpu/h200-2026-11-26 (profiled before the kind was named, local attention): the
    run with ``--attention-backend local`` finds every event; the same flags under ``auto`` (the
    trainer's default now) are refused rather than priced from local-attention timings."""
    from megatron_oases.sim.frontends.predict import predict_train_step
    from megatron_oases.train_args import build_parser

    path = ROOT / "examples/gpu/h200-2026-11-26/sim_small_prof-default.json"
    assert json.loads(path.read_text())["format"] == "megatron-oases-profile/2"
    db = ProfileDB.load(path)
    argv = ["--nproc-per-node", "1", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "512", "--vocab-size", "32000", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--bf16", "--device", "cpu"]
    assert predict_train_step(build_parser().parse_args(argv + ["--attention-backend", "local"]), db).iteration_ms > 0
    with pytest.raises(SimError, match="_fusedattn"):
        predict_train_step(build_parser().parse_args(argv + ["--attention-backend", "auto"]), db)


@pytest.mark.parametrize("dropout", [False, True])
def test_attention_kernel_count_follows_the_kind(dropout):
    """Local attention: 12 forward kernels in the attention segment (its core: scores GEMM,
    softmax, dropout, context GEMM, transpose copy); a fused kernel does the core in one and
    writes the context in place: 8 (on CUDA with dropout too); SDPA's math kernel as local.
    Selective recompute reruns 4 kernels of the local core, 1 fused one."""
    def layer(kind):
        return megatron_1d_gpt_layer(micro_batch=2, seq=64, hidden=128, heads=4, ffn=512, tp=2,
                                     bytes_per_element=2, attention_dropout=dropout, core_attention=kind,
                                     recompute_core_attention=True)
    for kind, fwd, core in (("local", 12, 4), ("unfused", 12, 4), ("fused", 8, 1)):
        desc = layer(kind)
        ops = {o.name: o for o in desc.forward + desc.backward}
        assert (ops["attention"].kernels, ops["attention.bwd"].kernels, ops["attention.core"].kernels) == \
            (fwd, 2 * fwd, core), kind
        assert ops["mlp"].kernels == 5
        # the same work: FLOPs and bytes do not depend on the kind (the device model drops the
        # scores' traffic of a fused kernel, DeviceModel.fused_attention)
        assert ops["attention"].attention_flops == layer("local").forward[0].attention_flops


def _plan_model(**kw):
    from megatron_oases.plan.graph import PlanModel

    base = dict(num_layers=1, hidden_size=256, num_attention_heads=8, seq_length=256, micro_batch_size=4,
                tp=8, recompute=False, sub_batches=1)
    return PlanModel(**{**base, **kw})


@pytest.mark.parametrize("kind", ["local", "fused"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("family,degree,mesh", [("megatron", 2, None), ("atp", 4, atp_layout(2, 2)), ("3d", 8, None)])
def test_plan_memory_matches_the_simulator(kind, dropout, family, degree, mesh):
    """A block's saved bytes (no recompute, stock executor) sum to the layer's bytes the
    simulator keeps (``sim.core.memory.chunk_activation_bytes`` less the head), for each family, with
    the run's core attention and dropout (no dropout mask priced at dropout 0)."""
    from megatron_oases.plan.graph import BlockStrategy, family_of
    from megatron_oases.sim.core import memory as sim_memory
    from megatron_oases.sim.core.strategy import Strategy

    m = _plan_model(core_attention=kind, hidden_dropout=dropout, attention_dropout=dropout)
    strategy = BlockStrategy(degree=degree, family=family, layout=mesh) if mesh else \
        BlockStrategy(degree=degree, family=family)
    fam = family_of(strategy)
    plan = sum(fam.memory(strategy, m, k, m.micro_batch_size)[0] for k in ("attention", "mlp"))
    sim_model = m  # a PlanModel is the simulator's GPTShape
    s = Strategy(tp=degree, backend=family, layout=mesh)
    chunk = types.SimpleNamespace(layers=1, chunk=0, stage=0)
    per_mb, _ = sim_memory.chunk_activation_bytes(sim_model, s, chunk)
    assert plan == pytest.approx(per_mb - sim_memory._head_bytes(sim_model, s, chunk), rel=1e-9)
    if kind == "fused":
        local = sum(fam.memory(strategy, dataclasses.replace(m, core_attention="local"), k, 4)[0]
                    for k in ("attention", "mlp"))
        assert plan < local


def test_plan_files_and_flags_carry_the_attention_backend(tmp_path):
    from megatron_oases.plan.model import model_from_mapping
    from megatron_oases.plan.plan_cli import build_parser, model_from_args

    m = _plan_model(core_attention="fused")
    assert m.to_dict()["attention_backend"] == "auto"  # the flag value that maps back to it
    assert model_from_mapping(m.to_dict()) == m
    for kernels in ("flash", "fused"):
        mk = _plan_model(core_attention="fused", attention_kernels=kernels)
        assert mk.to_dict()["attention_backend"] == kernels and model_from_mapping(mk.to_dict()) == mk
    old = {k: v for k, v in m.to_dict().items() if k != "attention_backend"}
    assert model_from_mapping(old).core_attention == "local"  # plan files written before it
    flags = ["--num-layers", "1", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
             "--micro-batch-size", "4", "--tp", "8", "--topology", "x", "--global-batch-size", "8", "--bf16"]
    for backend, kind, kernels in (("auto", "fused", "auto"), ("flash", "fused", "flash"),
                                   ("fused", "fused", "fused"), ("unfused", "unfused", "auto"),
                                   ("local", "local", "auto")):
        a = build_parser().parse_args(flags + ["--attention-backend", backend])
        assert (model_from_args(a).core_attention, model_from_args(a).attention_kernels) == (kind, kernels)
    # not given: the trainer's default (what the plan's runtime runs); a --model file's own
    # attention_backend is kept unless the flag overrides it
    from megatron_oases.run_config import DEFAULTS
    from megatron_oases.describe.core_attention import core_attention_of
    assert model_from_args(build_parser().parse_args(flags)).core_attention == core_attention_of(
        attention_backend=DEFAULTS.attention_backend) == "fused"
    path = tmp_path / "model.yaml"
    path.write_text("attention_backend: local\n")
    assert model_from_args(build_parser().parse_args(flags + ["--model", str(path)])).core_attention == "local"
    a = build_parser().parse_args(flags + ["--model", str(path), "--attention-backend", "auto"])
    assert model_from_args(a).core_attention == "fused"
