"""Output paths are refused before any work, in one line naming the flag, where they cannot be
written: a missing folder, a directory given for a file, and a read-only place that permission
bits call writable for root (/proc)."""
from __future__ import annotations

import os

import pytest

from megatron_oases.errors import ConfigError
from megatron_oases.output_paths import can_create_in, check_output_file, check_output_root
from megatron_oases.sim.frontends.cli import sim_main
from megatron_oases.sim.frontends.profile_cli import profile_main

READ_ONLY = "/proc"  # mkdir fails there even for root


def test_probe_leaves_nothing_behind(tmp_path):
    assert can_create_in(str(tmp_path)) and os.listdir(tmp_path) == []
    assert not can_create_in(str(tmp_path / "missing"))
    assert not can_create_in(READ_ONLY)


@pytest.mark.parametrize("path, needle", [
    (f"{READ_ONLY}/out.json", "/proc is not a writable directory"),
    (f"{READ_ONLY}/version", "/proc/version cannot be written"),
    ("/nonexistent-dir/out.json", "directory /nonexistent-dir does not exist"),
    ("{tmp}", "is a directory; give a file name"),
])
def test_output_file_refusals_name_the_flag(path, needle, tmp_path):
    with pytest.raises(ConfigError, match="^--out ") as err:
        check_output_file("--out", path.format(tmp=tmp_path))
    assert needle in str(err.value)


def test_output_file_and_root_accept_writable_places(tmp_path):
    check_output_file("--out", str(tmp_path / "out.json"))
    check_output_file("--out", "-")
    check_output_file("--log-json", "/dev/null")  # a file that exists: no directory made beside it
    (tmp_path / "old.json").write_text("{}")
    check_output_file("--out", str(tmp_path / "old.json"))
    os.remove(tmp_path / "old.json")
    check_output_root("--save", str(tmp_path / "a" / "b"))  # made by the run
    assert os.listdir(tmp_path) == []
    with pytest.raises(ConfigError, match="--save /proc/ckpt: /proc is not a writable directory"):
        check_output_root("--save", f"{READ_ONLY}/ckpt")


MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2"]


@pytest.mark.parametrize("flags", [["--tp", "2", "--trace", f"{READ_ONLY}/t.json"],
                                   ["--tp", "2", "--png", "/nonexistent-dir/t.png"],
                                   ["--search", "--global-batch-size", "16", "--csv", f"{READ_ONLY}/s.csv"]],
                         ids=["trace", "png", "csv"])
def test_sim_refuses_an_unwritable_output_before_simulating(flags, capsys):
    assert sim_main(["--topology", "2node-ib", *MODEL, *flags]) == 2
    err = capsys.readouterr()
    assert err.out == "" and len(err.err.strip().splitlines()) == 1 and flags[-2] in err.err


def test_profile_refuses_an_unwritable_out_before_measuring(capsys):
    assert profile_main(["--out", f"{READ_ONLY}/p.json", *MODEL, "--tp", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out /proc/p.json" in err[0]
