"""The simulator's, planner's and mesh picker's printed outputs for a fixed set of configurations
(``scripts/golden_outputs.py``) are byte-identical to the ones recorded before the issue-36
refactor (``tests/data/golden_outputs.json``). A change that is meant to move a number rewrites the
file with ``python scripts/golden_outputs.py --write`` and says so in its commit."""
from __future__ import annotations

import json

import pytest

from script_modules import load_script

golden = load_script("scripts/golden_outputs.py")
WANT = json.loads(golden.GOLDEN.read_text(encoding="utf-8"))


def test_every_command_has_a_recorded_output():
    assert sorted(WANT) == sorted(golden.COMMANDS)


@pytest.mark.parametrize("name", sorted(golden.COMMANDS))
def test_output_unchanged(name):
    assert golden.run(golden.COMMANDS[name]) == WANT[name]
