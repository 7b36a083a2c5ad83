"""CUDA timing stand-ins for tests on a machine without a GPU."""
from __future__ import annotations


def fake_cuda_events(monkeypatch, elapsed_ms: float) -> list:
    """``torch.cuda.Event`` and ``torch.cuda.current_stream`` replaced for one test: every event
    times ``elapsed_ms``, and ``current_stream(device)`` is the string ``"stream of <device>"``.
    Returns the list of streams the events were recorded on (what the tests check: the stream of
    the device the work ran on)."""
    import torch

    recorded = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            recorded.append(stream)

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return elapsed_ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    return recorded
