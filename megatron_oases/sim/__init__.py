"""megatron_oases.sim: a DistSim-style simulator fed by the shared layer description.

events.py (model + strategy -> per-stage events, deduplicated), device_model.py (analytical
prices or a measured ProfileDB), timeline.py (TP streams -> pipeline -> DP), trace.py (Chrome
trace / PNG), cli.py (``sim_main``). See docs/sim.md.
"""
