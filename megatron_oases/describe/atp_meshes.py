"""ATP's candidate meshes for a TP size, and the one rule every mesh obeys: d1 x d2 = TP.

One home for both, so that the planner (``plan/graph.py``), the simulator's search
(``sim/core/search.py``), the mesh picker (``plan/atp_mesh.py``), the trainer's and Megatron-LM's flag
validation (``train_args.validate_atp_args``) and the runtime's ``parallel/mesh.DeviceMesh`` offer
the same meshes and refuse a wrong one in the same words. (They used to enumerate three different
sets: the planner powers of two only, so it never tried 2 x 3 at TP 6.)
"""
from __future__ import annotations

from typing import Sequence


def atp_meshes(tp: int, *, with_1d: bool) -> tuple[tuple[int, int], ...]:
    """Every ``DeviceMesh(d1, d2)`` with ``d1 x d2 = tp`` and ``d1, d2 >= 1``, by ``d2`` ascending.

    Why every divisor and not powers of two: ATP's layout (paper §3.1-3.2) and our runtime
    (``parallel/mesh.DeviceMesh``, the ``layers/atp_*`` modules) need only ``d1 x d2 = TP``;
    whether a model's hidden size, heads and FFN split over a mesh is the layer description's
    refusal (``atp_2d.atp_2d_gpt_layer``), per model, not a property of the candidate set.

    - ``d1 = 1`` (``(1, tp)``) is in for every consumer: the hidden states are split ``tp`` ways
      on axis 2 and every all-reduce runs on axis 2, a layout Megatron 1-D does not have.
    - ``d2 = 1`` (``(tp, 1)``) is Megatron 1-D's layout (whole hidden states between layers, one
      all-reduce per block on the TP group). ``with_1d=True`` keeps it first: the mesh picker
      prices it as the baseline a 2-D mesh must beat by ``min_gain``, and ``--tp-backend atp
      --atp-mesh TP,1`` runs. The planner, the simulator's search (``atp_2d.atp_2d_layouts``)
      and the mesh picker offer it as ATP's layer, which is not Megatron 1-D's (its norms keep
      more); ``with_1d=False`` leaves it out.
    """
    return tuple((tp // d2, d2) for d2 in range(1 if with_1d else 2, tp + 1) if tp % d2 == 0)


def atp_mesh_refusal(mesh: Sequence[int] | None, tp: int) -> str:
    """Why ``mesh`` cannot be ATP's mesh of a TP group of ``tp`` ranks; "" when it can.

    Every check of the rule returns this text (each in its own exception class), so a wrong
    ``--atp-mesh`` reads the same from the trainer, Megatron-LM's flags, the runtime, the planner
    and the mesh picker; it names the flag and the meshes that would do."""
    if mesh is None or len(mesh) != 2:
        return f"--atp-mesh must be two sizes D1,D2 with D1 x D2 = --tensor-model-parallel-size {tp} (got {mesh!r})"
    d1, d2 = mesh
    if d1 >= 1 and d2 >= 1 and d1 * d2 == tp:
        return ""
    fits = " ".join(f"{a},{b}" for a, b in atp_meshes(tp, with_1d=True)) or "none"
    if d1 < 1 or d2 < 1:
        return f"--atp-mesh {d1},{d2}: both mesh axes must be >= 1 (one of: {fits})"
    return f"--atp-mesh {d1},{d2}: d1 x d2 = {d1 * d2} must equal --tensor-model-parallel-size {tp} (one of: {fits})"
