"""One description of every TP backend's layer, read by the runtime's contract tests, the planner
and the simulator (pure Python, no torch): ``ops`` (segments, collectives), ``megatron_1d``,
``atp_2d``, ``cube_3d`` (each backend's layer and its record's pieces), ``backends`` (the table
of backend records), ``registry`` (backend name -> description, groups, parameters, memory) and
``event_key``."""
