"""The simulator's front ends: ``megatron-oases sim`` and ``profile``, ``sim --predict`` (trainer
flags in) and the published runs read by the validation scripts. Nothing in sim/ imports them."""
