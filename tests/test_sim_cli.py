"""``megatron-oases sim`` with Megatron's flag names, ``--nodes``, ``--global-batch-size`` and the
vocabulary padded as Megatron pads it (issue 23's CLI items)."""
from __future__ import annotations

import pytest

from megatron_oases.pricing.device_model import SimError
from megatron_oases.sim.frontends.cli import build_parser, model_from_args, sim_main, strategy_from_args
from megatron_oases.topology import TopologyError, load_topology

MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
         "--seq-length", "512", "--micro-batch-size", "2"]


def _strategy(*flags, world=None):
    return strategy_from_args(build_parser().parse_args([*MODEL, *flags]), world)


def test_megatron_names_equal_the_short_ones():
    long = _strategy("--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                     "--data-parallel-size", "2")
    assert long == _strategy("--tp", "4", "--pp", "2", "--dp", "2")
    assert (long.tp, long.pp, long.dp) == (4, 2, 2)


def test_data_parallel_fills_the_topology_and_global_batch_sets_micro_batches():
    s = _strategy("--tensor-model-parallel-size", "4", "--global-batch-size", "32", world=16)
    assert (s.dp, s.num_microbatches) == (4, 4)  # 16 / 4 ranks; 32 / (2 x 4)
    assert _strategy("--tp", "4", world=16).num_microbatches == 1
    with pytest.raises(Exception, match="not a multiple"):
        _strategy("--tp", "4", "--global-batch-size", "12", world=16)
    with pytest.raises(Exception, match="disagrees"):
        _strategy("--tp", "4", "--global-batch-size", "32", "--num-microbatches", "2", world=16)


def test_virtual_pipeline_stage_flag():
    s = _strategy("--pp", "2", "--num-layers-per-virtual-pipeline-stage", "2", "--num-microbatches", "4")
    assert s.virtual_stages == 2  # 8 layers / PP 2 / 2 per chunk
    with pytest.raises(Exception, match="must divide"):
        _strategy("--pp", "2", "--num-layers-per-virtual-pipeline-stage", "3")


def test_vocabulary_padded_as_megatron_pads():
    a = build_parser().parse_args([*MODEL, "--vocab-size", "50257"])
    assert model_from_args(a, tp=8).padded_vocab_size == 51200  # a multiple of 128 x 8
    assert model_from_args(a, tp=1).padded_vocab_size == 50304  # a multiple of 128


def test_nodes_replicate_the_node():
    topo = load_topology("2node-ib").with_nodes(384)
    assert topo.world_size == 3072 and topo.ranks_per_node == 8 and topo.num_nodes == 384
    with pytest.raises(TopologyError, match="inter_node"):
        load_topology("dgx-a100").with_nodes(2)


def test_cli_runs_at_3072_gpus_with_megatron_flags(capsys):
    rc = sim_main(["--topology", "2node-ib", "--nodes", "384", "--num-layers", "96", "--hidden-size",
                   "12288", "--num-attention-heads", "96", "--seq-length", "2048",
                   "--micro-batch-size", "1", "--tensor-model-parallel-size", "8",
                   "--pipeline-model-parallel-size", "16", "--global-batch-size", "1536",
                   "--vocab-size", "50257"])
    out = capsys.readouterr().out
    assert rc == 0 and "TP 8 x PP 16 x DP 24 = 3072 GPUs" in out and "64 micro-batches" in out


def test_bad_nodes_is_one_line(capsys):
    assert sim_main(["--topology", "dgx-a100", "--nodes", "2", *MODEL, "--tp", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nodes" in err[0]


@pytest.mark.parametrize("flags, needle", [
    (["--tp", "2", "--gpus", "32"], "--gpus applies to --search only"),
    (["--tp", "2", "--tp-sizes", "1,2"], "--tp-sizes applies to --search only"),
    (["--tp", "2", "--csv", "x.csv"], "--csv applies to --search only"),
    (["--tp", "2", "--atp-mesh", "1,2"], "--atp-mesh needs --tp-backend atp"),
    (["--tp", "2", "--no-oases-fine-grained-recompute"], "--no-oases-fine-grained-recompute chooses how Oases"),
    (["--tp", "2", "--schedule", "oases", "--no-oases-fine-grained-recompute"], "and full recompute"),
    (["--tp", "2", "--num-microbatches", "1", "--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    (["--tp", "2", "--num-microbatches", "1", "--fp16", "--dtype", "fp32"], "--fp16 and --dtype fp32 contradict"),
    (["--tp", "2", "--recompute", "--recompute-layers", "2"], "contradict each other"),
    (["--search", "--global-batch-size", "16", "--tp", "2"],
     "--tensor-model-parallel-size names one strategy, which --search enumerates"),
    (["--search", "--global-batch-size", "16", "--schedule", "oases"], "--schedule names one strategy"),
    (["--search", "--global-batch-size", "16", "--trace", "t.json"], "--trace names one strategy"),
    (["--predict", "--profile", "p.json", "--tp", "2", "--", "--num-layers", "2"],
     "--tensor-model-parallel-size has no effect with --predict"),
    (["--predict", "--profile", "p.json", "--gpu", "h100-sxm", "--", "--num-layers", "2"],
     "--gpu has no effect with --predict"),
], ids=["gpus", "tp-sizes", "csv", "atp-mesh", "fine-grained", "fine-grained-no-recompute",
        "bf16-and-fp16", "fp16-and-dtype", "recompute-both",
        "search-tp", "search-overlap", "search-trace", "predict-tp", "predict-gpu"])
def test_a_flag_the_mode_ignores_is_refused(flags, needle, capsys):
    """Each flag either acts in the chosen mode (one strategy, --search, --predict) or is one error
    line naming it, before anything is simulated."""
    own, rest = (flags[:flags.index("--")], flags[flags.index("--"):]) if "--" in flags else (flags, [])
    model = [] if "--predict" in own else MODEL
    assert sim_main(["--topology", "2node-ib", *model, *own, *rest]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize("flags, needle", [
    (["--tp", "0"], "--tensor-model-parallel-size must be >= 1 (got 0)"),
    (["--pp", "0"], "--pipeline-model-parallel-size must be >= 1 (got 0)"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1 (got 0)"),
    (["--num-microbatches", "0"], "--num-microbatches must be >= 1 (got 0)"),
    (["--memory-gb", "-1"], "--memory-gb must be > 0 (got -1.0)"),
    (["--sequence-parallel", "--num-microbatches", "1"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--tp", "16", "--seq-length", "520", "--sequence-parallel"], "--sequence-parallel splits --seq-length 520"),
    (["--attention-backend", "flash", "--dtype", "fp32", "--num-microbatches", "1"],
     "--attention-backend flash has no fp32 kernel; add --dtype"),
    (["--search", "--global-batch-size", "16", "--schedules", "foo"],
     "--schedules: 'foo' is not one of default, oases"),
    (["--search", "--global-batch-size", "16", "--backends", "foo"], "--backends: 'foo' is not one of"),
    (["--search", "--global-batch-size", "16", "--recompute-options", "foo"], "--recompute-options: 'foo' is not one of off, full, selective; on = full"),
    (["--search", "--global-batch-size", "16", "--gpus", "0"], "--gpus must be >= 1 (got 0)"),
    (["--search", "--global-batch-size", "16", "--top", "-1"], "--top must be >= 0 (got -1)"),
    (["--search", "--global-batch-size", "16", "--memory-gb", "-1"], "--memory-gb must be > 0"),
    (["--search", "--global-batch-size", "16", "--sequence-parallel-options", "off,maybe"],
     "--sequence-parallel-options"),
], ids=["tp-0", "pp-0", "global-batch-0", "microbatches-0", "memory-negative", "sp-at-tp-1", "sp-seq-length",
        "flash-fp32", "search-overlaps", "search-backends", "search-recompute", "search-gpus-0",
        "search-top-negative", "search-memory-negative", "search-sp"])
def test_a_bad_value_is_one_line_naming_the_flag(flags, needle, capsys):
    """A number no run can have, a name the search does not know, sequence parallelism at TP 1 or
    the flash kernel in fp32: one error line naming the flag, exit 2, before anything is
    simulated (not a traceback, a fallback, or a table of infeasible rows)."""
    assert sim_main(["--topology", "2node-ib", *MODEL, "--jobs", "1", *flags]
                    if "--search" in flags else ["--topology", "2node-ib", *MODEL, *flags]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and not captured.out, (err, captured.out)


@pytest.mark.parametrize("abbreviation", [["--overlap-grad"], ["--attention-back", "flash"], ["--tensor", "2"]])
def test_flags_are_not_abbreviated(abbreviation, capsys):
    """As Megatron-LM (allow_abbrev=False): a prefix of a flag is no flag."""
    with pytest.raises(SystemExit) as exc:
        sim_main(["--topology", "2node-ib", *MODEL, *abbreviation])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"unrecognized arguments: {abbreviation[0]}" in err
    assert err.count("\n") == 1 and err.startswith("megatron-oases sim: error: ")  # no usage block


def test_a_megatron_lm_flag_the_simulator_does_not_know_is_one_line(capsys):
    """A Megatron-LM flag ``sim`` has no model of (here the fused cross-entropy) is one error line,
    not argparse's usage block first."""
    with pytest.raises(SystemExit) as exc:
        sim_main(["--topology", "2node-ib", *MODEL, "--tp", "2", "--cross-entropy-loss-fusion"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err == "megatron-oases sim: error: unrecognized arguments: --cross-entropy-loss-fusion\n"


@pytest.mark.parametrize("flags", [["--attention-backend", "flash", "--bf16"], ["--use-flash-attn"],
                                   ["--transformer-impl", "transformer_engine"], ["--no-masked-softmax-fusion"],
                                   ["--use-distributed-optimizer"], ["--virtual-stages", "1,2"]])
def test_search_takes_the_flags_it_applies_to_every_candidate(flags, capsys):
    """The core attention, the software stack and the DP / pipeline options hold for every
    strategy a search ranks: accepted with --search (they change its prices)."""
    assert sim_main(["--search", "--topology", "2node-ib", *MODEL, "--global-batch-size", "32", "--jobs", "1",
                     "--top", "1", *flags]) == 0, capsys.readouterr().err


def test_predict_writes_the_trace_it_is_asked_for(tmp_path, capsys):
    """``--trace`` acts under --predict too (it was ignored)."""
    from megatron_oases.pricing.device_model import ProfileDB
    from megatron_oases.sim.core.events import build_stage_events, unique_events
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser as train_parser

    train = ["--nproc-per-node", "1", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--device", "cpu"]
    from megatron_oases.sim.calibrate.profiler import resolve_topology

    model, s = sim_inputs_from_train_args(train_parser().parse_args(train), 1)
    topo = resolve_topology("local", 1)
    db = tmp_path / "p.json"
    ProfileDB(device="cpu", events_ms={k: 1.0 for k in unique_events(build_stage_events(model, s, topo))}).save(str(db))
    trace = tmp_path / "t.json"
    assert sim_main(["--predict", "--topology", "local", "--profile", str(db), "--trace", str(trace), "--", *train]) == 0
    assert trace.exists() and f"trace: {trace}" in capsys.readouterr().out


def test_predict_takes_the_world_size_from_the_topology(tmp_path, capsys):
    """No --nproc-per-node among the trainer flags: the topology's 4 ranks give TP 2 x DP 2."""
    from megatron_oases.pricing.device_model import ProfileDB
    from megatron_oases.sim.core.events import build_stage_events, unique_events
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser as train_parser

    train = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--device", "cpu"]
    topo = load_topology("emu-flat4")
    model, s = sim_inputs_from_train_args(train_parser().parse_args(train), topo.world_size)
    assert (s.tp, s.dp, s.num_microbatches) == (2, 2, 2)
    db = tmp_path / "p.json"
    ProfileDB(device="cpu", events_ms={k: 1.0 for k in unique_events(build_stage_events(model, s, topo))}).save(str(db))
    assert sim_main(["--predict", "--topology", "emu-flat4", "--profile", str(db), "--", *train]) == 0
    assert "TP 2 x PP 1 x DP 2 = 4 GPUs" in capsys.readouterr().out


def test_predict_maps_rope_and_qk_norm_into_the_variant():
    from megatron_oases.describe.ops import LayerVariant
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser as train_parser

    args = train_parser().parse_args(["--nproc-per-node", "1", "--swiglu", "--qk-layernorm", "--device", "cpu",
                                      "--position-embedding-type", "rope", "--rotary-percent", "0.5"])
    model, _ = sim_inputs_from_train_args(args)
    assert model.variant == LayerVariant(gated=True, rotary=True, rotary_percent=0.5, qk_norm=True)


def test_sim_prices_llama_variants_from_flags(capsys):
    """GQA shrinks QKV (fewer FLOPs), SwiGLU adds a third MLP matrix (more)."""
    base = ["--topology", "dgx-a100", *MODEL, "--tp", "8", "--num-attention-heads", "32",
            "--hidden-size", "4096", "--ffn-hidden-size", "11008",
            "--seq-length", "2048"]  # per-rank work above the host's per-event floor
    times = {}
    for name, extra in (("gpt", []), ("gqa", ["--group-query-attention", "--num-query-groups", "8"]),
                        ("swiglu", ["--swiglu"]),
                        ("rope+qk-norm", ["--position-embedding-type", "rope", "--rotary-base", "500000",
                                          "--qk-layernorm"])):
        assert sim_main(base + extra) == 0
        out = capsys.readouterr().out
        times[name] = float(out.split("iteration ")[1].split(" ms")[0])
    assert times["gqa"] < times["gpt"] < times["swiglu"]
    assert times["gpt"] < times["rope+qk-norm"]  # their element-wise work on queries and keys
    assert sim_main(base + ["--num-query-groups", "8"]) == 2
    assert "--num-query-groups needs --group-query-attention" in capsys.readouterr().err
    assert sim_main(base + ["--rotary-percent", "0.5"]) == 2
    assert "apply to --position-embedding-type rope only" in capsys.readouterr().err


def test_fp16_gradients_reduce_in_fp16_unless_accumulated_in_fp32():
    """Megatron-LM reduces data-parallel gradients in the parameters' fp16 by default and in fp32
    under bf16 or --accumulate-allreduce-grads-in-fp32: the DP all-reduce's bytes follow."""
    from megatron_oases.sim.frontends.cli import build_parser, simulation_inputs
    from megatron_oases.sim.core.events import build_stage_events

    base = ["--topology", "dgx-a100", "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "128", "--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
            "--data-parallel-size", "4", "--global-batch-size", "8"]

    def grad_bytes(*flags):
        model, strategy, dm = simulation_inputs(build_parser().parse_args([*base, *flags]))
        stage = build_stage_events(model, strategy, dm.topology)[0]
        return stage.grad_allreduce.nbytes, model.grad_reduce_bytes

    fp16, fp16_acc, bf16 = (grad_bytes("--dtype", "fp16"),
                            grad_bytes("--dtype", "fp16", "--accumulate-allreduce-grads-in-fp32"),
                            grad_bytes("--dtype", "bf16"))
    assert fp16[1] == 2 and fp16_acc[1] == bf16[1] == 4
    assert 2 * fp16[0] == fp16_acc[0] == bf16[0]
    bf16_reduced = grad_bytes("--dtype", "bf16", "--grad-reduce-in-bf16")  # Megatron-LM's flag
    assert bf16_reduced[1] == 2 and 2 * bf16_reduced[0] == bf16[0]
    for wrong, says in ((["--dtype", "fp16", "--grad-reduce-in-bf16"], "applies to --dtype bf16"),
                        (["--dtype", "bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"],
                         "contradict")):
        with pytest.raises(SimError, match=says):
            grad_bytes(*wrong)


def test_jobs_below_one_is_refused_at_parse_time(capsys):
    """``--jobs 0`` is refused in one line naming the flag, before any search (argparse's type
    error printed the usage block first)."""
    assert sim_main(["--topology", "dgx-a100", *MODEL, "--search", "--gpus", "8", "--jobs", "0"]) == 2
    assert capsys.readouterr().err == "error: --jobs must be >= 1 (got 0)\n"


def test_megatron_recompute_flags():
    """Megatron's recompute flags, their short forms, and Megatron-LM's --recompute-activations."""
    full = _strategy("--recompute-granularity", "full", "--recompute-method", "uniform")
    assert full == _strategy("--recompute") and full.recompute and full.recompute_layers == 0
    block = _strategy("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2")
    assert block == _strategy("--recompute-layers", "2") and block.recompute_layers == 2
    # block without --recompute-num-layers: every layer of the stage, as the trainer fills it
    assert _strategy("--recompute-granularity", "full", "--recompute-method", "block") == full
    sel = _strategy("--recompute-granularity", "selective")
    assert sel == _strategy("--recompute-activations") and sel.selective_recompute and not sel.recompute
    assert sel.label.endswith(".sel")
    for bad, needle in ((["--recompute-granularity", "full"], "needs --recompute-method"),
                        (["--recompute-method", "block"], "need --recompute-granularity full"),
                        (["--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "2"], "not modeled"),
                        (["--recompute", "--recompute-granularity", "selective"], "not both"),
                        (["--recompute-activations", "--recompute-granularity", "full"], "give one"),
                        (["--recompute-granularity", "selective", "--schedule", "oases"], "stock schedule"),
                        (["--recompute-granularity", "selective", "--tp-backend", "3d", "--tp", "8"], "megatron")):
        with pytest.raises(Exception, match=needle):
            _strategy(*bad)


def test_selective_recompute_reruns_the_core_attention_only(capsys):
    """Selective recompute costs the core attention's forward once more per layer: slower than no
    recompute, faster than full; it keeps no s^2 tensor, so less memory than none, more than full."""
    base = ["--topology", "dgx-a100-hdr8", "--nodes", "1", *MODEL, "--tp", "8", "--global-batch-size", "8",
            "--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
    from megatron_oases.sim.frontends.cli import simulation_inputs
    from megatron_oases.sim.core.timeline import simulate

    runs = {}
    for name, flags in (("none", []), ("selective", ["--recompute-granularity", "selective"]),
                        ("full", ["--recompute"])):
        model, strategy, dm = simulation_inputs(build_parser().parse_args([*base, *flags]))
        runs[name] = simulate(model, strategy, dm)
    none, sel, full = runs["none"], runs["selective"], runs["full"]
    assert none.iteration_ms < sel.iteration_ms < full.iteration_ms
    assert full.peak_memory_GB < sel.peak_memory_GB < none.peak_memory_GB
    assert sim_main([*base, "--recompute-granularity", "selective"]) == 0
    assert "recompute selective" in capsys.readouterr().out


@pytest.mark.parametrize("flags, needle", [
    (["--overlap", "oases"], "--overlap is now --schedule default|oases"),
    (["--search", "--overlaps", "none,oases"], "--overlaps is now --schedules default,oases"),
    (["--distributed-optimizer"], "--distributed-optimizer is now --use-distributed-optimizer"),
    (["--no-fine-grained-recompute"], "--no-fine-grained-recompute is now --no-oases-fine-grained-recompute"),
])
def test_the_executors_old_flag_names_are_refused_naming_the_new_ones(flags, needle, capsys):
    """``--schedule`` is the TP executor in every front end (the trainer's name), the distributed
    optimizer ``--use-distributed-optimizer`` (Megatron-LM's); ``sim``'s old names say the new
    one in one line instead of silently aliasing."""
    from megatron_oases.sim.frontends.cli import sim_main

    with pytest.raises(SystemExit) as e:
        sim_main(["--topology", "dgx-a100", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and needle in err[0]
