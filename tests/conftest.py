"""Shared test helpers: spawn gloo ranks (per-rank deadline) and compare with tolerances."""
from __future__ import annotations

import os
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

# The suite runs CPU ranks on gloo. On a machine with a GPU the trainer would pick CUDA + NCCL,
# and NCCL refuses two ranks on one GPU (seen on a one-GPU H200): hide the GPUs before anything
# initialises CUDA, so the suite runs there as it does on CPU (docs/gpu.md, scripts/gpu_check.sh).
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Our modules a rank imports after the fork, preloaded once in the forkserver (tests/rank_preload.py).
from tests.rank_preload import extend_forkserver_preload  # noqa: E402

extend_forkserver_preload()


def max_rel_diff(a, b) -> float:
    """max |a - b| / max(|b|, tiny) over paired floats (or tensors, element-wise on the max norm)."""
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def assert_same_training(got: dict, ref: dict, *, tol: float, what: str = "stock",
                         iterations: int | None = None) -> None:
    """Per iteration: losses, grad norms (when both runs have them) and every global gradient
    (``{"losses": [...], "norms": [...], "grads": [{key: tensor}]}``) agree within ``tol``."""
    if iterations is not None:
        assert len(got["grads"]) == len(ref["grads"]) == iterations
    for field in ("losses", "norms"):
        for it, (a, b) in enumerate(zip(got.get(field) or [], ref.get(field) or []), 1):
            assert abs(a - b) / abs(b) <= tol, f"iteration {it}: {field[:-1]} {a} vs {what} {b}"
    for it, (a, b) in enumerate(zip(got["grads"], ref["grads"]), 1):
        assert a.keys() == b.keys()
        for key in a:
            d = max_rel_diff(a[key], b[key])
            assert d <= tol, f"iteration {it}: gradient of {key} differs from {what} by {d:.3g}"


@pytest.fixture
def on_ranks():
    """``on_ranks(fn, world_size, *args, timeout_s=...)`` -> list of per-rank results."""
    from megatron_oases.runtime.spawn import run_on_ranks

    def call(fn, world_size, *args, timeout_s: float = 120.0, **kwargs):
        return run_on_ranks(fn, world_size, args=args, kwargs=kwargs, timeout_s=timeout_s)

    return call


# The fast tier (`pytest -m "not slow" tests`, README): the tests named in tests/slow_tests.txt
# are marked `slow`; scripts/tier_tests.py writes that list from a `--durations=0` run, keeping
# every test file's fastest test in the fast tier so that the tier still touches every module.
SLOW_LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")


def _slow_node_ids() -> set[str]:
    if not os.path.exists(SLOW_LIST):
        return set()
    with open(SLOW_LIST, encoding="utf-8") as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: outside the fast tier (tests/slow_tests.txt; run with -m 'not slow')")


def pytest_collection_modifyitems(config, items):
    slow = _slow_node_ids()
    for item in items:
        node = tier_node_id(item)
        if node in slow or node.split("[", 1)[0] in slow:
            item.add_marker(pytest.mark.slow)


def tier_node_id(item) -> str:
    """``tests/<file>::<test>[<params>]`` whatever pytest's rootdir (the list's key)."""
    rel = os.path.relpath(str(item.path), os.path.dirname(SLOW_LIST)).replace(os.sep, "/")
    return "tests/" + rel + item.nodeid[item.nodeid.index("::"):]
