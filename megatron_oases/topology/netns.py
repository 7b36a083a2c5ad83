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


def tbf_params(rate_Bps: float) -> tuple[int, int]:
    """(burst, limit) bytes for a tbf at ``rate_Bps``.

    burst >= 256 KiB: it must exceed the largest packet (lo's MTU is 64 KiB and GSO packets reach
    64 KiB; a smaller burst drops them forever), and tbf refills from an hrtimer so a ~1-2 ms
    bucket already holds the rate (measured: 0.125 and 0.5 GB/s targets gave 0.125 / 0.499 GB/s
    with 256 KiB). Capped growth (2 ms of traffic) keeps overshoot at the start of a transfer
    small. limit (queue) = 100 ms of traffic, >= 4 MiB, so parallel flows queue rather than drop.
    Both are capped (32 MiB, 1 GiB) so real-hardware rates, far above loopback, stay legal.
    """
    burst = min(max(256 * 1024, int(rate_Bps * 0.002)), 32 << 20)
    limit = min(max(4 << 20, int(rate_Bps * 0.1), 2 * burst), 1 << 30)  # tc takes a u32
    return burst, limit


def shape(ns: str, dev: str, rate_Bps: float, delay_us: float = 0.0) -> dict:
    """Put a tbf (and, if wanted and possible, a netem delay under it) on ``dev``'s egress."""
    burst, limit = tbf_params(rate_Bps)
    rate_bit = int(rate_Bps * 8)
    run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf",
         "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)])
    delayed = 0.0
    if delay_us > 0 and netem_available(ns):
        run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
             "delay", f"{int(round(delay_us))}us", "limit", "100000"])
        delayed = delay_us
    return {"ns": ns, "dev": dev, "rate_bit": rate_bit, "burst": burst, "limit": limit, "delay_us": delayed}


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
