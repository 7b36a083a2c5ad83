"""Time gloo all_reduce of 4 KiB .. 16 MiB inside the emulated interconnect against bytes/rate.

    python scripts/probe_emulated_collectives.py --topology emu-flat4 --ranks 4
    python scripts/probe_emulated_collectives.py --one-node 2 --GBps 0.125
    python scripts/probe_emulated_collectives.py --topology emu-2x2 --group-size 2 --stride 2
    python scripts/probe_emulated_collectives.py --topology emu-2x2 --train "--tensor-model-parallel-size 2 --hidden-size 256 --train-iters 4"

The controller builds an ``EmulatedCluster``, launches this file once per rank (``--worker``),
and prints per size: median and min time, the expected ring time (bytes over the bottleneck tbf
rate), their ratio, plus per-namespace counters that explain a gap: tbf drops/overlimits, TCP
retransmits / RTOs / delayed ACKs (nstat), and the congestion control in use.
``--group-size K --stride S`` runs one all_reduce per group concurrently (K ranks S apart: TP-like
groups with S=1, DP-like with S=K); ``--gap-ms`` / ``--compute-ms`` idle or compute before each
timed call; ``--bare`` runs the same ranks on the host loopback without emulation.
``--train ARGS`` runs the reference trainer instead and reports step time next to the bytes each
node put on lo / its veth per step divided by the link rates, and the blocking collectives.
``--layer H,TP,SEQ,MBS`` times a TP layer shard's forward+backward and prints the link rate at
which its TP all_reduces would take as long.
Needs root (see docs/topology.md). Namespaces are removed on every exit path.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from megatron_oases.describe.ops import ring_factor  # noqa: E402  (pure Python: the ring's bytes per rank)

MARK = "PROBE_COLL "
SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


# ---------------------------------------------------------------------------------- worker (rank)
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group, mine = None, True
    groups = make_groups(world, args.ranks, args.group_size, args.stride)
    if groups != [list(range(world))]:
        for g in groups:  # every rank must create every group, in the same order
            pg = dist.new_group(g)
            if rank in g:
                group = pg
        mine = any(rank in g for g in groups)
    out = {}
    if args.compute_ms:
        a = torch.randn(256, 256)
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        reps_c = max(1, round(args.compute_ms / 1e3 / ((time.perf_counter() - t0) / 20)))

        def busy():
            for _ in range(reps_c):
                a @ a
    if mine:
        for size in args.sizes:
            x = torch.ones(size // 4)
            reps = max(3, min(args.repeats, int(64 * 2**20 // max(size, 1))))
            for _ in range(2):
                dist.all_reduce(x, group=group)  # warm-up (connections, buffers, cwnd)
            times = []
            for _ in range(reps):
                dist.barrier(group=group)
                if args.gap_ms:
                    time.sleep(args.gap_ms / 1e3)  # idle link, as during compute: the tbf bucket refills
                if args.compute_ms:
                    busy()  # real compute: the ranks contend for the cores as in training
                t0 = time.perf_counter()
                dist.all_reduce(x, group=group)
                times.append(time.perf_counter() - t0)
            out[size] = {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
                         "max_ms": max(times) * 1e3, "n": reps, "all_ms": [round(t * 1e3, 2) for t in times]}
    dist.barrier()
    if rank == 0:
        print(MARK + json.dumps(out), flush=True)
    dist.destroy_process_group()


def layer_compute(hidden: int, tp: int, seq: int, mbs: int, heads: int, copies: int, repeats: int = 5) -> float:
    """ms for forward+backward of one rank's shard of a GPT layer (Megatron TP, no SP: QKV and fc1
    column-parallel, proj and fc2 row-parallel, LayerNorms replicated), fp32, one thread, with
    ``copies`` processes doing the same at once (ranks sharing this machine's cores)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_layer_worker, args=(hidden, tp, seq, mbs, heads, repeats, q)) for _ in range(copies)]
    for pr in procs:
        pr.start()
    res = [q.get() for _ in procs]
    for pr in procs:
        pr.join()
    return statistics.median(res)


def _layer_worker(hidden, tp, seq, mbs, heads, repeats, q) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    h, hp, nh = hidden, hidden // tp, heads // tp
    w = {k: torch.randn(*shape, requires_grad=True) * 0.02 for k, shape in
         {"qkv": (3 * hp, h), "proj": (h, hp), "fc1": (4 * hp, h), "fc2": (h, 4 * hp)}.items()}
    w = {k: v.detach().requires_grad_() for k, v in w.items()}
    ln1, ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
    x = torch.randn(seq, mbs, h, requires_grad=True)

    def step():
        y = ln1(x)
        qkv = F.linear(y, w["qkv"]).view(seq, mbs, nh, 3, h // heads).permute(3, 1, 2, 0, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        a = a.permute(2, 0, 1, 3).reshape(seq, mbs, hp)
        z = x + F.linear(a, w["proj"])          # all_reduce here in TP
        m = F.linear(F.gelu(F.linear(ln2(z), w["fc1"])), w["fc2"])  # and here
        (z + m).sum().backward()                # backward: two more all_reduces

    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    q.put(statistics.median(times) * 1e3)


def dist_rank() -> int:
    return int(os.environ.get("RANK", 0))


def make_groups(world: int, ranks: int, size: int, stride: int) -> list[list[int]]:
    """Groups of ``size`` ranks ``stride`` apart among the first ``ranks`` (default: one group)."""
    ranks = ranks or world
    if not size or size >= ranks:
        return [list(range(ranks))]
    groups, block = [], size * stride
    for b in range(0, ranks, block):
        for s in range(stride):
            groups.append([b + s + i * stride for i in range(size)])
    return groups


def train_worker(argv: list[str]) -> None:
    """The reference trainer, with the node's lo / veth tx bytes sampled around every step."""
    import megatron_oases.train as train

    def tx():
        out = {}
        for dev in ("lo", "emu0"):
            try:
                out[dev] = int(open(f"/sys/class/net/{dev}/statistics/tx_bytes").read())
            except OSError:
                out[dev] = 0
        return out

    inner, steps = train.train_step, []

    def step(tr, it):
        a = tx(); t0 = time.perf_counter()
        res = inner(tr, it)
        b = tx()
        steps.append({"it": it, "s": time.perf_counter() - t0, **{k: b[k] - a[k] for k in a}})
        return res

    import torch.distributed as dist

    calls: dict[str, list] = {}  # "op group_size bytes" -> [count, seconds]  (last 2 steps only)

    def wrap(name):
        fn = getattr(dist, name)

        def timed(tensor, *a, **k):
            t0 = time.perf_counter()
            out = fn(tensor, *a, **k)
            if len(steps) >= max(0, n_iters - 2) and not k.get("async_op"):
                g = k.get("group")
                key = f"{name} g{dist.get_world_size(g)} {tensor.numel() * tensor.element_size()}"
                c = calls.setdefault(key, [0, 0.0])
                c[0] += 1
                c[1] += time.perf_counter() - t0
            return out
        setattr(dist, name, timed)

    n_iters = int(argv[argv.index("--train-iters") + 1]) if "--train-iters" in argv else 10
    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"):
        wrap(name)
    train.train_step = step
    rc = train.main(argv)
    if os.environ.get("LOCAL_RANK") == "0":
        print(MARK + json.dumps({"node": int(os.environ.get("GROUP_RANK", 0)), "rank": dist_rank(),
                                 "steps": steps, "calls": calls}), flush=True)
    sys.exit(rc)


# ---------------------------------------------------------------------------------- controller
def _nstat(ns: str) -> dict[str, int]:
    cp = subprocess.run(["ip", "netns", "exec", ns, "nstat", "-asz", "--json"], capture_output=True, text=True)
    try:
        d = json.loads(cp.stdout)["kernel"]
    except (ValueError, KeyError):
        return {}
    keys = ("TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtDelayedACKs", "TcpExtTCPLossProbes",
            "TcpExtTCPSpuriousRTOs", "TcpExtTCPFastRetrans", "TcpExtDelayedACKLost", "TcpOutSegs")
    return {k: int(d.get(k, 0)) for k in keys}


def _qdisc_stats(ns: str) -> list[str]:
    cp = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show"], capture_output=True, text=True)
    out, head = [], ""
    for line in cp.stdout.splitlines():
        if line.startswith("qdisc"):
            head = " ".join(line.split()[:5])
        m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", line)
        if m and head:
            out.append(f"{head}: sent {int(m[1]) / 1e6:.1f} MB, {m[2]} pkt, dropped {m[3]}, overlimits {m[4]}")
    return out


def expected_ms(size: int, topo, groups: list[list[int]]) -> float:
    """Ring all_reduce, all groups at once: each rank sends 2(p-1)/p x size to its ring successor.
    A same-node hop loads the node's lo, a cross-node hop the sender's veth and the receiver's
    bridge port. The answer is the busiest tbf's bytes / rate (no per-message latency)."""
    from megatron_oases.topology.emulate import inter_node_rate_Bps, intra_node_rate_Bps

    load: dict[tuple, float] = {}
    for g in groups:
        p = len(g)
        per_rank = ring_factor("all_reduce", p) * size
        for i, r in enumerate(g):
            a, b = topo.node_of(r), topo.node_of(g[(i + 1) % p])
            keys = [("lo", a)] if a == b else [("out", a), ("in", b)]
            for k in keys:
                load[k] = load.get(k, 0.0) + per_rank
    rate = {"lo": intra_node_rate_Bps(topo), "out": inter_node_rate_Bps(topo), "in": inter_node_rate_Bps(topo)}
    return max(v / rate[k[0]] for k, v in load.items()) * 1e3


def layer_report(hidden: int, tp: int, seq: int, mbs: int, heads: int = 16) -> int:
    ms = layer_compute(hidden, tp, seq, mbs, heads, copies=tp)
    act = seq * mbs * hidden * 4                          # one fp32 activation all_reduce
    wire = 4 * ring_factor("all_reduce", tp) * act         # 2 fwd + 2 bwd, ring bytes per rank
    rate = wire / (ms / 1e3)
    print(f"hidden {hidden} TP {tp} seq {seq} mbs {mbs}: layer fwd+bwd {ms:.1f} ms per rank "
          f"({tp} ranks at once on {os.cpu_count()} cores); 4 all_reduces of {act / 2**20:.2f} MiB = "
          f"{wire / 1e6:.2f} MB sent per rank -> comm = compute at {rate / 1e9:.4f} GB/s per rank "
          f"(group_bandwidth_GBps; node lo {tp * rate / 1e9:.4f} GB/s)")
    return 0


def report_train(res, topo, cc) -> int:
    """Step times (rank outputs) next to per-node bytes on lo / veth over the tbf rates."""
    from megatron_oases.topology.emulate import inter_node_rate_Bps, intra_node_rate_Bps

    nodes = [json.loads(l[len(MARK):]) for o in res.outputs for l in o.splitlines() if l.startswith(MARK)]
    lo_rate, nic_rate = intra_node_rate_Bps(topo), inter_node_rate_Bps(topo)
    print(f"\ntrainer on {topo.name} (tcp cc {cc}); per step: time, and per node lo/veth MB -> ms at the tbf rate")
    n_steps = len(nodes[0]["steps"])
    for i in range(n_steps):
        parts, comm = [], []
        for n in sorted(nodes, key=lambda d: d["node"]):
            st = n["steps"][i]
            lo_ms, ve_ms = st["lo"] / lo_rate * 1e3, st["emu0"] / nic_rate * 1e3
            comm.append(lo_ms + ve_ms)
            parts.append(f"n{n['node']} lo {st['lo'] / 1e6:.2f} MB ({lo_ms:.0f} ms) veth {st['emu0'] / 1e6:.2f} MB ({ve_ms:.0f} ms)")
        print(f"  it {i + 1}: step {nodes[0]['steps'][i]['s'] * 1e3:7.1f} ms | bytes/rate {max(comm):6.1f} ms | " + " | ".join(parts))
    print_calls(nodes[0])
    return 0


def print_calls(node: dict) -> None:
    """Blocking collectives of rank ``node['rank']`` in the last 2 steps: count and time by shape."""
    print(f"blocking collectives on rank {node['rank']}, last 2 steps (op, group size, bytes: count, total ms, ms each)")
    for key, (n, sec) in sorted(node["calls"].items(), key=lambda kv: -kv[1][1]):
        print(f"  {key:40s} {n:4d} {sec * 1e3:8.1f} {sec / n * 1e3:7.2f}")


def bare(cmd, env, world, sizes, ranks, train=False) -> int:
    """The same workers on the host loopback (no namespaces, no tbf): the CPU-only floor."""
    procs = [subprocess.Popen(cmd, env={**os.environ, **env, "RANK": str(r), "WORLD_SIZE": str(world),
                                        "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for r in range(world)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if train:
        node = next(json.loads(l[len(MARK):]) for l in outs[0].splitlines() if l.startswith(MARK))
        print("bare loopback trainer steps (ms):", [round(st["s"] * 1e3, 1) for st in node["steps"]])
        print_calls(node)
        return 0
    data = next(json.loads(l[len(MARK):]) for l in outs[0].splitlines() if l.startswith(MARK))
    print(f"bare loopback, all_reduce among {ranks} of {world} rank(s)")
    print(f"{'size':>9} {'median ms':>10} {'min ms':>8}")
    for size in sizes:
        d = data[str(size)]
        print(f"{size:>9} {d['median_ms']:10.2f} {d['min_ms']:8.2f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="emu-flat4")
    ap.add_argument("--one-node", type=int, default=0, help="build a 1-node topology of N ranks instead")
    ap.add_argument("--GBps", type=float, default=0.125, help="per-rank group bandwidth for --one-node")
    ap.add_argument("--ranks", type=int, default=0, help="all_reduce among the first N ranks (default all)")
    ap.add_argument("--group-size", type=int, default=0, help="concurrent groups of this many ranks")
    ap.add_argument("--stride", type=int, default=1, help="rank distance inside a group")
    ap.add_argument("--train", help="run the reference trainer with these arguments instead")
    ap.add_argument("--train-worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ap.add_argument("--layer", metavar="HIDDEN,TP,SEQ,MBS[,HEADS]",
                    help="instead: time a GPT layer shard's forward+backward (TP ranks at once) and "
                         "print the per-rank link rate at which its TP all_reduces take as long")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--bare", action="store_true", help="no emulation: same ranks on the host's loopback")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--sysctl", action="append", help="KEY=VALUE set in every node namespace")
    ap.add_argument("--cc", help="TCP congestion control inside the namespaces (e.g. cubic)")
    ap.add_argument("--verbose", action="store_true", help="print every timing")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each timed all_reduce")
    ap.add_argument("--compute-ms", type=float, default=0.0, help="matmul time before each timed all_reduce")
    ap.add_argument("--burst", type=int, default=0, help="override the tbf burst (bytes) for experiments")
    ap.add_argument("--burst-ms", type=float, default=None, help="EmulatedCluster(burst_ms=...)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train_worker is not None:
        train_worker(args.train_worker)
        return 0
    if args.layer:
        return layer_report(*[int(v) for v in args.layer.split(",")])
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args)
        return 0

    from megatron_oases.topology import Topology, load_topology
    from megatron_oases.topology.emulate import EmulatedCluster, describe

    if args.one_node:
        topo = Topology.from_dict({"name": f"emu-1x{args.one_node}", "levels": [
            {"name": "lo", "size": args.one_node, "scope": "intra_node",
             "p2p_bandwidth_GBps": args.GBps, "group_bandwidth_GBps": args.GBps, "latency_us": 20}]})
    else:
        topo = load_topology(args.topology)
    ranks = args.ranks or topo.world_size
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--ranks", str(ranks),
           "--sizes", ",".join(map(str, args.sizes)), "--repeats", str(args.repeats),
           "--group-size", str(args.group_size), "--stride", str(args.stride), "--gap-ms", str(args.gap_ms),
           "--compute-ms", str(args.compute_ms)]
    groups = make_groups(topo.world_size, ranks, args.group_size, args.stride)
    if args.train:
        cmd = [sys.executable, os.path.abspath(__file__), "--train-worker", *args.train.split()]
    if args.bare:
        return bare(cmd, env, topo.world_size, args.sizes, ranks, train=bool(args.train))
    if args.burst:
        from megatron_oases.topology import netns
        orig = netns.tbf_params
        netns.tbf_params = lambda rate, *a: (args.burst, max(orig(rate, *a)[1], 2 * args.burst))  # noqa: E731
    extra = {} if args.burst_ms is None else {"burst_ms": args.burst_ms}
    with EmulatedCluster(topo, prefix="moasesprobe", latency=not args.no_latency, **extra) as c:
        print(describe(c))
        nss = [c.node_ns(n) for n in range(topo.num_nodes)]
        for kv in args.sysctl or []:  # experiments: e.g. net.ipv4.tcp_rmem="4096 4194304 16777216"
            for ns in nss:
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", kv], check=True)
        if args.cc:
            for ns in nss + [c.switch_ns]:
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={args.cc}"], check=True)
        cc = subprocess.run(["ip", "netns", "exec", nss[0], "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                            capture_output=True, text=True).stdout.strip()
        print(f"tcp congestion control in node ns: {cc}")
        before = {ns: _nstat(ns) for ns in nss}
        t0 = time.monotonic()
        res = c.launch(cmd, env=env, timeout=600, cwd=ROOT)
        wall = time.monotonic() - t0
        after = {ns: _nstat(ns) for ns in nss}
        qd = {ns: _qdisc_stats(ns) for ns in nss + [c.switch_ns]}
    if not res.ok:
        print("launch failed:", res.exit_code, "\n".join(o[-3000:] for o in res.outputs))
        return 1
    if args.train:
        return report_train(res, topo, cc)
    data = next(json.loads(l[len(MARK):]) for l in res.outputs[0].splitlines() if l.startswith(MARK))
    print(f"\nall_reduce in groups {groups} of {topo.name} (launch {wall:.1f}s)")
    print(f"{'size':>9} {'median ms':>10} {'min ms':>8} {'expect ms':>10} {'ratio':>6} {'GB/s busbw':>10}")
    rows = []
    for size in args.sizes:
        d = data[str(size)]
        exp = expected_ms(size, topo, groups)
        p = len(groups[0])
        bus = ring_factor("all_reduce", p) * size / (d["median_ms"] / 1e3) / 1e9
        rows.append({"bytes": size, **d, "expected_ms": exp, "ratio": d["median_ms"] / exp})
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"{label:>9} {d['median_ms']:10.2f} {d['min_ms']:8.2f} {exp:10.2f} {d['median_ms'] / exp:6.2f} {bus:10.4f}")
        if args.verbose:
            print("          ", d["all_ms"])
    print("\ncounters during the run (per node namespace):")
    for ns in nss:
        delta = {k: after[ns].get(k, 0) - before[ns].get(k, 0) for k in after[ns]}
        print(f"  {ns}: {delta}")
    for ns, lines in qd.items():
        for line in lines:
            print(f"  {ns} {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"topology": topo.name, "ranks": ranks, "cc": cc, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
