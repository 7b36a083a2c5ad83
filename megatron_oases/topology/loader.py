"""Read a topology from a YAML file or by the name of a shipped example.

Accepting a bare name lets users say ``--topology dgx-a100`` without knowing where the package
is installed; every failure is a one-line TopologyError naming the file.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from .spec import Topology, TopologyError

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"


def list_examples() -> list[str]:
    """Names of the shipped example topologies (file stems under ``examples/``)."""
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.yaml"))


def example_path(name: str) -> Path:
    return EXAMPLES_DIR / f"{name}.yaml"


def load_topology(path_or_name: str | os.PathLike | Topology) -> Topology:
    """A Topology from a file path, a shipped example's name, or an already built Topology."""
    if isinstance(path_or_name, Topology):
        return path_or_name
    text = os.fspath(path_or_name)
    path = Path(text)
    if not path.is_file():
        if example_path(text).is_file() and os.sep not in text and not text.endswith((".yaml", ".yml")):
            path = example_path(text)
        else:
            raise TopologyError(f"no such file or shipped example; give a YAML path or one of: "
                                f"{', '.join(list_examples())}", source=text)
    return load_topology_file(path, display=text)


def load_topology_file(path: Path, display: str | None = None) -> Topology:
    """Parse one YAML file; syntax and schema errors both name ``display`` (default: the path)."""
    src = display or str(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TopologyError(f"cannot be read ({e.__class__.__name__}: {e}); check the path and permissions",
                            source=src) from None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise TopologyError(f"is not valid YAML{at}: {problem}; fix the syntax", source=src) from None
    if data is None:
        raise TopologyError("is empty; it needs at least 'name' and 'levels'", source=src)
    return Topology.from_dict(data, source=src)
