"""The namespace emulator: clean up on every exit path, and the two properties it exists for:
async gloo collectives overlap compute, and inter-node links are slower than intra-node ones.

Needs root, iproute2 and the tbf qdisc; otherwise every test skips with the reason. Each launch
has a hard timeout (LAUNCH_TIMEOUT) after which all ranks are killed, so a hang fails fast.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_oases.topology import Topology, load_topology
from megatron_oases.topology import netns
from megatron_oases.topology.emulate import EmulatedCluster, emulate_main
from megatron_oases.topology.probe import parse_output

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_TIMEOUT = 90
PREFIX = "moasestest"
_REASON = netns.unavailable_reason(PREFIX)
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"emulated cluster unavailable: {_REASON}"),
    pytest.mark.filterwarnings("ignore:sch_netem is not available"),
]
ENV = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def _ours(tag: str) -> list[str]:
    return [ns for ns in netns.list_netns() if ns.startswith(tag)]


def _one_node(ranks: int, group_GBps: float) -> Topology:
    return Topology.from_dict({"name": f"emu-1x{ranks}", "levels": [
        {"name": "lo", "size": ranks, "scope": "intra_node", "p2p_bandwidth_GBps": group_GBps,
         "group_bandwidth_GBps": group_GBps}]})


def test_up_down_leaves_no_namespaces():
    c = EmulatedCluster(load_topology("emu-2x2"), prefix=PREFIX)
    with c:
        assert sorted(_ours(c.tag)) == sorted([c.node_ns(0), c.node_ns(1), c.switch_ns])
        assert all(s["burst"] >= 2 * s["packet"] for s in c.shaping)
    assert _ours(c.tag) == []


def _link(ns: str, dev: str) -> dict:
    import json
    return json.loads(netns.run(["ip", "-j", "-d", "-n", ns, "link", "show", "dev", dev]).stdout)[0]


def test_small_tbf_bucket_and_packets_that_fit_it():
    """The bucket (free traffic after an idle gap) is two packets, ~0.3 ms at the link rate, and
    each shaped device really sends packets no larger than that (lo by MTU, veth by GSO size)."""
    c = EmulatedCluster(load_topology("emu-2x2"), prefix=PREFIX)
    with c:
        for s in c.shaping:
            assert s["burst"] >= 2 * s["packet"]
            rate_Bps = s["rate_bit"] / 8
            assert s["burst"] <= max(rate_Bps * 0.3e-3, 2 * (8192 + 2048)), s
            link = _link(s["ns"], s["dev"])
            assert link["gso_max_size"] == s["packet"], (s, link)
            if s["dev"] == "lo":
                assert link["mtu"] == s["packet"], (s, link)
        by_dev = {s["dev"]: s["packet"] for s in c.shaping if s["ns"] == c.node_ns(0)}
        assert by_dev == {"lo": 65536, "emu0": 16384}  # 0.5 GB/s lo, 0.125 GB/s NIC
    assert netns.tbf_params(0.5e9, netns.packet_size(0.5e9, 1e-3), 1e-3)[0] == 500_000  # --burst-ms 1
    with pytest.raises(netns.EmulationError, match="burst_ms"):
        EmulatedCluster("emu-2x2", prefix=PREFIX, burst_ms=0)


def test_rank_compute_threads_fit_the_cpus():
    """Ranks get cpus // ranks OpenMP threads (oversubscribed spinning threads made a trainer step
    ~12x slower); a caller's own setting wins, and an oversubscribing one waits passively."""
    from megatron_oases.topology.emulate import available_cpus, thread_env

    cpus = available_cpus()
    assert thread_env({}, 4)["OMP_NUM_THREADS"] == str(max(1, cpus // 4))
    assert "OMP_NUM_THREADS" not in thread_env({"OMP_NUM_THREADS": "1"}, 4)
    with pytest.warns(RuntimeWarning, match="oversubscribes"):
        env = thread_env({"OMP_NUM_THREADS": str(cpus + 1)}, 2)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    code = "import os; print('T', os.environ['OMP_NUM_THREADS'], flush=True)"
    with EmulatedCluster("emu-flat4", prefix=PREFIX) as c:
        res = c.launch([sys.executable, "-c", code], env={"OMP_NUM_THREADS": ""}, timeout=LAUNCH_TIMEOUT)
    assert res.ok and all(o.split() == ["T", str(max(1, cpus // 4))] for o in res.outputs), res.outputs


def test_exception_inside_with_cleans_up():
    c = EmulatedCluster(load_topology("emu-flat4"), prefix=PREFIX)
    with pytest.raises(RuntimeError, match="boom"):
        with c:
            assert _ours(c.tag)
            raise RuntimeError("boom")
    assert _ours(c.tag) == []


def test_sigterm_cleans_up(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from megatron_oases.topology.emulate import EmulatedCluster
        with EmulatedCluster("emu-2x2", prefix="{PREFIX}") as c:
            print(c.tag, flush=True)
            time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **ENV})
    tag = p.stdout.readline().strip()
    assert tag and _ours(tag)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert _ours(tag) == []


def test_cleanup_stale_removes_dead_runs_only():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}x0n0"
    netns.add_netns(stale)
    with EmulatedCluster("emu-flat4", prefix=PREFIX) as live:
        removed = netns.cleanup_stale(PREFIX)
        assert stale in removed and stale not in netns.list_netns()
        assert _ours(live.tag)  # a live run's namespaces stay


def test_launch_env_failure_and_timeout():
    code = ("import os,sys,time; r=int(os.environ['RANK']); "
            "print('ENV', r, os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_WORLD_SIZE'], "
            "os.environ['MASTER_ADDR'], os.environ['GLOO_SOCKET_IFNAME'], flush=True); "
            "time.sleep(float(sys.argv[1]) if r == 0 else 0); sys.exit(int(sys.argv[2]) if r == 3 else 0)")
    with EmulatedCluster("emu-2x2", prefix=PREFIX) as c:
        ok = c.launch([sys.executable, "-c", code, "0", "0"], timeout=LAUNCH_TIMEOUT)
        assert ok.ok and ok.returncodes == [0, 0, 0, 0]
        assert ok.outputs[3].split() == ["ENV", "3", "1", "4", "2", "198.18.0.1", "emu0"]
        t0 = time.monotonic()
        bad = c.launch([sys.executable, "-c", code, "60", "3"], timeout=LAUNCH_TIMEOUT)
        assert bad.failed_rank == 3 and bad.exit_code == 3 and bad.returncodes[0] != 0
        assert time.monotonic() - t0 < 30  # rank 0 was killed, not waited for
        slow = c.launch(["sleep", "60"], timeout=1)
        assert slow.timed_out and slow.exit_code == 124


def test_overlap_probe_async_allreduce_hides_behind_compute():
    """Acceptance: with a rate-limited link, async all_reduce beside a matmul beats serial.

    2 ranks on one node, lo limited to 2 x 0.125 = 0.25 GB/s: a 32 MiB all_reduce takes ~270 ms
    (comm dominates the ~90 ms matmul). Median of 3 serial/overlapped pairs from the same run.
    """
    with EmulatedCluster(_one_node(2, 0.125), prefix=PREFIX) as c:
        res = c.launch([sys.executable, "-m", "megatron_oases.topology.probe", "overlap", "--mbytes", "32",
                        "--compute-ms", "90", "--repeats", "3"], env=ENV, timeout=LAUNCH_TIMEOUT, cwd=ROOT)
    assert res.ok, res.outputs
    r = parse_output(res.outputs[0])
    print("overlap probe:", r)
    assert r["comm_ms"] > 150, f"link not rate-limited? {r}"
    assert r["overlapped_ms"] < 0.9 * r["serial_ms"], r


def test_inter_node_slower_than_intra_node():
    """On emu-2x2 ranks 0,1 share node 0: 0->1 must ride lo (fast), 0->2 the veth (slow)."""
    with EmulatedCluster("emu-2x2", prefix=PREFIX) as c:
        res = c.launch([sys.executable, "-m", "megatron_oases.topology.probe", "p2p", "--pairs", "0-1,0-2",
                        "--mbytes", "8", "--repeats", "2"], env=ENV, timeout=LAUNCH_TIMEOUT, cwd=ROOT)
    assert res.ok, res.outputs
    pairs = parse_output(res.outputs[0])["pairs"]
    print("p2p probe:", pairs)
    intra, inter = pairs["0-1"], pairs["0-2"]
    assert inter["GBps"] < 0.6 * intra["GBps"], pairs
    assert intra["veth_tx_MB"] < 1 and intra["lo_tx_MB"] > 8, pairs  # same-node traffic used lo
    assert inter["veth_tx_MB"] > 8, pairs


def test_cli_runs_command_and_returns_exit_code(capsys):
    rc = emulate_main(["--topology", "emu-flat4", "--prefix", PREFIX, "--timeout", str(LAUNCH_TIMEOUT), "--quiet",
                       "--", sys.executable, "-c", "import os,sys; sys.exit(5 if os.environ['RANK']=='2' else 0)"])
    assert rc == 5
    assert "rank 2 failed" in capsys.readouterr().err
