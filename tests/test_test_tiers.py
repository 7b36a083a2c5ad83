"""The fast tier: scripts/tier_tests.py's split and tests/slow_tests.txt's entries."""
import os

from tests.conftest import SLOW_LIST
from tests.script_modules import ROOT, load_script

tiers = load_script("scripts/tier_tests.py")

LOG = """\
============================= slowest durations =============================
30.00s call     tests/test_a.py::test_big[x]
 1.50s setup    tests/test_a.py::test_big[x]
 0.20s call     tests/test_a.py::test_small
20.00s call     tests/test_b.py::test_only
 5.00s call     tests/test_c.py::test_mid
 1.00s call     tests/test_c.py::test_tiny
"""


def test_seconds_add_setup_call_and_teardown():
    got = tiers.test_seconds(LOG.splitlines())
    assert got["tests/test_a.py::test_big[x]"] == 31.5
    assert len(got) == 5


def test_the_split_fits_the_budget_and_keeps_each_files_fastest_test():
    seconds = tiers.test_seconds(LOG.splitlines())
    # test_b's only test (20 s) is over keep_s: it goes, and the rest fit in 7 s
    assert tiers.split_tiers(seconds, budget_s=7.0, keep_s=10.0) == {
        "tests/test_a.py::test_big[x]", "tests/test_b.py::test_only"}
    # under keep_s it is test_b's keeper and stays fast, whatever the budget
    assert tiers.split_tiers(seconds, budget_s=7.0, keep_s=25.0) == {
        "tests/test_a.py::test_big[x]", "tests/test_c.py::test_mid"}


def test_a_later_log_replaces_the_files_it_times():
    """A run of the changed files over a full run: their tests (renamed and removed ones too)
    come from the later log, every other file from the full one."""
    full = tiers.test_seconds(LOG.splitlines())
    later = tiers.test_seconds(["2.00s call     tests/test_a.py::test_renamed"])
    assert tiers.merge_by_file([full, later]) == {
        "tests/test_a.py::test_renamed": 2.0, "tests/test_b.py::test_only": 20.0,
        "tests/test_c.py::test_mid": 5.0, "tests/test_c.py::test_tiny": 1.0}


def test_every_slow_entry_names_a_test_file_that_exists():
    with open(SLOW_LIST, encoding="utf-8") as f:
        nodes = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    missing = {n.split("::")[0] for n in nodes if not os.path.exists(os.path.join(ROOT, n.split("::")[0]))}
    assert not missing, f"tests/slow_tests.txt names files that are gone: {sorted(missing)}"


def test_a_file_whose_module_fixture_outlasts_keep_s_leaves_the_fast_tier_whole():
    """pytest charges a module-scoped fixture to the file's first test, but any test of the file
    kept fast would pay it: such a file goes slow whole, and the budget counts each test once."""
    log = LOG + "50.00s setup    tests/test_d.py::test_first[a]\n 0.01s call     tests/test_d.py::test_second[b]\n"
    lines = log.splitlines()
    whole = tiers.shared_setup_files(lines, keep_s=10.0)
    assert whole == {"tests/test_d.py"}
    slow = tiers.split_tiers(tiers.test_seconds(lines), budget_s=7.0, keep_s=10.0, whole_files=frozenset(whole))
    assert {"tests/test_d.py::test_first[a]", "tests/test_d.py::test_second[b]"} <= slow
    assert slow - {"tests/test_d.py::test_first[a]", "tests/test_d.py::test_second[b]"} == {
        "tests/test_a.py::test_big[x]", "tests/test_b.py::test_only"}


def test_a_fast_test_that_paid_a_fixture_charged_elsewhere_goes_slow():
    """test_c's tests share a fixture fetched with getfixturevalue: the full run charged it to
    test_mid, the fast-tier run to test_tiny, which --fast-log moves out (test_mid keeps the file
    in the tier); a file whose only test paid one keeps it. Tests the full log left out (under
    its 5 ms floor) count as 0 s there."""
    seconds = tiers.test_seconds(LOG.splitlines())
    fast = tiers.test_seconds(["13.00s call     tests/test_c.py::test_tiny", " 0.30s call     tests/test_a.py::test_small",
                               "12.00s call     tests/test_e.py::test_unlisted"])
    hidden = frozenset(tiers.hidden_costs(seconds, fast, keep_s=10.0))
    assert hidden == {"tests/test_c.py::test_tiny", "tests/test_e.py::test_unlisted"}
    assert tiers.split_tiers(seconds, budget_s=100.0, keep_s=10.0, hidden=hidden) == {
        "tests/test_c.py::test_tiny", "tests/test_e.py::test_unlisted"}
    assert tiers.split_tiers({"tests/test_c.py::test_tiny": 1.0}, budget_s=100.0, keep_s=10.0,
                             hidden=hidden) == {"tests/test_e.py::test_unlisted"}
