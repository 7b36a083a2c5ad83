"""The README as a newcomer meets it: its two commands first (CI runs the second), every relative
link in it, in docs/ and in the other READMEs resolving, headings included, and its picture
redrawn from the committed measurements by ``scripts/readme_chart.py``."""
from __future__ import annotations

import glob
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMANDS = (
    "```bash",
    "bash scripts/setup.sh && .venv/bin/megatron-oases train --nproc-per-node 4 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --recompute-granularity full "
    "--recompute-method uniform --train-iters 10",
    "bash scripts/setup.sh && .venv/bin/python -m pytest -q tests",
    "```",
)

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _prose_lines(text: str, keep_code: bool = False):
    """(line number, line) outside fenced code blocks, inline code removed unless ``keep_code``."""
    fenced = False
    for n, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line if keep_code else _CODE_SPAN.sub("", line)


def _anchors(path: str) -> set[str]:
    """GitHub's heading anchors of a Markdown file (lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` for repeats)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(_read(path), keep_code=True):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").strip().lower()).replace(" ", "-")
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    return out


KNOWN_BROKEN: dict[str, str] = {}
"""Files with a broken link that another change must fix (file -> reason); strict xfail, so the
fix removes the entry."""


def _markdown_files() -> list:
    files = [os.path.join(ROOT, p) for p in ("README.md", "examples/README.md", "patches/README.md")]
    files += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [pytest.param(f, marks=pytest.mark.xfail(reason=KNOWN_BROKEN[rel], strict=True))
            if (rel := os.path.relpath(f, ROOT)) in KNOWN_BROKEN else f for f in files]


def test_readme_opens_with_the_two_commands_ci_runs():
    lines = _read(os.path.join(ROOT, "README.md")).split("\n")
    assert lines[0].startswith("# ")
    assert tuple(lines[2:2 + len(COMMANDS)]) == COMMANDS
    assert COMMANDS[2] in _read(os.path.join(ROOT, ".ci", "run"))


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(path):
    broken = []
    for n, line in _prose_lines(_read(path)):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(dest):
                broken.append(f"line {n}: {target} (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                broken.append(f"line {n}: {target} (no heading #{anchor})")
    assert not broken, f"{os.path.relpath(path, ROOT)}: " + "; ".join(broken)


def _chart_module():
    spec = importlib.util.spec_from_file_location("readme_chart", os.path.join(ROOT, "scripts", "readme_chart.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_chart_draws_the_numbers_docs_gpu_reports():
    """The figures docs/gpu.md's H100 tables state, read back from the committed JSON."""
    data = _chart_module().chart_data()
    steps = {k: round(v, 1) for k, v in data["steps"].items()}
    assert steps == {("compute", "default"): 100.5, ("sleep", "default"): 177.6, ("copy", "default"): 197.5,
                     ("compute", "oases"): 107.7, ("sleep", "oases"): 139.7, ("copy", "oases"): 208.8}
    assert {k: round(100 * v, 1) for k, v in data["mfu"].items()} == {
        ("auto", "default"): 46.8, ("auto", "oases"): 46.9, ("local", "default"): 20.7, ("local", "oases"): 20.7}
    assert round(data["speedup"]["sleep"], 2) == 1.27


def test_the_chart_regenerates_from_the_committed_data(tmp_path):
    pytest.importorskip("matplotlib")
    mod = _chart_module()
    out = tmp_path / "chart.svg"
    assert mod.main(["--out", str(out)]) == 0
    svg = out.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    for label in ("177.6 ms", "139.7 ms", "46.9%", "Oases 1.27x faster"):
        assert label in svg  # svg.fonttype none: text stays text
    readme = _read(os.path.join(ROOT, "README.md"))
    assert "](docs/img/h100_oases.svg)" in readme and os.path.exists(mod.OUT)
