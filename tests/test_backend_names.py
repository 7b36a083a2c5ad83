"""Outside the TP backends' own modules nothing compares a backend's name (``== "atp"``,
``in ("megatron", "3d")``, ``match``): consumers ask the record (``describe/backends.py``) what
they need, so a new backend is one row (``tests/test_fake_backend.py``). Counted on the package's
syntax trees (as ``tests/test_import_graph.py`` counts imports); the few left are listed in the
budget with their reason."""
from __future__ import annotations

import ast
import pathlib

from megatron_oases.describe.backends import BACKENDS

PKG = pathlib.Path(__file__).resolve().parents[1] / "megatron_oases"
OWN = {"describe/backends.py", "describe/megatron_1d.py", "describe/atp_2d.py", "describe/atp_meshes.py",
       "describe/cube_3d.py"}
"""The backends' own modules: the records and the description modules they point into."""
BUDGET = 4
"""At most this many comparisons may remain elsewhere (issue 47): today one,
``megatron_lm/flags.py``'s refusal of ``--overlap-param-gather`` with ATP's Oases tape (that
tape calls the modules' parts, so Megatron's parameter-gather hooks never fire: a property of
one runtime tape, not of the layout)."""


def _names_in(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in BACKENDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_in(e) for e in node.elts)
    return False


def name_comparisons(tree: ast.AST) -> list[int]:
    """Line numbers of comparisons and ``match`` cases against a backend name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_in(x) for x in (node.left, *node.comparators)):
            out.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _names_in(node.value):
            out.append(node.value.lineno)
    return out


def test_the_counter_finds_each_form():
    code = 'a == "atp"\n"3d" != b\nc in ("megatron", "x")\nmatch d:\n    case "atp": pass\ne == "atpx"\n'
    assert name_comparisons(ast.parse(code)) == [1, 2, 3, 5]


def test_no_module_outside_the_backends_compares_their_names():
    found = [f"{path.relative_to(PKG)}:{line}" for path in sorted(PKG.rglob("*.py"))
             if path.relative_to(PKG).as_posix() not in OWN
             for line in name_comparisons(ast.parse(path.read_text(encoding="utf-8")))]
    assert len(found) <= BUDGET, found
