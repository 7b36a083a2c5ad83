"""Chrome-trace export of a simulated iteration (open in https://ui.perfetto.dev).

Expands the per-stage templates at their pipeline placements: one process per stage (its
representative rank), threads compute / comm / p2p. Times in microseconds, as the format wants.
"""
from __future__ import annotations

import json
import os
from typing import Any

from .timeline import SimResult

TIDS = {"compute": 0, "comm": 1, "p2p": 2, "dp": 3}
"""Trace rows; ``dp``: the DP buckets of ``--overlap-grad-reduce``, beside the backward's TP collectives."""


def timeline_events(r: SimResult) -> list[dict[str, Any]]:
    """Every placed event as a dict: stage, chunk, stream, name, key, micro_batch, phase, chain, start, end (ms)."""
    out: list[dict[str, Any]] = []
    last = r.strategy.pp * r.strategy.virtual_stages - 1
    for p in r.placements:
        tmpl = r.templates[p.stage][p.chunk][0 if p.phase == "F" else 1]
        # a block stretched or shrunk by compute contention (sim.core.contention) scales its slots
        k = (p.end - p.start) / tmpl.duration \
            if tmpl.duration > 0 and abs(p.end - p.start - tmpl.duration) > 1e-9 else 1.0
        for sl in tmpl.slots:
            out.append({"stage": p.stage, "chunk": p.chunk, "stream": sl.stream, "name": sl.name, "key": sl.key,
                        "micro_batch": p.micro_batch, "phase": p.phase, "chain": sl.chain,
                        "start": p.start + k * sl.start, "end": p.start + k * (sl.start + sl.dur)})
        send_f, send_b = r.p2p_ms[p.stage][p.chunk]
        g = p.chunk * r.strategy.pp + p.stage
        if p.phase == "F" and g < last:
            out.append({"stage": p.stage, "chunk": p.chunk, "stream": "p2p", "name": "send_forward", "key": "",
                        "chain": 0, "micro_batch": p.micro_batch, "phase": "F", "start": p.end,
                        "end": p.end + send_f})
        if p.phase == "B" and g > 0:
            out.append({"stage": p.stage, "chunk": p.chunk, "stream": "p2p", "name": "send_backward", "key": "",
                        "chain": 0, "micro_batch": p.micro_batch, "phase": "B", "start": p.end,
                        "end": p.end + send_b})
    for x in r.tail:
        out.append({"stage": x.stage, "chunk": -1, "stream": x.stream, "name": x.name, "key": x.key, "chain": 0,
                    "micro_batch": -1, "phase": "STEP", "start": x.start, "end": x.end})
    return out


def chrome_trace(r: SimResult) -> dict[str, Any]:
    """``{"traceEvents": [...]}`` with ph "X" events and process/thread name metadata."""
    evs: list[dict[str, Any]] = []
    for st in r.stages:
        evs.append({"ph": "M", "name": "process_name", "pid": st.stage, "tid": 0,
                    "args": {"name": f"stage {st.stage} (rank {st.rank})"}})
        for name, tid in TIDS.items():
            if name == "dp" and not r.strategy.overlap_grad_reduce:
                continue  # the row is used only by the DP buckets
            evs.append({"ph": "M", "name": "thread_name", "pid": st.stage, "tid": tid, "args": {"name": name}})
    for e in timeline_events(r):
        evs.append({"ph": "X", "name": e["name"], "cat": e["phase"], "pid": e["stage"], "tid": TIDS[e["stream"]],
                    "ts": e["start"] * 1e3, "dur": (e["end"] - e["start"]) * 1e3,
                    "args": {"micro_batch": e["micro_batch"], "chunk": e["chunk"], "sub_batch": e["chain"],
                             "key": e["key"]}})
    return {"traceEvents": evs, "displayTimeUnit": "ms",
            "otherData": {"iteration_ms": r.iteration_ms, "strategy": repr(r.strategy)}}


def write_chrome_trace(r: SimResult, path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(r), f)


def plot_timeline(r: SimResult, path: str | os.PathLike) -> None:
    """PNG Gantt chart; needs matplotlib (imported only here)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plot_timeline needs matplotlib: pip install matplotlib") from None
    colors = {("compute", "F"): "tab:blue", ("compute", "B"): "tab:green", ("comm", "F"): "tab:orange",
              ("comm", "B"): "tab:red", ("comm", "STEP"): "tab:purple", ("compute", "STEP"): "tab:olive",
              ("dp", "STEP"): "tab:purple"}
    fig, ax = plt.subplots(figsize=(12, 0.6 + 0.5 * r.strategy.pp))
    for e in timeline_events(r):
        row = e["stage"] * len(TIDS) + TIDS[e["stream"]]
        ax.barh(row, e["end"] - e["start"], left=e["start"], height=0.8,
                color=colors.get((e["stream"], e["phase"]), "tab:gray"))
    ax.set_yticks([s * len(TIDS) + t for s in range(r.strategy.pp) for t in TIDS.values()],
                  [f"s{s} {n}" for s in range(r.strategy.pp) for n in TIDS])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
