"""The pure simulator: a model and a strategy in, events, a timeline, memory and a search out.

Imports only describe/, pricing/, topology/ and flops.py of ours, and no torch or Megatron, so it
runs for 1,000+ GPUs on a laptop without the training stack (tests/test_import_graph.py)."""
