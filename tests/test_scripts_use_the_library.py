"""Scripts import the installed library (scripts/setup.sh installs it; the GPU check and SLURM
scripts set PYTHONPATH): none edits sys.path, and none imports another script, so a shared
helper lives in a package (``benchmarks.harness`` for the benchmark harness, installed beside
the library)."""
import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "*.py")))
NAMES = {os.path.splitext(os.path.basename(p))[0] for p in SCRIPTS}


def _problems(path: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
            out.append(f"line {node.lineno}: sys.path")
        if isinstance(node, ast.Import):
            out += [f"line {node.lineno}: imports script {a.name}" for a in node.names if a.name in NAMES]
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in NAMES:
            out.append(f"line {node.lineno}: imports script {node.module}")
    return out


def test_scripts_neither_edit_sys_path_nor_import_each_other():
    bad = {os.path.basename(p): _problems(p) for p in SCRIPTS}
    assert not {k: v for k, v in bad.items() if v}
