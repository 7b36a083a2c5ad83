"""megatron_oases.sim: a DistSim-style simulator fed by the shared layer description.

Three folders, imports pointing one way (frontends -> calibrate -> core; tests/test_import_graph.py):
core/ (the pure simulator: strategy, events, schedules, timeline, contention, memory, search,
trace; no torch, no runtime, no trainer flags), calibrate/ (what measures or fits the prices:
profiler, emulated profile, workloads, cross-validation) and frontends/ (``megatron-oases sim`` /
``profile``, ``sim --predict``, the published runs). See docs/sim.md.
"""
