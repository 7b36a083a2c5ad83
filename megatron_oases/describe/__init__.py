"""One description of every TP backend's layer, read by the runtime's contract tests, the planner
and the simulator (pure Python, no torch): ``ops`` (segments, collectives), ``megatron_1d``,
``atp_2d``, ``registry`` (backend name -> description, groups, parameters, memory) and
``event_key``."""
