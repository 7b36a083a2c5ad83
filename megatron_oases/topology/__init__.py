"""Cluster interconnect descriptions (one YAML format) and a namespace-based emulator for them.

The emulator lives in ``megatron_oases.topology.emulate`` and is imported lazily because it
needs root and Linux networking tools that a planner or simulator never needs.
"""
from .loader import EXAMPLES_DIR, list_examples, load_topology, load_topology_file
from .spec import AllReduceCalibration, Calibration, Level, Topology, TopologyError

__all__ = [
    "AllReduceCalibration", "Calibration", "EXAMPLES_DIR", "Level", "Topology", "TopologyError",
    "list_examples", "load_topology", "load_topology_file",
]
