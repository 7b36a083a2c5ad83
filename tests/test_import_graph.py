"""The package's layering, checked on its import graph (every import statement, including those
inside functions): no import cycles among our modules, the planner never imports the simulator
nor ``parallel``, the layer descriptions and pricing stay below both, and the simulator's core
reaches no torch, runtime, trainer flags or calibration (../shared/design.md)."""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

PKG = pathlib.Path(__file__).resolve().parents[1] / "megatron_oases"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (a name resolves to its longest known prefix)."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = mod.split(".")
                if node.level:
                    base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + ".") and t != PKG.name:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _edges_from(graph, src_pkg: str, dst_pkg: str) -> list[tuple[str, str]]:
    return sorted((m, t) for m, ts in graph.items() if m.startswith(src_pkg + ".")
                  for t in ts if t == dst_pkg or t.startswith(dst_pkg + "."))


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_planner_does_not_import_the_simulator():
    assert _edges_from(import_graph(), "megatron_oases.plan", "megatron_oases.sim") == []


def test_the_planner_does_not_import_the_runtimes_process_groups():
    """``plan`` reads the rules it shares with ``parallel`` (the TP split, the batch split, the
    backend records) from ``describe`` and its error class from ``errors``."""
    assert _edges_from(import_graph(), "megatron_oases.plan", "megatron_oases.parallel") == []


def test_the_error_class_sits_below_everything():
    assert import_graph()["megatron_oases.errors"] == set()


def test_descriptions_and_pricing_sit_below_planner_and_simulator():
    g = import_graph()
    for low in ("megatron_oases.describe", "megatron_oases.pricing"):
        for high in ("megatron_oases.plan", "megatron_oases.sim", "megatron_oases.runtime",
                     "megatron_oases.layers", "megatron_oases.schedules"):
            assert _edges_from(g, low, high) == [], (low, high)
    assert _edges_from(g, "megatron_oases.describe", "megatron_oases.pricing") == []


def test_descriptions_import_no_torch():
    for path in (PKG / "describe").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(n == "torch" or n.startswith("torch.") for n in names), path


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


SIM_CORE = "megatron_oases.sim.core"
#: What the pure simulator may never reach, even through another module of ours.
SIM_CORE_NEVER = ("megatron_oases.runtime", "megatron_oases.schedules", "megatron_oases.layers",
                  "megatron_oases.train_args", "megatron_oases.train", "megatron_oases.specs",
                  "megatron_oases.sim.calibrate", "megatron_oases.sim.frontends")


def _reachable(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def test_the_simulator_core_reaches_no_runtime_trainer_or_calibration():
    g = import_graph()
    core = [m for m in g if m == SIM_CORE or m.startswith(SIM_CORE + ".")]
    assert len(core) > 5
    bad = sorted(m for m in _reachable(g, core) for never in SIM_CORE_NEVER
                 if m == never or m.startswith(never + "."))
    assert bad == []


def test_the_simulator_core_imports_no_torch_or_megatron():
    for path in (PKG / "sim" / "core").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert not any(n.split(".")[0] in ("torch", "megatron") for n in names), path


def test_calibration_does_not_import_the_front_ends():
    assert _edges_from(import_graph(), "megatron_oases.sim.calibrate", "megatron_oases.sim.frontends") == []


def test_importing_the_simulator_core_loads_no_torch():
    mods = sorted(_module_name(p) for p in (PKG / "sim" / "core").rglob("*.py"))
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(PKG.parent), os.environ.get("PYTHONPATH", "")])})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_run_config_does_not_import_the_planner():
    """``run_config`` sits below everything that reads a run (its one constant from the planner,
    ``DEFAULT_MIN_GAIN``, lives in ``run_config.py`` now)."""
    assert _edges_from(import_graph(), "megatron_oases.run_config", "megatron_oases.plan") == []
    assert not [t for t in import_graph()["megatron_oases.run_config"]
                if t == "megatron_oases.plan" or t.startswith("megatron_oases.plan.")]


def test_the_runtime_does_not_import_the_run_config():
    """``runtime/`` is where code runs; it takes the fields it needs, never the run's config type."""
    assert _edges_from(import_graph(), "megatron_oases.runtime", "megatron_oases.run_config") == []


def test_the_library_never_imports_the_benchmark_harness():
    """``benchmarks/`` (the harness: counting trainer, one-GPU stand-ins) sits beside the package
    and imports it; ``megatron_oases`` is what a run installs and must run without it."""
    bad = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(PKG.parent)}:{node.lineno}" for n in names if n.split(".")[0] == "benchmarks"]
    assert bad == []
