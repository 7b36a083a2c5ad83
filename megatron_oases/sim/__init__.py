"""megatron_oases.sim: a DistSim-style simulator fed by the shared layer description.

events.py (model + strategy -> per-stage, per-chunk events, deduplicated), backends.py (Megatron
1-D / ATP 2-D layers), schedules.py (GPipe, 1F1B, interleaved orders), device_model.py (analytical
prices or a measured ProfileDB), timeline.py (TP streams -> pipeline -> DP + optimizer), memory.py,
search.py (strategy search), profiler.py + workloads.py (measure events), predict.py (trainer
flags -> predicted step time), trace.py (Chrome trace / PNG), cli.py / profile_cli.py
(``megatron-oases sim`` / ``profile``). See docs/sim.md.
"""
