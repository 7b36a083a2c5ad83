"""The ATP paper's Eq. 2 and its §5.4 closed form: the tests' oracle for the mesh picker, not its
price (Cheng et al. 2023). ``megatron-oases mesh`` / ``--atp-mesh auto`` price ``describe``'s ATP
layer of the run (``plan.atp_mesh.layer_collectives``: FFN size, SwiGLU, GQA, norms); at GPT-2's
layer (ffn = 4h) the two agree, which ``tests/test_atp_mesh.py`` and ``tests/test_sim.py`` check."""
from __future__ import annotations

import math

from megatron_oases.describe.shapes import GPTShape


ATP_LAYER_ALLREDUCES: tuple[tuple[str, int, int, int], ...] = (
    ("f1 qkv (column-first)", 2, 3, 1),
    ("f2 attn-out (row-first)", 1, 1, 2),
    ("f3 fc1 (column-first)", 2, 4, 1),
    ("f4 fc2 (row-first)", 1, 1, 2),
)
"""Eq. 2 per layer: (collective, mesh axis it all-reduces on, width in units of h, axis that shards
it), each once forward and once backward (Eq. 2's factor 2). GPT-2's layer at ffn = 4h only: the
search prices the described layer instead (``layer_collectives``); the tests check that the two
agree there."""


def eq2_t_comm(model: GPTShape, d1: int, d2: int, b1_GBps: float, b2_GBps: float) -> float:
    """Eq. 2: 2 L b s (3h/(d1 B2) + h/(d2 B1) + 4h/(d1 B2) + h/(d2 B1)) bytes over GB/s, in seconds
    (the oracle; it reads no FFN size, heads or variant)."""
    d, bw = {1: d1, 2: d2}, {1: b1_GBps, 2: b2_GBps}
    per_token = sum(width * model.hidden_size / (d[shard] * bw[axis])
                    for _, axis, width, shard in ATP_LAYER_ALLREDUCES if not math.isinf(bw[axis]))
    steps = 2 * model.num_layers * model.micro_batch_size * model.seq_length
    return steps * per_token * model.bytes_per_element / 1e9


def closed_form_t_comm(model: GPTShape, d1: int, d2: int, group_GBps: float) -> float:
    """§5.4 for B1' = B2' = GroupBW: 2Lbsh/GroupBW * (14 d2 + 4 d1 - 18) / (d1 d2), in seconds (the
    oracle, as ``eq2_t_comm``)."""
    delta = 2 * model.num_layers * model.micro_batch_size * model.seq_length * model.hidden_size / group_GBps
    return delta * (14 * d2 + 4 * d1 - 18) / (d1 * d2) * model.bytes_per_element / 1e9
