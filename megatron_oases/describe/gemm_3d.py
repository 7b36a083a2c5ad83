"""What one 3-D GEMM moves: the 3-D paper's §3.1.2 cost, in closed form (Bian et al. 2021).

``Linear3D`` (``layers/linear3d.py``) multiplies ``[M, N]`` by ``[N, K]`` on a cube of ``p^3``
ranks: forward it all-gathers its input block and its weight block and reduce-scatters its
output, three collectives of ``p`` ranks that together move ``(MN + NK + MK) / p^3`` elements
per rank; its backward runs two such GEMMs (dgrad and wgrad). The cube's layer description
(``describe/cube_3d.py``) lists those collectives one by one for the planner and the simulator;
this is the paper's sum the runtime's measured bytes (``tests/test_linear3d.py``,
``tests/test_tp3d_model.py``), the described layer (``tests/test_describe_3d.py``) and the
benchmarks' prediction (``benchmarks.harness.predicted_layer_mb``) are held to.
"""
from __future__ import annotations

GEMMS_PER_LINEAR = 3
"""Forward, dgrad and wgrad: each a 3-D GEMM of the same three-collective cost (§3.1.2)."""


def gemm_3d_bytes(m: int, n: int, k: int, p: int, elem_size: int = 4) -> dict:
    """The §3.1.2 cost of one forward GEMM (M x N by N x K on p^3 ranks).

    "Each forward algorithm uses all-gather and reduce-scatter operations to move
    (MN + NK + MK) / p^3 across p processors": each rank contributes its three shards, of
    (MN + NK + MK) / p^3 elements in total, to three collectives of p ranks each. With ring
    collectives a rank sends (p - 1) of the p shards of each, hence the wire bytes below.
    """
    shard = (m * n + n * k + m * k) / p ** 3
    return {"collectives": 3, "group_size": p, "shard_bytes_per_rank": shard * elem_size,
            "payload_bytes": p * shard * elem_size,
            "wire_bytes_per_rank": (p - 1) * shard * elem_size}
