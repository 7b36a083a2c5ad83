"""The vocab-parallel cross-entropy's HBM traffic (``describe.head.cross_entropy_bytes_per_logit``,
issue 35): counted from Megatron's code, carried by the head's logits events, and checked against
the logits events measured on an H100 (our profiler, examples/gpu/h100-2026-11-26/prof-*.json)
and an H200 (published rows' shapes, examples/gpu/h200-2026-11-26/gpu_events_run*.json)."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import statistics

import pytest

from megatron_oases.describe.head import cross_entropy_bytes_per_logit, head_ops
from megatron_oases.sim.frontends.cli import device_model
from megatron_oases.topology.loader import load_topology

GPU_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpu")
KEY = re.compile(r"compute:(logits(?:\.bwd)?)\[b(\d+)s(\d+)h(\d+)v(\d+)t(\d+)_(\w+)\]")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def test_bytes_per_logit_follow_megatrons_code():
    """bf16 / fp16: the fp32 copy (2 + 4), max (4), -= max (8), exp (8), sum (4), div_ (8); backward
    mul_ (8) and the cast back (4 + 2). fp32: no copy and no cast."""
    assert cross_entropy_bytes_per_logit(2) == (38, 14)
    assert cross_entropy_bytes_per_logit(4) == (32, 8)


def test_logits_events_carry_them():
    b, s, h, v, t, e = 2, 64, 32, 1024, 2, 2
    ops = head_ops(b=b, s=s, h=h, v=v, t=t, e=e, first=False, last=True)
    act, logits = b * s * h * e, b * s * (v // t)
    assert ops.post_forward[0].elementwise_bytes == 2 * act + 38 * logits
    assert ops.pre_backward[0].elementwise_bytes == 2 * act + 14 * logits


def _measured() -> list[tuple[str, str, float]]:
    """(gpu, event key, measured ms) of every logits forward / backward event checked in."""
    out = []
    for path in sorted(glob.glob(os.path.join(GPU_DIR, "h100-2026-11-26", "prof-*-default.json"))):
        with open(path, encoding="utf-8") as f:
            out += [("h100-sxm", k, ms) for k, ms in json.load(f)["events"].items() if KEY.fullmatch(k)]
    for path in sorted(glob.glob(os.path.join(GPU_DIR, "h200-2026-11-26", "gpu_events_run*.json"))):
        with open(path, encoding="utf-8") as f:
            out += [("h200-sxm", e["event"], e["measured_ms"]) for e in json.load(f)["events"] if KEY.fullmatch(e["event"])]
    return out


def _priced(gpu: str, key: str, ce_bytes=None) -> float:
    name, *dims, dtype = KEY.fullmatch(key).groups()
    b, s, h, v, t = map(int, dims)
    e = DTYPE_BYTES[dtype]
    ops = head_ops(b=b, s=s, h=h, v=v, t=t, e=e, first=False, last=True)
    c = ops.post_forward[0] if name == "logits" else ops.pre_backward[0]
    if ce_bytes is not None:  # the same event with another count per logit
        c = dataclasses.replace(c, elementwise_bytes=2 * b * s * h * e + ce_bytes * b * s * (v // t))
    return device_model(load_topology("dgx-h100-ndr8"), gpu=gpu, profile=None).compute_ms(c)


def test_measured_logits_events_are_reproduced():
    """16 events on two cards: median |error| under 15% (the old count, 8 bytes a logit each way,
    was over 30%); forward + backward of each shape within 20%. The backward alone is priced low
    (down to -42% at hidden 512): it moves about 26 bytes a logit in bf16 where the code shows 14,
    the rest not located (docs/sim_validation.md, "Cross-entropy")."""
    events = _measured()
    assert len(events) == 16
    errs = [abs(_priced(g, k) / ms - 1) for g, k, ms in events]
    old = [abs(_priced(g, k, ce_bytes=8) / ms - 1) for g, k, ms in events]
    assert statistics.median(errs) < 0.15 < 0.30 < statistics.median(old)
    pairs: dict[tuple[str, str], list[float]] = {}
    for g, k, ms in events:
        shape = k.split("[")[1]
        pairs.setdefault((g, shape), [0.0, 0.0])
        pairs[(g, shape)][0] += _priced(g, k)
        pairs[(g, shape)][1] += ms
    assert len(pairs) >= 7
    for (g, shape), (priced, measured) in pairs.items():
        assert priced / measured == pytest.approx(1.0, abs=0.20), (g, shape)
