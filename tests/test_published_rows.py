"""examples/validation/published_megatron.yaml as data: every row's measured number is the one its
source printed (converted only where the row says how), ids are unique, and the table spans what
issue 49 item 4 asks of it (cards, stacks, micro-batches, deep pipelines), so a row dropped or
mistyped fails here rather than moving the validation's median silently. No simulation."""
from __future__ import annotations

import os

import pytest

from megatron_oases.sim.frontends.published import load_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "examples", "validation", "published_megatron.yaml")


@pytest.fixture(scope="module")
def table():
    return load_rows(DATA)


def test_ids_unique_and_every_source_cited(table):
    sources, rows = table
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))
    used = {r["source"] for r in rows}
    assert used == set(sources)
    for s in sources.values():
        assert s["title"] and s["url"].startswith("https://")
        assert s["where"] and s["hardware"] and s["assumptions"]


def test_tokens_per_second_rows_convert_as_printed(table):
    """A row whose source printed tokens per second (the whole job) stores seconds per iteration =
    global batch x sequence / tokens per second, rounded to 0.01 s."""
    _, rows = table
    converted = [r for r in rows if "tokens_per_s" in r.get("as_printed", {})]
    assert converted
    for r in converted:
        f = r["flags"]
        secs = f["global-batch-size"] * f["seq-length"] / r["as_printed"]["tokens_per_s"]
        assert r["unit"] == "s_per_iteration" and r["measured"] == pytest.approx(secs, abs=0.005), r["id"]


def test_layout_rows_match_their_printed_layout(table):
    """Rows that keep the source's printed layout (DP, TP, PP, micro-batch, global batch) run that
    layout: DP = GPUs / (TP x PP) with 8 GPUs a node."""
    _, rows = table
    laid = [r for r in rows if "dp" in r.get("as_printed", {})]
    assert laid
    for r in laid:
        p, f = r["as_printed"], r["flags"]
        assert (f.get("tp", 1), f.get("pp", 1), f["micro-batch-size"], f["global-batch-size"]) == \
            (p["tp"], p["pp"], p["mbs"], p["gbs"]), r["id"]
        assert r["nodes"] * 8 == p["dp"] * p["tp"] * p["pp"], r["id"]


def test_table_spans_cards_stacks_batches_and_deep_pipelines(table):
    """Issue 49 item 4: >= 8 sources and 70 rows; A100 and H100; Megatron-LM, Megatron-DeepSpeed and
    NeMo / Transformer Engine; micro-batch 1 to 8; a pipeline of 32 stages or more."""
    sources, rows = table
    assert len(sources) >= 8 and len(rows) >= 70
    topologies = {r["topology"] for r in rows}
    assert any("a100" in t for t in topologies) and any("h100" in t for t in topologies)
    assert {r["stack"] for r in rows} >= {"apex-fused", "transformer_engine"}
    text = " ".join(s["title"] for s in sources.values())
    assert all(name in text for name in ("Megatron-LM", "Megatron-DeepSpeed", "NeMo"))
    mbs = {r["flags"].get("micro-batch-size", 1) for r in rows}
    assert {1, 2, 4, 8} <= mbs
    assert max(r["flags"].get("pp", 1) for r in rows) >= 32


def test_error_from_ratio_and_per_source_table():
    """The held-out / in-source table reads errors in the row's unit: a time 10% too long is +10%,
    a rate 10% too high +10%; the gap is the held-out median minus the in-source one."""
    from megatron_oases.sim.frontends.published import error_pct, per_source_table

    assert error_pct("s_per_iteration", 1 / 1.1) == 10.0 and error_pct("tflops_per_gpu", 1.1) == 10.0
    rows = [{"source": "a", "error_pct": 4.0, "in_source_error_pct": -1.0},
            {"source": "a", "error_pct": -6.0, "in_source_error_pct": 3.0},
            {"source": "b", "error_pct": 2.0, "in_source_error_pct": 2.0}]
    table = per_source_table(rows).splitlines()
    assert table[2] == "| `a` | 2 | 5.0% | 6.0% | 2.0% | 3.0% | +3.0 |"
    assert table[-1] == "| **all** | 3 | 4.0% | 6.0% | 2.0% | 3.0% | +2.0 |"
