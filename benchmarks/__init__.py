"""The benchmark harness, beside the library and not part of it (issue 47 item 6).

``megatron_oases`` is what a run installs and trains with; this package is what measures it:
``harness`` (what the ``scripts/bench_*.py`` share, and the counting trainer) and ``standin``
(the one-GPU overlap benchmark). It imports ``megatron_oases``; ``megatron_oases`` never imports
it (``tests/test_import_graph.py``). ``setup.py`` installs it as its own top-level package, so the
scripts and tests import it without ``sys.path`` edits.
"""
