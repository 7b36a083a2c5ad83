"""Trainer checkpoints (``--save/--save-interval/--load``, torch_dist; megatron_oases/checkpoint.py).

Per layout (stock TP2 x PP2 with dropout, Oases TP2 x DP2, ATP mesh (2, 2), 3-D TP8, per-block
plan): train 6 iterations saving every 3, with one rank killed inside the save of iteration 6
(after its shards, before the rename). The iteration-3 checkpoint must stay the one that loads;
resuming from it must reproduce iterations 4-6 of the killed run (rel <= 1e-6). Then: loading
into another layout, --no-load-rng, and damaged checkpoints refused in one line before any
process group. Across megatron-core releases: the common state is ``common.pt`` up to 0.18 and an
object inside the torch_dist files from 0.19 (the damage tests find it in the files), a 0.16.1
checkpoint (tests/data) resumes on 0.17+, and Megatron's own save runs on CPU ranks. The
distributed optimizer's state resumes at another DP/TP size and backend, and into or from the
plain optimizer (issue 37); its dp_reshardable format is refused elsewhere before start-up.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from megatron_oases.checkpoint import CRASH_ENV, TRACKER
from megatron_oases.runtime.spawn import RankFailure, run_on_ranks
from tests.rank_fns_ckpt import LAYOUTS, MODEL, megatron_save_load, train

pytest.importorskip("psutil", reason="Megatron's torch_dist checkpoint writer needs psutil")

RESUME_TOL = 1e-6  # same layout: the resumed run must be the uninterrupted one
CROSS_TOL = 1e-5  # another layout: same model, other reduction order
TIMEOUT = 150


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _flags(layout: str, tmp_path) -> tuple[int, list[str]]:
    n, flags = LAYOUTS[layout]
    if layout.startswith("plan"):
        plan = tmp_path / "plan.json"  # per-block degrees: attention != MLP in both layers
        plan.write_text(json.dumps({"format": "megatron-oases-plan/1",
                                    "tensor_model_parallel_size": 4, "num_layers": 2,
                                    "degrees": [2, 4, 4, 2]}))
        flags = flags + ["--oases-plan", str(plan)]
    return n, MODEL + flags


def _json_losses(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, f)}


_RUNS: dict = {}


def _killed_then_resumed(layout: str, tmp_path_factory) -> dict:
    """Run A: 6 iterations, --save-interval 3, last rank killed in the save of 6 (losses from
    --log-json). Run B: --load, --train-iters 6. Cached per layout for the tests below."""
    if layout in _RUNS:
        return _RUNS[layout]
    tmp = tmp_path_factory.mktemp(layout)
    n, argv = _flags(layout, tmp)
    ckpt, log = str(tmp / "ckpt"), str(tmp / "a.jsonl")
    # The harness sees the killed rank exit, or a peer sees its connection close, first.
    with pytest.raises(RankFailure, match="exited without a result|Connection (closed|reset) by peer"):
        run_on_ranks(train, n, args=(argv + ["--train-iters", "6", "--save", ckpt,
                                             "--save-interval", "3", "--log-json", log],),
                     timeout_s=TIMEOUT, env={CRASH_ENV: f"{n - 1}:6"})
    a = _json_losses(log)
    entries = sorted(os.listdir(ckpt))
    assert a.keys() == {1, 2, 3, 4, 5, 6}, a
    with open(os.path.join(ckpt, TRACKER), encoding="utf-8") as f:
        tracker_after_crash = f.read()
    b = run_on_ranks(train, n, args=(argv + ["--train-iters", "6", "--load", ckpt, "--save", ckpt,
                                             "--save-interval", "3"],),
                     timeout_s=TIMEOUT)[-1]["losses"]
    _RUNS[layout] = {"n": n, "argv": argv, "ckpt": ckpt, "a": a, "b": b, "entries": entries,
                     "tracker_after_crash": tracker_after_crash}
    return _RUNS[layout]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_killed_save_keeps_previous_and_resume_matches(layout, tmp_path_factory):
    r = _killed_then_resumed(layout, tmp_path_factory)
    # The killed save left only its temporary directory; the latest file still names 3.
    assert r["tracker_after_crash"] == "3"
    assert "iter_0000003" in r["entries"] and "iter_0000006" not in r["entries"], r["entries"]
    assert any(e.startswith("iter_0000006.tmp-") for e in r["entries"]), r["entries"]
    # Resumed at iteration 4 (numbering continues) and reproduces the run that was killed.
    assert sorted(r["b"]) == [4, 5, 6], r["b"]
    diffs = {it: _rel(r["b"][it], r["a"][it]) for it in (4, 5, 6)}
    print(f"{layout}: resume max rel diff {max(diffs.values()):.3g} {diffs}")
    assert max(diffs.values()) <= RESUME_TOL, (layout, diffs, r["a"], r["b"])
    # The resumed run saved iteration 6 again, completely this time.
    with open(os.path.join(r["ckpt"], TRACKER), encoding="utf-8") as f:
        assert f.read() == "6"
    assert os.path.isdir(os.path.join(r["ckpt"], "iter_0000006"))


def _copy_at(src_ckpt: str, iteration: int, dst) -> str:
    """A checkpoint directory holding only ``src_ckpt``'s iteration (latest file names it)."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(src_ckpt, name), dst / name)
    (dst / TRACKER).write_text(str(iteration))
    return str(dst)


def test_rng_state_is_restored(tmp_path_factory, tmp_path):
    """With dropout, --no-load-rng changes iteration 4: the match above needed the RNG states."""
    r = _killed_then_resumed("stock_tp2_pp2", tmp_path_factory)
    ckpt = _copy_at(r["ckpt"], 3, tmp_path)
    got = run_on_ranks(train, r["n"], args=(r["argv"] + ["--train-iters", "4", "--load", ckpt,
                                                         "--no-load-rng"],),
                       timeout_s=TIMEOUT)[-1]["losses"]
    assert _rel(got[4], r["a"][4]) > 1e-4, (got, r["a"])


@pytest.mark.parametrize("src, dst", [
    # other TP size, PP and layer type (per-block degrees -> stock)
    ("plan_tp4", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    # other backend, mesh and TP size (3-D cube TP8 -> ATP DeviceMesh(2, 2) TP4)
    ("3d_tp8", ["--tensor-model-parallel-size", "4", "--tp-backend", "atp", "--atp-mesh", "2,2"]),
], ids=["plan_tp4->stock_tp2_pp2", "3d_tp8->atp_2x2"])
def test_checkpoint_loads_into_another_layout(src, dst, tmp_path_factory, tmp_path):
    """Model and Adam state reshard: iterations 4-6 after loading match the saving run."""
    r = _killed_then_resumed(src, tmp_path_factory)
    ckpt = _copy_at(r["ckpt"], 3, tmp_path)
    got = run_on_ranks(train, 4, args=(MODEL + dst + ["--train-iters", "6", "--load", ckpt],),
                       timeout_s=TIMEOUT)[-1]["losses"]
    diffs = [_rel(got[it], r["a"][it]) for it in (4, 5, 6)]
    print(f"{src} -> {' '.join(dst)}: max rel diff {max(diffs):.3g}")
    assert max(diffs) <= CROSS_TOL, (got, r["a"])


def test_no_load_optim_loads_the_model_only(tmp_path_factory, tmp_path):
    """Into one rank, model only: iteration 4 matches, 5 does not (Adam restarted), so the
    matches above really needed the optimizer state."""
    r = _killed_then_resumed("plan_tp4", tmp_path_factory)
    ckpt = _copy_at(r["ckpt"], 3, tmp_path)
    fresh = run_on_ranks(train, 1, args=(MODEL + ["--train-iters", "5", "--load", ckpt,
                                                  "--no-load-optim"],),
                         timeout_s=TIMEOUT)[-1]["losses"]
    assert _rel(fresh[4], r["a"][4]) <= CROSS_TOL, (fresh, r["a"])
    assert _rel(fresh[5], r["a"][5]) > 1e-3, (fresh, r["a"])


def _main_error(argv, capsys) -> str:
    from megatron_oases.train import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def good_ckpt(tmp_path_factory, tmp_path):
    r = _killed_then_resumed("stock_tp2_pp2", tmp_path_factory)
    return _copy_at(r["ckpt"], 3, tmp_path / "ckpt"), r["argv"]


def _common_state(it: str):
    """Where the checkpoint in ``it`` keeps its common state: ``("file", common.pt)`` (saved by
    megatron-core up to 0.18) or ``("item", shard file, offset, length)`` (the torch_dist
    ``common_state`` object of 0.19 on). Read from the files, so the damage tests below need
    no version check."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_oases.mcore_compat import COMMON_PT, COMMON_STATE_ITEM

    if os.path.isfile(os.path.join(it, COMMON_PT)):
        return ("file", os.path.join(it, COMMON_PT))
    storage = FileSystemReader(it).read_metadata().storage_data
    (info,) = [v for k, v in storage.items() if k.fqn == COMMON_STATE_ITEM]
    return ("item", os.path.join(it, info.relative_path), info.offset, info.length)


def _drop_common_state(it: str) -> None:
    """Delete ``common.pt``, or the ``common_state`` object from ``.metadata``."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    from megatron_oases.mcore_compat import COMMON_STATE_ITEM

    where = _common_state(it)
    if where[0] == "file":
        os.remove(where[1])
        return
    metadata = FileSystemReader(it).read_metadata()
    del metadata.state_dict_metadata[COMMON_STATE_ITEM]
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items()
                             if k.fqn != COMMON_STATE_ITEM}
    with open(os.path.join(it, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def _garble_common_state(it: str) -> str:
    """Overwrite the common state's bytes (same length: every size check still passes); returns
    the file's name."""
    where = _common_state(it)
    with open(where[1], "r+b") as f:
        if where[0] == "file":
            f.truncate(0)
            f.write(b"not a pickle")
        else:
            f.seek(where[2])
            f.write(b"\0" * where[3])
    return os.path.basename(where[1])


@pytest.mark.parametrize("damage, names", [
    ("drop .metadata", ".metadata"), ("garble .metadata", ".metadata"),
    ("drop shard", "last shard"), ("truncate shard", "first shard"),
    ("drop metadata.json", "metadata.json"), ("drop common state", "common.pt"),
    ("garble common state", "its file"),
    ("latest names missing dir", "iter_0000009"), ("garble latest", TRACKER),
])
def test_damaged_checkpoint_is_refused_in_one_line(good_ckpt, damage, names, capsys):
    ckpt, argv = good_ckpt
    it = os.path.join(ckpt, "iter_0000003")
    if names.endswith(" shard"):  # file names differ between releases (writer threads per rank)
        shards = sorted(f for f in os.listdir(it) if f.endswith(".distcp"))
        names = shards[0] if names == "first shard" else shards[-1]
    if damage == "drop common state":
        _drop_common_state(it)
    elif damage == "garble common state":
        names = _garble_common_state(it)
    elif damage.startswith("drop"):
        os.remove(os.path.join(it, names))
    elif damage == "garble .metadata":
        with open(os.path.join(it, names), "wb") as f:
            f.write(b"not a pickle")
    elif damage == "truncate shard":
        os.truncate(os.path.join(it, names), 100)
    elif damage == "latest names missing dir":
        with open(os.path.join(ckpt, TRACKER), "w") as f:
            f.write("9")
    else:
        with open(os.path.join(ckpt, TRACKER), "w") as f:
            f.write("three")
    err = _main_error(argv + ["--nproc-per-node", "4", "--load", ckpt], capsys)
    assert names in err and "--load" in err, err


def test_checkpoint_of_a_newer_megatron_core_is_refused_in_one_line(good_ckpt, capsys):
    """Before 0.19 a checkpoint without ``common.pt`` whose ``.metadata`` names the
    ``common_state`` object was saved by 0.19 or newer: refused, saying to upgrade. (Built here
    from a checkpoint of this release: the item points at bytes that are never read.)"""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from megatron_oases import mcore_compat

    if mcore_compat.common_state_in_torch_dist():
        pytest.skip("this megatron-core (0.19+) reads the common_state object")
    ckpt, argv = good_ckpt
    it = os.path.join(ckpt, "iter_0000003")
    metadata = FileSystemReader(it).read_metadata()
    item = mcore_compat.COMMON_STATE_ITEM
    metadata.state_dict_metadata[item] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(item)] = next(iter(metadata.storage_data.values()))
    with open(os.path.join(it, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    os.remove(os.path.join(it, mcore_compat.COMMON_PT))
    err = _main_error(argv + ["--nproc-per-node", "4", "--load", ckpt], capsys)
    assert "megatron-core 0.19 or newer" in err and "--load" in err, err


def test_common_state_is_read_onto_the_host(good_ckpt, monkeypatch):
    """0.19+'s reader of the common state (Megatron's, and torch's checkpoint planner under it)
    calls ``torch.load`` without ``map_location``: a tensor saved on a GPU (``--fp16``'s loss
    scale) came back on ``cuda:0`` in the launcher and on every rank. Every such load maps to the
    host, as the ``common.pt`` path does."""
    import torch

    from megatron_oases import mcore_compat

    if not mcore_compat.common_state_in_torch_dist():
        pytest.skip("before 0.19 the common state is common.pt, read with map_location='cpu'")
    calls, real = [], torch.load

    def recording(*args, **kwargs):
        calls.append(kwargs.get("map_location"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording)
    ckpt, _ = good_ckpt
    state = mcore_compat.load_common_state(os.path.join(ckpt, "iter_0000003"))
    assert state and calls and set(calls) == {"cpu"}, calls
    assert torch.load is recording  # put back


def test_megatron_save_on_cpu_ranks_after_the_cpu_layer(tmp_path):
    """Megatron's own torch_dist save and load on a CPU rank once the CPU layer is installed
    (what tests/test_atp_checkpoint.py and the Megatron-LM entry do): from 0.19 the writer's
    ``state_dict_saver`` is imported only at the first save, and its
    ``torch.cuda.current_device()`` failed ("Cannot re-initialize CUDA in forked subprocess")."""
    (got,) = run_on_ranks(megatron_save_load, 1, args=(str(tmp_path / "c"),), timeout_s=TIMEOUT)
    assert got == [[0.0, 1.0, 2.0, 3.0], {"step": 3}, 3], got


LEGACY = os.path.join(os.path.dirname(__file__), "data", "ckpt_mcore_0.16.1")


def test_mcore_0_16_checkpoint_resumes(tmp_path):
    """A user upgrading mid-training: the checkpoint saved by megatron-core 0.16.1 (with its
    ``common.pt``; tests/data/README.md) resumes with the uninterrupted run's losses of 0.19.2."""
    from megatron_oases import mcore_compat

    if not mcore_compat.at_least(0, 17):
        pytest.skip("the fixture was saved by this release (0.16); same-release resumes are "
                    "test_killed_save_keeps_previous_and_resume_matches")
    with open(LEGACY + ".json", encoding="utf-8") as f:
        ref = json.load(f)
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(LEGACY, ckpt)
    got = run_on_ranks(train, ref["ranks"], args=(ref["argv"].split() + [
        "--train-iters", str(ref["train_iters"]), "--load", ckpt],), timeout_s=TIMEOUT)[-1]["losses"]
    want = {int(k): v for k, v in ref["uninterrupted_megatron_core_0.19.2"].items()}
    assert sorted(got) == list(range(ref["saved_at"] + 1, ref["train_iters"] + 1)), got
    diffs = {it: _rel(got[it], want[it]) for it in got}
    print(f"0.16.1 checkpoint resumed on {mcore_compat.mcore_version()}: max rel diff "
          f"{max(diffs.values()):.3g} {diffs}")
    assert max(diffs.values()) <= RESUME_TOL, (got, want)


def test_intact_copy_passes_validation(good_ckpt):
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    ckpt, argv = good_ckpt
    validate_config(run_config(build_parser().parse_args(argv + ["--load", ckpt])), 4, False)


@pytest.mark.parametrize("extra, names", [
    (["--hidden-size", "128", "--ffn-hidden-size", "256"], "--hidden-size"),
    (["--make-vocab-size-divisible-by", "512"], "--make-vocab-size-divisible-by"),
])
def test_other_model_is_refused(good_ckpt, extra, names, capsys):
    ckpt, argv = good_ckpt
    err = _main_error(argv + extra + ["--nproc-per-node", "4", "--load", ckpt], capsys)
    assert names in err, err


def test_a_load_with_nothing_left_to_train_is_refused(good_ckpt, capsys):
    """A checkpoint at iteration 3 with --train-iters 3: nothing would train (it exited 0 having
    done nothing); the same with --save naming the directory is a finished requeued job."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    ckpt, argv = good_ckpt
    err = _main_error(argv + ["--nproc-per-node", "4", "--load", ckpt, "--train-iters", "3"], capsys)
    assert "--train-iters 3: the checkpoint" in err and "is at iteration 3, so nothing would train" in err
    # a SLURM requeue of a finished job (--save naming the --load directory) still starts
    validate_config(run_config(build_parser().parse_args(
        argv + ["--load", ckpt, "--save", ckpt, "--train-iters", "3"])), 4, False)


@pytest.mark.parametrize("argv, names", [
    (["--save", "X", "--ckpt-format", "torch"], "--ckpt-format"),
    (["--save-interval", "3"], "--save-interval needs --save"),
    (["--save", "X", "--save-interval", "0"], "--save-interval"),
    (["--load", "NOPE"], "latest_checkpointed_iteration.txt"),
])
def test_bad_checkpoint_flags(argv, names, tmp_path, capsys):
    argv = [a.replace("X", str(tmp_path / "s")).replace("NOPE", str(tmp_path / "none"))
            for a in argv]
    err = _main_error(MODEL + ["--nproc-per-node", "1"] + argv, capsys)
    assert names in err, err


def test_save_and_load_same_empty_dir_starts_fresh(tmp_path):
    """Megatron-LM's auto-resume: ``--save D --load D`` before D holds a checkpoint is fine."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    d = str(tmp_path / "d")
    validate_config(run_config(build_parser().parse_args(MODEL + ["--save", d, "--load", d])), 1, False)


def test_cli_resumes_in_the_same_directory_and_prints_megatron_lines(tmp_path):
    """``--save D --load D`` (Megatron-LM's auto-resume): the first run starts fresh and saves
    every iteration and at the end; the second continues at iteration 3. Each is the trainer's
    ``main`` as one rank torchrun started, on a forkserver rank (``tests/rank_fns_main.py``)."""
    from tests.rank_fns_main import main_on_ranks

    d = str(tmp_path / "ck")

    def launch(*extra):  # (status, the rank's stdout and stderr)
        return main_on_ranks("megatron_oases.train", 1, [*MODEL, "--save", d, "--load", d, *extra],
                             timeout_s=TIMEOUT)

    rc, one = launch("--train-iters", "2", "--save-interval", "1")
    assert rc == 0, one[-3000:]
    assert f" no checkpoint in {d} yet; starting from iteration 0" in one, one
    for it in (1, 2):
        assert f" saving checkpoint at iteration {it} to {d}\n" in one, one
    rc, two = launch("--train-iters", "3")
    assert rc == 0, two[-3000:]
    assert f" loaded checkpoint from {d} at iteration 2\n" in two, two
    assert " iteration        3/       3 |" in two and " iteration        2/" not in two
    assert f" saving checkpoint at iteration 3 to {d}\n" in two  # at the end of training
    assert open(os.path.join(d, TRACKER)).read() == "3"


def test_publish_replaces_an_existing_iteration(tmp_path):
    """Re-saving an iteration (after a resume): the new directory replaces the old one, then
    the latest file; a stale temporary directory alone is no checkpoint."""
    from megatron_oases.checkpoint import _publish, find_checkpoint

    root = tmp_path
    (root / "iter_0000002.tmp-old").mkdir()
    assert find_checkpoint(str(root), missing_ok=True) is None
    final = root / "iter_0000002"
    final.mkdir()
    (final / "marker").write_text("old")
    tmp = root / "iter_0000002.tmp-new"
    tmp.mkdir()
    (tmp / "marker").write_text("new")
    _publish(str(tmp), str(final), str(root), 2, "new")
    assert (final / "marker").read_text() == "new"
    assert (root / TRACKER).read_text() == "2"
    assert sorted(os.listdir(root)) == sorted([TRACKER, "iter_0000002", "iter_0000002.tmp-old"])


# -- Resume at another size with the distributed optimizer (issue 37) ---------------------------
# Its state is saved in Megatron's fully reshardable format by default, keyed by the model's
# sharded tensors like the plain optimizer's, so it loads at any DP/TP size, backend and
# schedule, and with or without --use-distributed-optimizer. Each case is compared with the
# uninterrupted run of the *target* layout (which also provides the checkpoints: one launch per
# layout and schedule). A lower learning rate than MODEL's keeps the run clear of the loss
# spike where float-rounding differences between layouts grow past 1e-6. Saved at 2 of 4: the
# first iteration after a resume checks the weights, the second the optimizer state as well.
RESHARD_MODEL = MODEL + ["--micro-batch-size", "2", "--lr", "3e-3"]
SAVED, ITERS = 2, 4
AFTER = tuple(range(SAVED + 1, ITERS + 1))
"""The iterations a resume from SAVED trains: (3, 4)."""
DIST = ["--use-distributed-optimizer"]
RESHARD_LAYOUTS = {  # name: (ranks, flags)
    "dist_dp2": (4, DIST + ["--tensor-model-parallel-size", "2"]),  # TP2 x DP2
    "dist_dp4": (4, DIST),  # TP1 x DP4
    "plain_dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "dist_atp_2x2": (4, DIST + ["--micro-batch-size", "4", "--tensor-model-parallel-size", "4",
                                "--tp-backend", "atp", "--atp-mesh", "2,2"]),
    "dist_3d_tp8": (8, DIST + ["--micro-batch-size", "4", "--tensor-model-parallel-size", "8",
                               "--tp-backend", "3d"]),
    # the plain optimizer in bf16 (Megatron's Float16OptimizerWithFloat16Params, fp32 main params)
    "bf16_dp2": (4, ["--bf16", "--tensor-model-parallel-size", "2"]),
    "bf16_atp_2x2": (4, ["--bf16", "--micro-batch-size", "4", "--tensor-model-parallel-size", "4",
                         "--tp-backend", "atp", "--atp-mesh", "2,2"]),
    "bf16_3d_tp8": (8, ["--bf16", "--micro-batch-size", "4", "--tensor-model-parallel-size", "8",
                        "--tp-backend", "3d"]),
    # Megatron-LM's default format, kept for the same layout only
    "dist_dp2_dp_reshardable": (4, DIST + ["--tensor-model-parallel-size", "2",
                                           "--no-dist-ckpt-optim-fully-reshardable"]),
}
_UNINTERRUPTED: dict = {}


def _uninterrupted(layout: str, schedule: str, tmp_path_factory) -> dict:
    """ITERS iterations of ``layout``, saving at SAVED and ITERS: its losses and checkpoint
    (cached)."""
    if (layout, schedule) not in _UNINTERRUPTED:
        n, flags = RESHARD_LAYOUTS[layout]
        ckpt = str(tmp_path_factory.mktemp(f"{layout}_{schedule}") / "ckpt")
        argv = RESHARD_MODEL + flags + ["--schedule", schedule]
        losses = run_on_ranks(train, n, args=(argv + ["--train-iters", str(ITERS), "--save", ckpt,
                                                      "--save-interval", str(SAVED)],),
                              timeout_s=TIMEOUT)[-1]["losses"]
        _UNINTERRUPTED[layout, schedule] = {"n": n, "argv": argv, "ckpt": ckpt,
                                            "losses": losses}
    return _UNINTERRUPTED[layout, schedule]


def _resume_diffs(src: str, dst: str, schedule: str, tmp_path_factory, tmp_path,
                  extra=()) -> tuple[dict, dict]:
    """Resume ``dst`` from ``src``'s iteration SAVED; relative differences of the iterations
    AFTER from ``dst``'s uninterrupted run, and the resumed losses."""
    saved = _uninterrupted(src, schedule, tmp_path_factory)
    target = _uninterrupted(dst, schedule, tmp_path_factory)
    ckpt = _copy_at(saved["ckpt"], SAVED, tmp_path)
    argv = [a for a in target["argv"] if a != "--no-dist-ckpt-optim-fully-reshardable"]  # no save
    got = run_on_ranks(train, target["n"], args=(argv + list(extra) + [
        "--train-iters", str(ITERS), "--load", ckpt],), timeout_s=TIMEOUT)[-1]["losses"]
    assert tuple(sorted(got)) == AFTER, got
    return {it: _rel(got[it], target["losses"][it]) for it in AFTER}, got


@pytest.mark.parametrize("schedule", ["default", "oases"])
@pytest.mark.parametrize("src, dst", [("dist_dp2", "dist_dp4"), ("dist_dp4", "dist_dp2"),
                                      ("dist_dp4", "plain_dp2"), ("plain_dp2", "dist_dp4")],
                         ids=["dist_dp2->dist_dp4", "dist_dp4->dist_dp2", "dist->plain",
                              "plain->dist"])
def test_distributed_optimizer_resumes_at_another_size(src, dst, schedule, tmp_path_factory,
                                                       tmp_path):
    """DP2 (TP2 x DP2) <-> DP4 (TP1 x DP4) with the distributed optimizer, and distributed <->
    plain optimizer: the iterations after the resume equal the target layout's uninterrupted run
    (Adam state included: without it the second is off by > 1e-4, see the --no-load-optim test
    below)."""
    diffs, _ = _resume_diffs(src, dst, schedule, tmp_path_factory, tmp_path)
    print(f"{src} -> {dst} ({schedule}): max rel diff {max(diffs.values()):.3g} {diffs}")
    assert max(diffs.values()) <= RESUME_TOL, diffs


def test_distributed_optimizer_resumes_from_atp_into_3d(tmp_path_factory, tmp_path):
    """ATP mesh (2, 2) TP4 -> 3-D cube TP8, distributed optimizer on both sides (the 3-D ranks
    off the cube diagonal hold empty slices of the vector parameters)."""
    diffs, _ = _resume_diffs("dist_atp_2x2", "dist_3d_tp8", "default", tmp_path_factory,
                             tmp_path)
    print(f"dist_atp_2x2 -> dist_3d_tp8: max rel diff {max(diffs.values()):.3g} {diffs}")
    assert max(diffs.values()) <= RESUME_TOL, diffs


BF16_CROSS_TOL = 1e-3  # bf16, another layout: the layouts' own first iterations differ by ~1e-4


@pytest.mark.parametrize("src, dst", [("bf16_3d_tp8", "bf16_3d_tp8"), ("bf16_dp2", "bf16_3d_tp8"),
                                      ("bf16_3d_tp8", "bf16_dp2"), ("bf16_atp_2x2", "bf16_atp_2x2"),
                                      ("bf16_atp_2x2", "bf16_3d_tp8")])
def test_bf16_plain_optimizer_resumes_on_3d_and_atp(src, dst, tmp_path_factory, tmp_path):
    """The plain optimizer in bf16 (fp32 main parameters in the checkpoint) resumes on the 3-D
    cube and on ATP, from the same layout (the uninterrupted run exactly) and from TP 2 or ATP
    (within bf16's layout differences). On the cube, ranks off the diagonal hold empty, local
    vectors among the main parameters: their load failed (``Cannot merge two lists``)."""
    diffs, _ = _resume_diffs(src, dst, "default", tmp_path_factory, tmp_path)
    print(f"{src} -> {dst}: max rel diff {max(diffs.values()):.3g} {diffs}")
    assert max(diffs.values()) <= (RESUME_TOL if src == dst else BF16_CROSS_TOL), diffs


def test_bf16_resume_into_3d_needed_the_optimizer_state(tmp_path_factory, tmp_path):
    """TP 2 -> cube in bf16 with --no-load-optim: the first iteration after the resume still
    matches, the second is off by more than BF16_CROSS_TOL, so the tolerance above tells a loaded
    optimizer state from a fresh one."""
    diffs, _ = _resume_diffs("bf16_dp2", "bf16_3d_tp8", "default", tmp_path_factory, tmp_path,
                             extra=["--no-load-optim"])
    print(f"bf16_dp2 -> bf16_3d_tp8 --no-load-optim: {diffs}")
    assert diffs[AFTER[0]] <= BF16_CROSS_TOL < diffs[AFTER[1]], diffs


def test_main_params_keep_their_positions_through_a_load():
    """``main_params_by_position`` / ``main_params_as_lists``: every group back as long as it
    was, an empty group (which a load drops) included, for one optimizer and a chained one."""
    from megatron_oases.runtime.dist_ckpt import (MAIN_PARAMS, main_params_as_lists,
                                                  main_params_by_position)

    for chained in (False, True):
        one = {"optimizer": {"state": {}}, MAIN_PARAMS: [["a", "b"], [], ["c"]]}
        sharded = {0: one} if chained else one
        main_params_by_position(sharded)
        assert one[MAIN_PARAMS] == {0: {0: "a", 1: "b"}, 1: {}, 2: {0: "c"}}
        got = {MAIN_PARAMS: {2: {0: "C"}, 0: {1: "B", 0: "A"}}}  # as a load merges them
        loaded = {0: got} if chained else got
        main_params_as_lists(loaded, sharded)
        assert got[MAIN_PARAMS] == [["A", "B"], [], ["C"]]


def test_resharded_resume_needed_the_optimizer_state(tmp_path_factory, tmp_path):
    """The same resume with --no-load-optim: the first iteration after it still matches, the
    second does not."""
    diffs, _ = _resume_diffs("dist_dp2", "dist_dp4", "default", tmp_path_factory, tmp_path,
                             extra=["--no-load-optim"])
    assert diffs[AFTER[0]] <= RESUME_TOL and diffs[AFTER[1]] > 1e-4, diffs


def test_dp_reshardable_resumes_in_its_own_layout(tmp_path_factory, tmp_path):
    """``--no-dist-ckpt-optim-fully-reshardable`` (Megatron-LM's default dp_reshardable) still
    resumes into the layout that saved it."""
    diffs, _ = _resume_diffs("dist_dp2_dp_reshardable", "dist_dp2_dp_reshardable", "default",
                             tmp_path_factory, tmp_path)
    assert max(diffs.values()) <= RESUME_TOL, diffs


@pytest.mark.parametrize("flags, names", [
    ([], "plain optimizer, TP2 PP1 DP2"),
    (DIST, "distributed optimizer, TP1 PP1 DP4"),
    (DIST + ["--tensor-model-parallel-size", "2", "--overlap-grad-reduce"],
     "overlap_grad_reduce=True"),
], ids=["into plain", "into DP4", "other buckets"])
def test_dp_reshardable_into_another_layout_is_refused(flags, names, tmp_path_factory, tmp_path,
                                                       capsys):
    """A dp_reshardable state is one flat tensor per bucket of each DP group: refused before
    start-up, in one line naming both layouts and --no-load-optim (which then passes)."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    saved = _uninterrupted("dist_dp2_dp_reshardable", "default", tmp_path_factory)
    ckpt = _copy_at(saved["ckpt"], SAVED, tmp_path)
    argv = RESHARD_MODEL + (flags or ["--tensor-model-parallel-size", "2"]) + ["--load", ckpt]
    err = _main_error(argv + ["--nproc-per-node", "4"], capsys)
    assert "dp_reshardable" in err and "distributed optimizer, TP2 PP1 DP2" in err, err
    assert names in err and "--no-load-optim" in err, err
    validate_config(run_config(build_parser().parse_args(argv + ["--no-load-optim"])), 4, False)


@pytest.mark.parametrize("argv", [
    ["--save", "X", "--no-dist-ckpt-optim-fully-reshardable"],
    ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"],
], ids=["no distributed optimizer", "no --save"])
def test_optimizer_format_flag_needs_what_it_acts_on(argv, tmp_path, capsys):
    argv = [a.replace("X", str(tmp_path / "s")) for a in argv]
    err = _main_error(MODEL + ["--nproc-per-node", "1"] + argv, capsys)
    assert "dist-ckpt-optim-fully-reshardable" in err and "drop it" in err, err


FP16_SKIPPING = ["--fp16", "--initial-loss-scale", "1048576", "--train-iters", "6"]
"""At this scale the loss scaler skips iterations 1-3 (plain) or 1-4 (distributed optimizer, DP 2)
of MODEL, and steps from there on."""


@pytest.mark.parametrize("ranks, extra", [(1, []), (2, ["--use-distributed-optimizer"])],
                         ids=["plain", "distributed"])
def test_fp16_checkpoint_saved_before_the_first_step_resumes(ranks, extra, tmp_path):
    """Issue 48: a checkpoint saved while the fp16 loss scaler had skipped every step held no Adam
    state (the plain optimizer's then failed to load, ``KeyError: optimizer.state.exp_avg...``;
    the distributed optimizer's failed to save). Saved at 2, it resumes with the uninterrupted
    run's losses, updates included; the skipped steps (inf gradients) do not stop training."""
    ckpt, log = str(tmp_path / "ck"), tmp_path / "whole.jsonl"
    argv = MODEL + FP16_SKIPPING + extra
    run_on_ranks(train, ranks, args=(argv + ["--save", ckpt, "--save-interval", "2",
                                             "--log-json", str(log)],), timeout_s=TIMEOUT)
    with open(log, encoding="utf-8") as f:
        whole = {r["iteration"]: r for r in map(json.loads, f)}
    assert whole[1]["grad_norm"] is None and whole[2]["grad_norm"] is None
    assert whole[5]["grad_norm"] is not None and whole[6]["grad_norm"] is not None
    resumed = run_on_ranks(train, ranks, args=(argv + ["--load", ckpt, "--ckpt-step", "2"],),
                           timeout_s=TIMEOUT)[-1]["losses"]
    assert sorted(resumed) == [3, 4, 5, 6]
    for it, loss in resumed.items():
        assert _rel(loss, whole[it]["lm_loss"]) <= RESUME_TOL, (it, loss, whole[it]["lm_loss"])


def test_validation_count_of_a_checkpoint_saved_without_it():
    """Checkpoints from before consumed_valid_samples still load, going on after the validations
    their flags had made: one per --eval-interval, and the end one at --train-iters."""
    from megatron_oases.checkpoint import saved_valid_samples

    flags = {"eval_interval": 2, "eval_iters": 3, "train_iters": 6, "global_batch_size": 8}
    assert saved_valid_samples({"args": flags}, 5) == 2 * 3 * 8
    assert saved_valid_samples({"args": flags}, 6) == 4 * 3 * 8
    assert saved_valid_samples({"args": {**flags, "eval_interval": None}}, 6) == 0
    assert saved_valid_samples({"args": {}}, 6) == 0
    assert saved_valid_samples({"args": flags, "consumed_valid_samples": 48}, 5) == 48
