"""What measures or fits the simulator's prices: the profiler, the emulated-cluster profile, the
torch workloads behind each event, and the fit against published runs. Imports the core and torch
(lazily where it can), never the front ends."""
