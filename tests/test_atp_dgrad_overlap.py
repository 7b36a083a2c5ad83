"""When ATP's linears overlap the input-gradient all-reduce with the weight gradient (issue 49 item 3).

ATP's paper (§4.2) launches each backward dX all-reduce before the weight-gradient GEMM. Ours does
so only with ``--atp-chunks`` > 1 (``_OverlappedMeshLinear``); at the default 1 the all-reduce is
``copy_to_group``'s backward, blocking, after the linear's whole backward. The description
(``describe.atp_2d``) therefore prices no overlap, and the simulator refuses ``--atp-chunks`` > 1.
These tests pin the runtime half of that statement, in one process: the collective is replaced by
a recorder (no process group), so what is checked is how it is issued, not a timing.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_oases.layers import atp_linear
from megatron_oases.parallel import collectives as C


class _Work:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append("wait")


@pytest.fixture
def issued(monkeypatch):
    """Every all-reduce as ("all_reduce", group, async_op), and each wait on an async one."""
    log: list = []

    def all_reduce(x, group, async_op=False):
        log.append(("all_reduce", group, async_op))
        return _Work(log) if async_op else None

    monkeypatch.setattr(C, "all_reduce", all_reduce)
    return log


def _weight_grad_hook(log):
    """Logs when autograd hands the weight its gradient (after the backward function returns)."""
    return lambda g: log.append("wgrad")


def test_chunks_1_reduces_dx_after_the_linear_blocking(issued):
    x = torch.randn(4, 3, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    y = C.reduce_from_group(F.linear(C.copy_to_group(x, "out-axis"), w), "in-axis")  # _MeshLinear, chunks 1
    issued.clear()
    y.sum().backward()
    assert issued == [("all_reduce", "out-axis", False)]


@pytest.mark.parametrize("chunks", [2, 4])
def test_chunks_over_1_launch_dx_before_the_weight_gradient(issued, chunks):
    x = torch.randn(4, 3, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    y = atp_linear._OverlappedMeshLinear.apply(x, w, None, "in-axis", "out-axis", chunks, 0)
    assert issued == [("all_reduce", "in-axis", True)] * chunks + ["wait"] * chunks
    issued.clear()
    w.register_hook(_weight_grad_hook(issued))
    y.sum().backward()
    # launched async, waited on inside the same backward that computes dW: the GEMM runs between
    assert issued == [("all_reduce", "out-axis", True), "wait", "wgrad"]
    torch.testing.assert_close(w.grad, (torch.ones(4, 3, 6).reshape(-1, 6).t() @ x.detach().reshape(-1, 8)))
