"""Write tests/slow_tests.txt, the tests outside the fast tier, from a timed run of the suite.

    python -m pytest -q tests --durations=0 -p no:cacheprovider > run.log
    python scripts/tier_tests.py run.log --budget-s 180

Several logs merge per test file, later ones winning: ``tier_tests.py full.log files.log`` takes
the files ``files.log`` timed (a run of the test files that changed) from it and every other
file from ``full.log``, so one changed file does not need another run of the whole suite. A test
the later run skipped has no timing there and leaves the list: time a file where it skips
nothing, or leave it out of the later log.

Tests are taken into the slow list, slowest first, until the rest add up to at most
``--budget-s`` seconds of the timed run; each test file keeps its fastest test in the fast tier
when that test takes at most ``--keep-s`` seconds, so the tier still imports and exercises every
module the suite reaches. Timings from a loaded machine are inflated alike, so run it on an idle
one (the budget is the run's seconds, not a promise for another machine). Prints the split.

A fixture a test fetches with ``request.getfixturevalue`` (or a result a file caches across its
tests) is charged to the first test that needs it, which then goes slow, while the fast tests
that need it too pay it in the fast tier, unseen here. ``--fast-log`` takes a timed run of the
fast tier (``pytest -m "not slow" --durations=0``): each fast test that took more than
``--keep-s`` longer there than in the full run goes slow too (bar its file's keeper); run the
fast tier again until none does.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW_LIST = os.path.join(ROOT, "tests", "slow_tests.txt")
# pytest's --durations lines: "12.34s call     tests/test_x.py::test_y[p]"
DURATION = re.compile(r"^\s*([\d.]+)s\s+(setup|call|teardown)\s+(\S+::\S+.*?)\s*$")


def test_seconds(log_lines) -> dict[str, float]:
    """Seconds per test (setup + call + teardown) from a --durations=0 log."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for line in log_lines:
        m = DURATION.match(line)
        if m:
            node = m.group(3)
            node = node[node.index("tests/"):] if "tests/" in node else "tests/" + node
            seconds[node] += float(m.group(1))
    return dict(seconds)


def shared_setup_files(log_lines, keep_s: float) -> set[str]:
    """Test files one of whose tests spends more than ``keep_s`` in setup: a module-scoped
    fixture, which pytest charges to the file's first test but every test of the file needs, so
    keeping any of them in the fast tier costs the fixture; such a file goes to the slow tier whole."""
    files = set()
    for line in log_lines:
        m = DURATION.match(line)
        if m and m.group(2) == "setup" and float(m.group(1)) > keep_s:
            node = m.group(3)
            files.add((node[node.index("tests/"):] if "tests/" in node else "tests/" + node).split("::", 1)[0])
    return files


def merge_by_file(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each test file's seconds from the last run that timed it (a test removed from a file
    leaves with the file's older timings)."""
    merged: dict[str, float] = {}
    for seconds in runs:
        files = {node.split("::", 1)[0] for node in seconds}
        merged = {n: s for n, s in merged.items() if n.split("::", 1)[0] not in files}
        merged.update(seconds)
    return merged


def hidden_costs(seconds: dict[str, float], fast_seconds: dict[str, float], keep_s: float) -> set[str]:
    """The tests of a fast-tier run that took more than ``keep_s`` longer there than in the full
    run: they paid a shared fixture the full run charged to a test now slow."""
    return {node for node, s in fast_seconds.items() if s - seconds.get(node, 0.0) > keep_s}


def split_tiers(seconds: dict[str, float], budget_s: float, keep_s: float,
                whole_files: frozenset[str] = frozenset(), hidden: frozenset[str] = frozenset()) -> set[str]:
    """The slow set: ``whole_files``' tests (``shared_setup_files``) and the ``hidden`` ones
    (``hidden_costs``) bar each file's keeper, then the slowest first until the rest fit in
    ``budget_s``, bar each other file's keeper."""
    by_file: dict[str, list[str]] = collections.defaultdict(list)
    for node in seconds:
        by_file[node.split("::", 1)[0]].append(node)
    keepers = set()
    for file, nodes in by_file.items():
        if file in whole_files:
            continue
        fastest = min([n for n in nodes if n not in hidden] or nodes, key=seconds.get)
        if seconds[fastest] <= keep_s:
            keepers.add(fastest)
    slow = {node for node in seconds if node.split("::", 1)[0] in whole_files}
    slow |= {node for node in hidden if node not in keepers}
    fast_total = sum(seconds.values()) - sum(seconds.get(node, 0.0) for node in slow)
    for node in sorted(seconds, key=seconds.get, reverse=True):
        if fast_total <= budget_s:
            break
        if node in keepers or node in slow:
            continue
        slow.add(node)
        fast_total -= seconds[node]
    return slow


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", nargs="+",
                   help="pytest logs run with --durations=0 (later ones replace the files they time)")
    p.add_argument("--budget-s", type=float, default=180.0,
                   help="seconds of the timed run the fast tier may take (default 180)")
    p.add_argument("--keep-s", type=float, default=10.0,
                   help="a file's fastest test stays fast if it takes at most this (default 10)")
    p.add_argument("--fast-log", action="append", default=[], metavar="LOG",
                   help="a timed run of the fast tier (-m 'not slow' --durations=0): its tests that took "
                        "more than --keep-s longer than in the full run go slow too")
    p.add_argument("--out", default=SLOW_LIST, help="the list to write (default tests/slow_tests.txt)")
    args = p.parse_args(argv)
    runs, whole_files = [], set()
    for log in args.log:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
        runs.append(test_seconds(lines))
        whole_files |= shared_setup_files(lines, args.keep_s)
        if not runs[-1]:
            print(f"{log}: no --durations lines; run pytest with --durations=0", file=sys.stderr)
            return 2
    seconds = merge_by_file(runs)
    hidden: set[str] = set()
    for log in args.fast_log:
        with open(log, encoding="utf-8", errors="replace") as f:
            hidden |= hidden_costs(seconds, test_seconds(f), args.keep_s)
    slow = split_tiers(seconds, args.budget_s, args.keep_s, frozenset(whole_files), frozenset(hidden))
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("# Outside the fast tier (marked `slow` by tests/conftest.py); written by\n"
                "# scripts/tier_tests.py from a --durations=0 run. One pytest node id a line.\n")
        f.writelines(node + "\n" for node in sorted(slow))
    total = sum(seconds.values())
    fast = total - sum(seconds.get(n, 0.0) for n in slow)
    print(f"{'tier':<6}{'tests':>7}{'seconds':>10}")
    print(f"{'fast':<6}{len(seconds) - len(slow):>7}{fast:>10.1f}")
    print(f"{'slow':<6}{len(slow):>7}{total - fast:>10.1f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
