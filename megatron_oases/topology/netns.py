"""Thin wrappers over ``ip``/``tc`` used by the emulator, plus prerequisite checks and cleanup.

Kept apart from the cluster logic so tests can ask "can this machine emulate at all?" without
building anything, and so stale-namespace cleanup works even when the cluster code cannot import.
Everything runs inside namespaces we create; the host's root namespace is never modified.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import warnings

DEFAULT_PREFIX = "moases"
_NS_RE = re.compile(r"^(?P<prefix>[a-z]+)(?P<pid>\d+)(?:x\d+)?(?:n\d+|sw|probe)$")


class EmulationError(RuntimeError):
    """The emulated cluster cannot be built or run; the message names what is missing or failed."""


def run(args: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run one ip/tc command; failures raise EmulationError with the command and its stderr."""
    try:
        cp = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise EmulationError(f"'{args[0]}' not found; install iproute2") from None
    except subprocess.TimeoutExpired:
        raise EmulationError(f"'{' '.join(args)}' hung for {timeout}s") from None
    if check and cp.returncode != 0:
        raise EmulationError(f"'{' '.join(args)}' failed: {cp.stderr.strip() or cp.stdout.strip()}")
    return cp


def list_netns() -> list[str]:
    cp = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in cp.stdout.splitlines() if line.strip()]


def add_netns(name: str) -> None:
    run(["ip", "netns", "add", name])
    run(["ip", "-n", name, "link", "set", "lo", "up"])


def del_netns(name: str) -> None:
    """Delete a namespace (its veths and bridge go with it); quiet if already gone."""
    run(["ip", "netns", "del", name], check=False)


def tx_bytes(ns: str, dev: str) -> int:
    """Bytes sent by ``dev`` inside ``ns`` (to check which link a transfer really used)."""
    cp = run(["ip", "-j", "-s", "-n", ns, "link", "show", "dev", dev])
    return int(json.loads(cp.stdout)[0]["stats64"]["tx"]["bytes"])


def _missing_tools() -> list[str]:
    return [t for t in ("ip", "tc") if shutil.which(t) is None]


def unavailable_reason(prefix: str = DEFAULT_PREFIX) -> str | None:
    """Why namespaces + tbf cannot be used here, or None when they can (tests skip on a reason)."""
    if os.geteuid() != 0:
        return "emulation needs root (network namespaces and tc); run as root"
    missing = _missing_tools()
    if missing:
        return f"emulation needs {', '.join(missing)} on PATH (install iproute2)"
    probe = f"{prefix}{os.getpid()}probe"
    try:
        add_netns(probe)
    except EmulationError as e:
        del_netns(probe)
        return f"cannot create network namespaces: {e}"
    try:
        cp = run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit",
                  "burst", "256kb", "limit", "4mb"], check=False)
        if cp.returncode != 0:
            return f"tc qdisc 'tbf' unavailable (kernel needs CONFIG_NET_SCH_TBF): {cp.stderr.strip()}"
    finally:
        del_netns(probe)
    return None


def check_prerequisites(prefix: str = DEFAULT_PREFIX) -> None:
    reason = unavailable_reason(prefix)
    if reason:
        raise EmulationError(reason)


_NETEM: dict[str, bool] = {}


def netem_available(ns: str) -> bool:
    """Whether sch_netem exists (probed once on a throwaway qdisc of ``ns``'s lo, then removed)."""
    if "ok" not in _NETEM:
        cp = run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "handle", "9:", "netem",
                  "delay", "1us"], check=False)
        _NETEM["ok"] = cp.returncode == 0
        if cp.returncode == 0:
            run(["tc", "-n", ns, "qdisc", "del", "dev", "lo", "root"], check=False)
        else:
            warnings.warn("sch_netem is not available (kernel lacks CONFIG_NET_SCH_NETEM): "
                          "emulated links get bandwidth limits but no added latency", RuntimeWarning, stacklevel=3)
    return _NETEM["ok"]


# Bytes a tbf may send at line speed after the link was idle: the bucket refills while compute
# runs, so every burst byte is a byte the next collective gets for free. Real links have no such
# credit, so the bucket is kept to ~0.3 ms of traffic; the packets are made small enough to fit.
BURST_TIME_S = 0.3e-3
PACKET_SIZES = (65536, 32768, 16384, 8192)   # candidate lo MTU / veth GSO sizes, largest first
_PKT_SLACK = 2048                             # L2 header (lo) / per-segment headers of a GSO skb


def packet_size(rate_Bps: float, burst_time_s: float = BURST_TIME_S) -> int:
    """Largest packet (lo MTU, veth gso_max_size) such that a bucket of two of them holds no more
    than ``burst_time_s`` of traffic; 8 KiB at least (per-packet CPU cost on a small box)."""
    budget = rate_Bps * burst_time_s
    return next((s for s in PACKET_SIZES if 2 * (s + _PKT_SLACK) <= budget), PACKET_SIZES[-1])


def tbf_params(rate_Bps: float, packet: int = PACKET_SIZES[0],
               burst_time_s: float = BURST_TIME_S) -> tuple[int, int]:
    """(burst, limit) bytes for a tbf at ``rate_Bps`` whose device sends packets of <= ``packet``.

    burst = ``burst_time_s`` of traffic, and at least two packets: a packet longer than the bucket
    is never sent (a non-GSO 64 KiB lo packet over a 16 KiB bucket hung a TCP transfer), and the
    second one absorbs a late refill timer. tbf refills from an hrtimer, so a bucket this small
    still holds the rate (>= 1 MiB all_reduces took 0.9-1.1 x bytes/rate). It is not larger because
    a full bucket is free traffic: with the former 2 ms bucket (1 MB on a 0.5 GB/s lo) a 256 KiB
    all_reduce after a compute gap took 0.4 ms instead of the 1 ms its bytes need. The price: a
    stall of the ranks (a CPU-starved box) longer than the bucket is lost link time, where a
    bigger bucket refunds it; ``burst_time_s`` is that trade-off (``--burst-ms``).
    limit (queue) = 100 ms of traffic, >= 4 MiB, so parallel flows queue rather than drop.
    Both are capped (32 MiB, 1 GiB) so real-hardware rates, far above loopback, stay legal.
    """
    burst = min(max(2 * (packet + _PKT_SLACK), int(rate_Bps * burst_time_s)), 32 << 20)
    limit = min(max(4 << 20, int(rate_Bps * 0.1), 2 * burst), 1 << 30)  # tc takes a u32
    return burst, limit


def set_packet_size(ns: str, dev: str, packet: int) -> None:
    """Cap the packets ``dev`` sends at ``packet`` bytes: lo by its MTU (its TCP segments are not
    GSO), a veth by gso_max_size (TCP builds no larger GSO skbs; the 1500 MTU stays)."""
    if dev == "lo":
        run(["ip", "-n", ns, "link", "set", "dev", dev, "mtu", str(packet)])
    run(["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_size", str(packet)])


def shape(ns: str, dev: str, rate_Bps: float, delay_us: float = 0.0,
          burst_time_s: float = BURST_TIME_S) -> dict:
    """Put a tbf (and, if wanted and possible, a netem delay under it) on ``dev``'s egress, after
    sizing ``dev``'s packets for a ``burst_time_s`` bucket (``packet_size``)."""
    packet = packet_size(rate_Bps, burst_time_s)
    set_packet_size(ns, dev, packet)
    burst, limit = tbf_params(rate_Bps, packet, burst_time_s)
    rate_bit = int(rate_Bps * 8)
    run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf",
         "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)])
    delayed = 0.0
    if delay_us > 0 and netem_available(ns):
        run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
             "delay", f"{int(round(delay_us))}us", "limit", "100000"])
        delayed = delay_us
    return {"ns": ns, "dev": dev, "rate_bit": rate_bit, "burst": burst, "limit": limit, "packet": packet,
            "delay_us": delayed}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_ns_processes(ns: str) -> None:
    cp = run(["ip", "netns", "pids", ns], check=False)
    for tok in cp.stdout.split():
        try:
            os.kill(int(tok), 9)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def cleanup_stale(prefix: str = DEFAULT_PREFIX, *, include_live: bool = False) -> list[str]:
    """Delete namespaces ``<prefix><pid>...`` whose creating process is dead (or all, if asked).

    Deleting a namespace removes its veth ends and bridge, so this is all the cleanup a crashed
    run (SIGKILL, power loss) needs. Processes left inside such namespaces are killed first.
    """
    removed = []
    for ns in list_netns():
        m = _NS_RE.match(ns)
        if not m or m.group("prefix") != prefix:
            continue
        pid = int(m.group("pid"))
        if include_live or (pid != os.getpid() and not _pid_alive(pid)):
            _kill_ns_processes(ns)
            del_netns(ns)
            removed.append(ns)
    return removed
