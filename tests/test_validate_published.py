"""scripts/validate_published.py: the published-measurement rows load, three of them simulate with
the analytical model and the script writes its table, CSV and JSON. No error bar is asserted here
(docs/sim_validation.md reports it)."""
from __future__ import annotations

import csv
import json
import os

from megatron_oases.flops import gpt_flops_per_iteration
from tests.script_modules import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    return load_script("scripts/validate_published.py")


def test_rows_load_with_sources_and_assumptions():
    sources, rows = _script().load_rows()
    assert len(rows) >= 20 and len({r["source"] for r in rows}) >= 2
    for r in rows:
        assert r["measured"] > 0 and r["topology"] and r["nodes"] >= 1
    for s in sources.values():
        assert s["url"].startswith("https://") and s["where"] and s["assumptions"]


def test_script_runs_three_rows_and_writes_outputs(tmp_path, capsys):
    out = str(tmp_path / "pub")
    ids = ["a100-1.7B", "a100-175B-example", "h100-1.7B"]
    assert _script().main(["--rows", *ids, "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "median |error|" in printed and all(i in printed for i in ids)
    with open(out + ".csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["id"] for r in rows] == ids and all(float(r["predicted"]) > 0 for r in rows)
    with open(out + ".json", encoding="utf-8") as f:
        data = json.load(f)
    assert data["summary"]["rows"] == 3 and data["summary"]["sources"] == 3
    assert set(data["sources"]) == {r["source"] for r in rows}


def test_recompute_flops_match_the_2021_readme_example():
    """The README's 175B example: 32 s per iteration on 1024 A100s is 138 teraFLOP/s only with a
    full recompute's forward counted (96 B s L h^2 (1 + s/6h + V/16Lh))."""
    kw = dict(global_batch_size=1536, seq_length=2048, num_layers=96, hidden_size=12288,
              num_attention_heads=96, ffn_hidden_size=4 * 12288, padded_vocab_size=51200)
    assert round(gpt_flops_per_iteration(**kw, recompute=True) / 32 / 1024 / 1e12) == 138
    assert round(gpt_flops_per_iteration(**kw) / 32 / 1024 / 1e12) == 103
