"""Emulate a topology on one Linux machine with network namespaces and rate-limited links.

On a small CPU box gloo is CPU-bound, so async collectives cannot overlap compute and TP
schedules cannot be evaluated. Rate-limiting the links makes gloo bandwidth-bound (mostly
sleeping), so communication overlaps computation as on a real interconnect.

Layout: one namespace per emulated node (``<prefix>n<i>``) plus a "switch" namespace holding a
bridge; a veth pair joins each node to the bridge. Ranks of one node talk over that node's ``lo``
(the kernel routes traffic to a local address through lo), ranks of different nodes over the veth.
Rates (see docs/topology.md): lo gets the node's intra-node capacity, min over intra levels of
``group_bandwidth x units of that level in the node``; each veth end gets the group bandwidth of
the innermost inter_node level (the node's NIC), in both directions.
"""
from __future__ import annotations

import argparse
import atexit
import ipaddress
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

from . import netns
from .loader import load_topology
from .netns import DEFAULT_PREFIX, EmulationError, cleanup_stale  # noqa: F401  (re-exported)
from .spec import Topology
from ..flags import add_flag

ADDRESS_RANGE = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking range, never routed
NODE_IFNAME = "emu0"
_instances = itertools.count()


def intra_node_rate_Bps(topo: Topology) -> float:
    """Bytes/s for a node's lo: the bottleneck intra level's aggregate over the units in one node."""
    rates, units = [], topo.ranks_per_node
    for lv in topo.intra_node_levels:
        rates.append(lv.group_bandwidth_GBps * 1e9 * units)
        units //= lv.size
    return min(rates) if rates else 1e9


def inter_node_rate_Bps(topo: Topology) -> float:
    """Bytes/s per node NIC: the innermost inter_node level's group bandwidth (outer levels are not
    emulated separately; a single switch joins all nodes)."""
    inter = topo.inter_node_levels
    return inter[0].group_bandwidth_GBps * 1e9 if inter else intra_node_rate_Bps(topo)


@dataclass
class LaunchResult:
    """Outcome of one ``launch``: per-rank exit codes and output, and why it stopped."""

    returncodes: list[int | None]
    outputs: list[str]
    timed_out: bool = False
    failed_rank: int | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    @property
    def exit_code(self) -> int:
        """0 on success, 124 on timeout, else the first failing rank's code."""
        if self.timed_out:
            return 124
        if self.failed_rank is not None:
            rc = self.returncodes[self.failed_rank]
            return rc if rc and rc > 0 else 1
        return next((rc for rc in self.returncodes if rc), 0) or 0


@dataclass(eq=False)
class EmulatedCluster:
    """Context manager owning the namespaces of one emulated cluster; ``launch`` runs ranks in it."""

    topology: Topology
    prefix: str = DEFAULT_PREFIX
    latency: bool = True
    master_port: int = 29500
    burst_ms: float = netns.BURST_TIME_S * 1e3  # tbf bucket in ms of traffic (netns.tbf_params)
    shaping: list[dict] = field(default_factory=list, init=False)
    _namespaces: list[str] = field(default_factory=list, init=False)
    _launches: int = field(default=0, init=False)
    _old_handlers: dict = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.topology = load_topology(self.topology)
        if not self.prefix.isalpha() or not self.prefix.islower():
            raise EmulationError(f"prefix must be lowercase letters (got {self.prefix!r})")
        if not self.burst_ms > 0:
            raise EmulationError(f"burst_ms must be > 0 (got {self.burst_ms})")
        if self.topology.num_nodes + 2 > ADDRESS_RANGE.num_addresses:
            raise EmulationError("too many nodes for 198.18.0.0/15")
        self.tag = f"{self.prefix}{os.getpid()}x{next(_instances)}"

    # ---- names and addresses ------------------------------------------------------------------
    def node_ns(self, node: int) -> str:
        return f"{self.tag}n{node}"

    @property
    def switch_ns(self) -> str:
        return f"{self.tag}sw"

    def node_addr(self, node: int) -> str:
        return str(ADDRESS_RANGE.network_address + node + 1)

    # ---- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Build namespaces, bridge, veths and qdiscs; on any failure tear down what was built."""
        netns.check_prerequisites(self.prefix)
        self._install_signal_handlers()
        atexit.register(self.down)
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _build(self) -> None:
        topo, sw = self.topology, self.switch_ns
        self._namespaces.append(sw)
        netns.add_netns(sw)
        netns.run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        netns.run(["ip", "-n", sw, "link", "set", "br0", "up"])
        intra, inter = intra_node_rate_Bps(topo), inter_node_rate_Bps(topo)
        lo_lat = max((lv.latency_us for lv in topo.intra_node_levels), default=0.0) if self.latency else 0.0
        net_lat = topo.inter_node_levels[0].latency_us / 2 if self.latency and topo.inter_node_levels else 0.0
        for n in range(topo.num_nodes):
            ns, port = self.node_ns(n), f"n{n}"
            self._namespaces.append(ns)
            netns.add_netns(ns)
            netns.run(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", NODE_IFNAME, "netns", ns])
            netns.run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
            netns.run(["ip", "-n", ns, "addr", "add", f"{self.node_addr(n)}/{ADDRESS_RANGE.prefixlen}", "dev", NODE_IFNAME])
            netns.run(["ip", "-n", ns, "link", "set", NODE_IFNAME, "up"])
            bt = self.burst_ms / 1e3
            self.shaping.append(netns.shape(ns, "lo", intra, lo_lat, bt))
            if topo.num_nodes > 1:  # node egress and node ingress (switch egress) model a duplex NIC
                self.shaping.append(netns.shape(ns, NODE_IFNAME, inter, net_lat, bt))
                self.shaping.append(netns.shape(sw, port, inter, net_lat, bt))

    def down(self) -> None:
        """Kill leftover rank processes and delete every namespace; safe to call repeatedly."""
        for ns in reversed(self._namespaces):
            netns._kill_ns_processes(ns)
            netns.del_netns(ns)
        self._namespaces.clear()
        self._restore_signal_handlers()
        atexit.unregister(self.down)

    def _install_signal_handlers(self) -> None:
        """Turn SIGTERM/SIGHUP into SystemExit so ``with`` blocks unwind and clean up."""
        if threading.current_thread() is not threading.main_thread():
            return
        def _exit(signum, frame):
            raise SystemExit(128 + signum)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._old_handlers[sig] = signal.signal(sig, _exit)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
        self._old_handlers.clear()

    # ---- running ranks --------------------------------------------------------------------------
    def rank_env(self, rank: int, port: int) -> dict[str, str]:
        """torchrun-style variables for ``rank``; gloo binds the node's veth address."""
        t = self.topology
        return {
            "RANK": str(rank), "LOCAL_RANK": str(t.local_rank(rank)), "WORLD_SIZE": str(t.world_size),
            "LOCAL_WORLD_SIZE": str(t.ranks_per_node), "GROUP_RANK": str(t.node_of(rank)),
            "MASTER_ADDR": self.node_addr(0), "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": NODE_IFNAME, "OASES_EMULATED_TOPOLOGY": t.name,
        }

    def launch(self, cmd: list[str], env: dict[str, str] | None = None, *, timeout: float = 600,
               stream_rank0: bool = False, stream_rank: int | None = None,
               cwd: str | None = None) -> LaunchResult:
        """Run ``cmd`` once per rank in its node's namespace; stop all on first failure or timeout.

        ``stream_rank`` echoes that rank's output live (-1: the last rank, where Megatron-style
        trainers print); ``stream_rank0`` is the same for rank 0."""
        if not self._namespaces:
            raise EmulationError("cluster is not up; use 'with EmulatedCluster(...)' or call up()")
        # The namespaces are ours alone, so a port is free unless an earlier launch used it.
        port = self.master_port + self._launches
        self._launches += 1
        base = {**os.environ, **(env or {})}
        threads = thread_env(base, self.topology.world_size)
        procs, outputs, readers = [], [[] for _ in range(self.topology.world_size)], []
        t0 = time.monotonic()
        world = self.topology.world_size
        echo_rank = 0 if stream_rank0 else (None if stream_rank is None else stream_rank % world)
        try:
            for r in range(world):
                p = subprocess.Popen(["ip", "netns", "exec", self.node_ns(self.topology.node_of(r)), *cmd],
                                     env={**base, **threads, **self.rank_env(r, port)}, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
                procs.append(p)
                th = threading.Thread(target=_pump, args=(p.stdout, outputs[r], r == echo_rank), daemon=True)
                th.start()
                readers.append(th)
            res = self._wait(procs, t0 + timeout)
        finally:
            _kill_all(procs)
            for th in readers:
                th.join(timeout=5)
        res.outputs = ["".join(o) for o in outputs]
        res.seconds = time.monotonic() - t0
        return res

    @staticmethod
    def _wait(procs: list[subprocess.Popen], deadline: float) -> LaunchResult:
        while True:
            rcs = [p.poll() for p in procs]
            bad = [r for r, rc in enumerate(rcs) if rc not in (None, 0)]
            if bad:
                return LaunchResult(rcs, [], failed_rank=bad[0])
            if all(rc == 0 for rc in rcs):
                return LaunchResult(rcs, [])
            if time.monotonic() > deadline:
                return LaunchResult(rcs, [], timed_out=True)
            time.sleep(0.02)


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_env(base: dict[str, str], ranks: int) -> dict[str, str]:
    """Compute-thread variables for ``ranks`` processes sharing this machine's CPUs.

    torch starts one OpenMP thread per core in every rank, and idle OpenMP threads spin-wait: 4
    ranks x 2 threads on 2 cores made the reference trainer (TP2 x DP2, hidden 256) take 5.4 s a
    step instead of 0.4 s, the spinning threads starving gloo and the other ranks. Unless the
    caller set them, each rank gets cpus // ranks threads (at least 1); when the caller's own
    OMP_NUM_THREADS is larger than that, OpenMP waits passively (unless OMP_WAIT_POLICY is set)
    and a warning says so.
    """
    cpus = available_cpus()
    try:
        per_rank = int(base.get("OMP_NUM_THREADS") or max(1, cpus // ranks))
    except ValueError:
        per_rank = 1
    # all three follow OMP_NUM_THREADS: torch takes MKL_NUM_THREADS over it when both are set
    out = {v: str(per_rank) for v in THREAD_VARS if not base.get(v)}
    if per_rank > max(1, cpus // ranks):
        if not base.get("OMP_WAIT_POLICY"):
            out["OMP_WAIT_POLICY"] = "PASSIVE"
        warnings.warn(f"OMP_NUM_THREADS={per_rank} x {ranks} ranks oversubscribes {cpus} CPUs; compute "
                      "threads compete with gloo (set OMP_NUM_THREADS=1 or leave it unset)",
                      RuntimeWarning, stacklevel=3)
    return out


def _pump(stream, sink: list[str], echo: bool) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        sink.append(text)
        if echo:
            sys.stdout.write(text)
            sys.stdout.flush()
    stream.close()


def _kill_all(procs: list[subprocess.Popen], grace: float = 3.0) -> None:
    """SIGTERM each rank's process group, then SIGKILL whatever is left after ``grace`` seconds."""
    live = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + grace
        while live and time.monotonic() < end:
            live = [p for p in live if p.poll() is None]
            time.sleep(0.02)
        if not live:
            break
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def describe(cluster: EmulatedCluster) -> str:
    """Human summary of what was built, printed by the CLI."""
    t = cluster.topology
    lines = [f"emulating {t.name}: {t.num_nodes} node(s) x {t.ranks_per_node} rank(s)"]
    for s in cluster.shaping:
        lat = f", delay {s['delay_us']:g} us" if s["delay_us"] else ""
        lines.append(f"  {s['ns']}:{s['dev']} tbf {s['rate_bit'] / 8e9:.3f} GB/s burst {s['burst']} B "
                     f"limit {s['limit']} B, packets <= {s['packet']} B{lat}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-oases emulate",
        description="Run a command once per rank of an emulated cluster: one network namespace per "
                    "node, links rate-limited with tc tbf as the topology describes (needs root).",
        epilog="example: megatron-oases emulate --topology emu-2x2 -- python -m my.train --tp 2")
    add_flag(p, "topology", note="e.g. emu-flat4, emu-2x2")
    p.add_argument("--timeout", type=float, default=600, help="seconds before all ranks are killed (default 600)")
    p.add_argument("--quiet", action="store_true", help="do not stream any rank's output live")
    p.add_argument("--stream-rank", type=int, default=-1,
                   help="rank whose output is streamed live (default -1: the last rank, where "
                        "Megatron and megatron-oases train print their iteration lines)")
    p.add_argument("--no-latency", action="store_true", help="do not add netem delays even if available")
    p.add_argument("--burst-ms", type=float, default=netns.BURST_TIME_S * 1e3,
                   help="tbf bucket in ms of link traffic (default %(default)g): bytes a collective "
                        "sends at memory speed after an idle link; larger hides CPU stalls of the "
                        "ranks but makes messages after compute faster than the link")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix (lowercase letters)")
    p.add_argument("--cleanup-stale", action="store_true",
                   help="only delete namespaces left by dead runs with this prefix, then exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to run on every rank")
    return p


def emulate_main(argv: list[str] | None = None) -> int:
    """CLI entry for ``megatron-oases emulate``; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cleanup_stale:
        removed = cleanup_stale(args.prefix)
        print(f"removed {len(removed)} stale namespace(s){': ' + ' '.join(removed) if removed else ''}")
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not args.topology or not cmd:
        parser.error("need --topology NAME_OR_FILE and a command after '--'")
    try:
        with EmulatedCluster(load_topology(args.topology), prefix=args.prefix, latency=not args.no_latency,
                             burst_ms=args.burst_ms) as c:
            print(describe(c), file=sys.stderr)
            res = c.launch(cmd, timeout=args.timeout,
                           stream_rank=None if args.quiet else args.stream_rank)
    except (EmulationError, ValueError) as e:
        print(f"megatron-oases emulate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # ranks and namespaces are already gone (finally / __exit__)
        print("megatron-oases emulate: interrupted; cluster cleaned up", file=sys.stderr)
        return 130
    for r, (rc, out) in enumerate(zip(res.returncodes, res.outputs)):
        if rc != 0 and (r != 0 or args.quiet):
            print(f"---- rank {r} (exit {rc}) output tail ----\n{out[-4000:]}", file=sys.stderr)
    why = "timed out" if res.timed_out else f"rank {res.failed_rank} failed" if res.failed_rank is not None else "ok"
    print(f"emulate: {why} after {res.seconds:.1f}s; exit codes {res.returncodes}", file=sys.stderr)
    return res.exit_code


if __name__ == "__main__":
    sys.exit(emulate_main())
