"""Checkpoint checksums (``integrity.json``, runtime/ckpt_manifest.py; issue 37).

A file garbled in place (same size, other bytes) passes every structural check and used to fail
only inside ``dist_checkpointing.load`` on the ranks. Now each save writes Megatron's integrity
manifest last, and ``--load`` checks it before any process group: one line naming the file, the
checkpoint and ``--ckpt-step``. Saved with one rank and with two ranks and the distributed
optimizer; an untouched checkpoint resumes as before, one without a manifest (older, Megatron-LM's,
``--no-verify-integrity``) loads with a note, and ``--no-verify-integrity`` skips the check.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch.distributed as dist

from megatron_oases.checkpoint import CRASH_ENV, TRACKER
from megatron_oases.runtime import ckpt_manifest
from megatron_oases.runtime.spawn import RankFailure, run_on_ranks
from megatron_oases.train import main
from tests.rank_fns_ckpt import MODEL, train

pytest.importorskip("psutil", reason="Megatron's torch_dist checkpoint writer needs psutil")

TIMEOUT = 150
DISTOPT = MODEL + ["--use-distributed-optimizer"]
LEGACY = os.path.join(os.path.dirname(__file__), "data", "ckpt_mcore_0.16.1")


def _losses(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """One rank, saves at 1 and 2; killed inside the save of 2 (after its shards)."""
    ckpt = str(tmp_path_factory.mktemp("one") / "ckpt")
    with pytest.raises(RankFailure):
        run_on_ranks(train, 1, args=(MODEL + ["--train-iters", "2", "--save", ckpt,
                                              "--save-interval", "1"],),
                     timeout_s=TIMEOUT, env={CRASH_ENV: "0:2"})
    return ckpt


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two ranks (DP2), the distributed optimizer, saves at 2 and 4, through the CLI."""
    d = tmp_path_factory.mktemp("two")
    ckpt, log = str(d / "ckpt"), str(d / "losses.jsonl")
    assert main(DISTOPT + ["--nproc-per-node", "2", "--train-iters", "4", "--save", ckpt,
                           "--save-interval", "2", "--log-json", log]) == 0
    return ckpt, _losses(log)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _garble(it: str, nan: bool = False) -> str:
    """Overwrite 64 bytes in the middle of the largest shard file (same size; ``nan``: with 0xFF
    bytes, float32 NaNs where tensors are stored); returns its name."""
    name = max((f for f in os.listdir(it) if f.endswith(".distcp")),
               key=lambda f: os.path.getsize(os.path.join(it, f)))
    path = os.path.join(it, name)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        old = f.read(64)
        f.seek(size // 2)
        f.write(b"\xff" * 64 if nan else bytes(b ^ 0xFF for b in old))
    assert os.path.getsize(path) == size
    return name


def _refused(argv, capsys) -> str:
    """main(argv) exits 2 with one line, before any process group."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not dist.is_initialized()
    return err


def test_save_writes_the_manifest_last(one_rank, two_ranks):
    """Every file of each complete checkpoint is listed with its size and SHA-256; the save
    killed before publishing left a temporary directory without one."""
    for it in (os.path.join(one_rank, "iter_0000001"), os.path.join(two_ranks[0], "iter_0000002"),
               os.path.join(two_ranks[0], "iter_0000004")):
        with open(os.path.join(it, ckpt_manifest.MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        files = sorted(f for f in os.listdir(it) if f != ckpt_manifest.MANIFEST)
        assert manifest["algorithm"] == "sha256"
        assert sorted(manifest["files"]) == sorted(manifest["sizes"]) == files, (manifest, files)
        for name in files:
            path = os.path.join(it, name)
            assert manifest["sizes"][name] == os.path.getsize(path)
            assert manifest["files"][name] == ckpt_manifest.file_digest(path)
        assert ckpt_manifest.first_mismatch(it) is None
    (killed,) = [d for d in os.listdir(one_rank) if ".tmp-" in d]
    assert killed.startswith("iter_0000002")
    assert not os.path.exists(os.path.join(one_rank, killed, ckpt_manifest.MANIFEST))
    assert os.listdir(os.path.join(one_rank, killed))  # its shards were written
    with open(os.path.join(one_rank, TRACKER), encoding="utf-8") as f:
        assert f.read() == "1"


def test_megatron_reads_our_manifest(two_ranks, tmp_path):
    """Megatron-Core's own check (``load(..., verify_integrity=True)``, Megatron-LM's
    ``--verify-integrity``, megatron-core 0.17 on) accepts our manifest and finds a garbled file."""
    validation = pytest.importorskip("megatron.core.dist_checkpointing.validation")
    if not hasattr(validation, "verify_integrity_manifest"):
        pytest.skip("this megatron-core has no integrity manifest (0.17 on)")
    from megatron.core.dist_checkpointing.core import CheckpointingException

    it = os.path.join(_copy(two_ranks[0], tmp_path / "c"), "iter_0000004")
    validation.verify_integrity_manifest(it)
    name = _garble(it)
    with pytest.raises(CheckpointingException, match=name):
        validation.verify_integrity_manifest(it)


@pytest.mark.parametrize("which", ["one_rank", "two_ranks"])
def test_garbled_shard_is_refused_in_one_line(which, request, tmp_path, capsys):
    if which == "one_rank":
        ckpt, argv, ranks, it, older = request.getfixturevalue(which), MODEL, 1, 1, None
    else:
        ckpt, argv, ranks, it, older = request.getfixturevalue(which)[0], DISTOPT, 2, 4, "2"
    ckpt = _copy(ckpt, tmp_path / "c")
    name = _garble(os.path.join(ckpt, f"iter_{it:07d}"))
    err = _refused(argv + ["--nproc-per-node", str(ranks), "--train-iters", "6",
                           "--load", ckpt], capsys)
    assert err.startswith(f"megatron-oases train: error: --load {ckpt}: "), err
    assert f"iter_{it:07d}/{name} has changed since it was saved" in err, err
    assert "restore it" in err, err
    if older:
        assert f"--ckpt-step N (saved here: {older})" in err, err
    else:
        assert "no older iteration is saved here" in err, err


def test_other_damage_named_by_the_manifest(two_ranks, tmp_path, capsys):
    """A size the manifest did not record, and an unreadable manifest (whose way out includes
    loading unverified)."""
    ckpt = _copy(two_ranks[0], tmp_path / "c")
    it = os.path.join(ckpt, "iter_0000004")
    size = os.path.getsize(os.path.join(it, "metadata.json"))
    with open(os.path.join(it, "metadata.json"), "a", encoding="utf-8") as f:
        f.write(" ")  # still valid JSON: only the manifest sees it
    err = _refused(DISTOPT + ["--nproc-per-node", "2", "--load", ckpt], capsys)
    assert f"metadata.json is {size + 1} bytes, {size} when it was saved" in err, err
    with open(os.path.join(it, ckpt_manifest.MANIFEST), "w", encoding="utf-8") as f:
        f.write("{")
    err = _refused(DISTOPT + ["--nproc-per-node", "2", "--load", ckpt], capsys)
    assert "integrity.json is unreadable" in err and "--no-verify-integrity" in err, err


def test_no_verify_integrity_skips_the_check(two_ranks, tmp_path, capsys):
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    ckpt = _copy(two_ranks[0], tmp_path / "c")
    _garble(os.path.join(ckpt, "iter_0000004"))
    args = build_parser().parse_args(DISTOPT + ["--load", ckpt, "--no-verify-integrity"])
    validate_config(run_config(args), 2, False)
    assert capsys.readouterr().out == ""


def test_ckpt_step_picks_an_older_iteration(two_ranks, tmp_path, capsys):
    """The way out the error names: --ckpt-step 2 verifies and loads iteration 2 although the
    latest (4) is garbled, and iterations 3-4 are those of the saving run (resume as before).
    A missing step is refused naming the saved ones."""
    ckpt, saved = two_ranks
    ckpt = _copy(ckpt, tmp_path / "c")
    _garble(os.path.join(ckpt, "iter_0000004"))
    log = str(tmp_path / "resumed.jsonl")
    assert main(DISTOPT + ["--nproc-per-node", "2", "--train-iters", "4", "--load", ckpt,
                           "--ckpt-step", "2", "--log-json", log]) == 0
    resumed = _losses(log)
    assert sorted(resumed) == [3, 4], resumed
    assert all(abs(resumed[i] - saved[i]) <= 1e-6 * abs(saved[i]) for i in (3, 4)), \
        (resumed, saved)
    capsys.readouterr()
    err = _refused(DISTOPT + ["--nproc-per-node", "2", "--load", ckpt, "--ckpt-step", "3"],
                   capsys)
    assert "--ckpt-step 3" in err and "iter_0000003 is missing (saved in" in err and \
        ": 4, 2)" in err, err
    err = _refused(MODEL + ["--nproc-per-node", "1", "--ckpt-step", "3"], capsys)
    assert "--ckpt-step needs --load" in err, err


def test_checkpoint_without_manifest_loads_with_a_note(tmp_path, capsys):
    """Saved with --no-verify-integrity (no manifest, as checkpoints from before it and
    Megatron-LM's own): --load notes once that it is not verified, and resumes."""
    ckpt = str(tmp_path / "ckpt")
    run_on_ranks(train, 1, args=(MODEL + ["--train-iters", "1", "--save", ckpt,
                                          "--no-verify-integrity"],), timeout_s=TIMEOUT)
    it = os.path.join(ckpt, "iter_0000001")
    assert os.listdir(it) and not ckpt_manifest.has_manifest(it)
    capsys.readouterr()
    log = str(tmp_path / "resumed.jsonl")
    assert main(MODEL + ["--nproc-per-node", "1", "--train-iters", "2", "--load", ckpt,
                         "--log-json", log]) == 0
    out = capsys.readouterr().out  # the launcher's lines (the ranks' go where the forkserver's do)
    notes = [ln for ln in out.splitlines() if "has no integrity.json" in ln]
    assert notes == [f" --load: {it} has no integrity.json (saved without checksums): its files "
                     "are not verified"], out
    assert sorted(_losses(log)) == [2]  # resumed after iteration 1


def test_legacy_checkpoint_passes_with_the_note(capsys):
    """The committed megatron-core 0.16.1 checkpoint (no manifest) passes the pre-start checks
    with the note (its resume: tests/test_checkpoint.py::test_mcore_0_16_checkpoint_resumes)."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    with open(LEGACY + ".json", encoding="utf-8") as f:
        ref = json.load(f)
    validate_config(run_config(build_parser().parse_args(ref["argv"].split() + ["--load", LEGACY])),
                  ref["ranks"], False)
    out = capsys.readouterr().out
    assert out.count("has no integrity.json") == 1 and "not verified" in out, out


def test_a_garbled_shard_loaded_unverified_stops_at_its_nan(two_ranks, tmp_path, capsys):
    """Issue 48: a shard garbled in place and loaded with --no-verify-integrity trained on with
    ``lm loss: NAN`` and exited 0. The NaN check stops the run in one line (exit 1) whose way
    out names the checksums and an older --ckpt-step, and saves nothing after it."""
    ckpt = _copy(two_ranks[0], tmp_path / "c")
    _garble(os.path.join(ckpt, "iter_0000004"), nan=True)
    capsys.readouterr()
    assert main(DISTOPT + ["--nproc-per-node", "2", "--train-iters", "8", "--load", ckpt,
                           "--no-verify-integrity", "--save", ckpt]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is NaN" in err[0], err
    assert "resume from an earlier checkpoint (--ckpt-step N; drop --no-verify-integrity" in err[0]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "4"
