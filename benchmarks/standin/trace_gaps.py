"""Where the compute stream waits: per-stream busy time and the compute stream's idle gaps in a
Chrome trace of one step (torch.profiler's export), each gap labelled by what else ran in it.

The one-GPU overlap benchmark measures how far a schedule is from max(compute, stand-ins); this
says why. A gap in the compute stream while a side (stand-in) stream is busy is communication the
schedule exposed (the compute stream waits on a stand-in's done event); a gap while no stream is
busy is the host (kernel launches, Python, a synchronisation). Pure Python over the trace's
``traceEvents``: device events are the ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` categories,
each with ``args.stream``.
"""
from __future__ import annotations

import gzip
import json

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_trace(path: str) -> dict:
    """A Chrome trace from ``path`` (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def device_events(trace: dict) -> list[tuple[int, float, float, str]]:
    """(stream, start us, end us, name) of every device event, by start."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES and "stream" in e.get("args", {}):
            start = float(e["ts"])
            out.append((int(e["args"]["stream"]), start, start + float(e.get("dur", 0.0)), str(e.get("name", ""))))
    return sorted(out, key=lambda ev: ev[1])


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _overlap(span: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    a, b = span
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def summarize(trace: dict, min_gap_us: float = 20.0, top: int = 8) -> dict:
    """Busy ms per stream, the compute stream (the one running the most distinct kernels: the
    layers' many kinds, where a stand-in stream repeats one; not the busiest, since a stand-in
    stream slowed by contention can be busier, nor the one with the most events, since a copy
    stand-in can be many copies), and its idle gaps within the step:
    total, the part covered by another stream's work (exposed communication) and the rest (host),
    the ``top`` largest gaps with the kernels on either side, and each stretch of stand-in work
    (``side_stretches``, in step order: which collectives the schedule left exposed, and by how
    much)."""
    events = device_events(trace)
    if not events:
        return {"device_events": 0}
    by_stream: dict[int, list[tuple[float, float]]] = {}
    for s, a, b, _ in events:
        by_stream.setdefault(s, []).append((a, b))
    busy = {s: _union(iv) for s, iv in by_stream.items()}
    busy_ms = {s: sum(b - a for a, b in iv) / 1e3 for s, iv in busy.items()}
    kinds: dict[int, set[str]] = {}
    for s, _, _, name in events:
        kinds.setdefault(s, set()).add(name)
    compute = max(by_stream, key=lambda st: (len(kinds[st]), len(by_stream[st])))
    others = _union([iv for s, ivs in busy.items() if s != compute for iv in ivs])
    window = (events[0][1], max(e[2] for e in events))
    mine = [e for e in events if e[0] == compute]
    gaps, prev_end, prev_name = [], window[0], "(step start)"
    for _, a, b, name in mine + [(compute, window[1], window[1], "(step end)")]:
        if a - prev_end >= min_gap_us:
            covered = _overlap((prev_end, a), others)
            gaps.append({"start_us": prev_end - window[0], "ms": (a - prev_end) / 1e3,
                         "side_busy_ms": covered / 1e3, "after": prev_name, "before": name})
        if b > prev_end:
            prev_end, prev_name = b, name
    total = sum(g["ms"] for g in gaps)
    exposed = sum(g["side_busy_ms"] for g in gaps)
    idle = [(window[0] + g["start_us"], window[0] + g["start_us"] + g["ms"] * 1e3) for g in gaps]
    # each stretch of stand-in work (stand-ins back to back are one) and the compute idle in it
    stretches = [{"index": i, "start_ms": round((a - window[0]) / 1e3, 3), "ms": round((b - a) / 1e3, 3),
                  "exposed_ms": round(_overlap((a, b), idle) / 1e3, 3)} for i, (a, b) in enumerate(others)]
    return {"device_events": len(events), "step_ms": (window[1] - window[0]) / 1e3,
            "busy_ms_by_stream": {str(s): round(v, 3) for s, v in sorted(busy_ms.items())},
            "compute_stream": compute, "compute_idle_ms": round(total, 3),
            "idle_while_side_busy_ms": round(exposed, 3), "idle_with_nothing_running_ms": round(total - exposed, 3),
            "largest_gaps": sorted(gaps, key=lambda g: -g["ms"])[:top],
            "side_stretches": stretches}


def format_summary(name: str, s: dict) -> str:
    """Two lines for the benchmark's report."""
    if not s.get("device_events"):
        return f"{name}: no device events in the trace (CPU run)"
    return (f"{name}: step {s['step_ms']:.2f} ms on the device, compute stream {s['compute_stream']} idle "
            f"{s['compute_idle_ms']:.2f} ms ({s['idle_while_side_busy_ms']:.2f} while a stand-in ran, "
            f"{s['idle_with_nothing_running_ms']:.2f} with nothing running); busy ms by stream "
            f"{s['busy_ms_by_stream']}")
