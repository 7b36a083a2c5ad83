"""The user-facing configuration error, below every package that raises it.

``parallel`` (the runtime's degree checks), ``plan`` (the planner's inputs and plan files) and the
trainer's validation all refuse a launch with one line naming the flag and the fix; they share this
class so one ``except ConfigError`` catches them all, and so ``plan`` need not import ``parallel``
for it (``tests/test_import_graph.py``)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the flag and the fix."""
