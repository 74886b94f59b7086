"""``weightsync bench`` across hosts: the Ray scheme against the network floor
and against two star-shaped peers, on an emulated cluster or a real one.

A case sends S bytes (a model of 8 float32 tensors) from the trainer to
``per_host`` Ray actors on each of H receiving hosts, and is timed three
ways, each verified bit for bit (CRC32 of every tensor on every actor)
after every send, outside the timing:

- ``weightsync``: ``RayWeightSyncScheme.send()``; from two receiving hosts
  on it relays the bytes along a pipelined chain of the hosts;
- ``ray put/get``: one ``ray.put`` of the tensors as numpy arrays and one
  call per actor that copies them into its model (Ray's object store pulls
  one copy to each node, from the trainer's node: a star);
- ``gloo bcast``: a ``torch.distributed`` gloo ``broadcast`` of one flat
  buffer from the trainer to every actor (one rank each), which each actor
  then copies into its model.

The floor is S/B: every receiving host must take in S bytes over its NIC of
B bytes/s. On an emulated cluster the run also measures a plain TCP chain
over all the hosts at once (every link busy, nothing but sockets), so a
reader can tell the emulator's ceiling from the algorithm's cost.

:func:`run_on_cluster` is the driver: it runs where the trainer runs (on the
emulated cluster, host 0, started by :func:`emulate`) and prints one JSON
line per case. Importing this module imports neither ray nor
``torch.distributed``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import weightsync as ws

from ._model import mlp_shapes, tensor_checksums, unflatten_into
from ._netns import EmulatedCluster

__all__ = [
    "NAMESPACES_ENV",
    "HostActor",
    "cpu_seconds_in",
    "emulate",
    "format_hosts_table",
    "gloo_peer_group",
    "namespace_inodes",
    "receiving_nodes",
    "run_on_cluster",
]

MIB = 1 << 20
_STORE_PORT = 29501
NAMESPACES_ENV = "WEIGHTSYNC_BENCH_NAMESPACES"


def gloo_peer_group(
    store: Any, prefix: str, rank: int, size: int, address: str, timeout: float = 120.0
) -> Any:
    """A gloo group of its own for a peer to time, its sockets on
    ``address`` (gloo's default device takes the host name's address, which
    may be a loopback one), connected in full as gloo's own groups are."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


class HostActor:
    """One receiving actor (made a Ray actor by :func:`run_on_cluster`): holds
    one case's model at a time and takes it from whichever peer is timed."""

    def __init__(self) -> None:
        # torch's default thread count, as users' processes run.
        self.tensors: dict[str, torch.Tensor] = {}
        self.scheme: ws.RayWeightSyncScheme | None = None
        self.group: Any = None
        self.flat: torch.Tensor | None = None

    def setup(self, shapes: dict[str, tuple[int, ...]], scheme: ws.RayWeightSyncScheme, model_id: str) -> str:
        self.teardown()
        self.tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
        self.scheme = scheme
        scheme.init_on_worker(model_id, model=self.tensors)
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def checksums(self) -> list[int]:
        return tensor_checksums(self.tensors)

    def put_apply(self, arrays: Sequence[Any]) -> None:
        import warnings

        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only object-store views
            for target, array in zip(self.tensors.values(), arrays, strict=True):
                target.copy_(torch.from_numpy(array).view(target.shape))

    def gloo_join(self, host: str, port: int, prefix: str, rank: int, size: int) -> None:
        import ray
        import torch.distributed as dist

        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
        self.group = gloo_peer_group(store, prefix, rank, size, str(ray.util.get_node_ip_address()))
        self.flat = torch.empty(sum(t.numel() for t in self.tensors.values()))

    def gloo_receive(self) -> None:
        assert self.group is not None and self.flat is not None
        self.group.broadcast(self.flat, 0).wait()
        unflatten_into(self.flat, self.tensors)

    def teardown(self) -> None:
        if self.scheme is not None:
            self.scheme.shutdown()
        self.scheme, self.group, self.flat, self.tensors = None, None, None, {}


def namespace_inodes(names: Sequence[str]) -> set[int]:
    inodes = set()
    for name in names:
        with contextlib.suppress(OSError):  # not a namespace (any more)
            inodes.add(os.stat(f"/run/netns/{name}").st_ino)
    return inodes


def cpu_seconds_in(inodes: set[int]) -> float:
    """CPU seconds (user + system) used so far by the processes living in
    the network namespaces of ``inodes``: the emulated cluster's hosts."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino not in inodes:
                continue
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return total / tick


def receiving_nodes() -> list[tuple[str, str]]:
    """(node id, address) of every alive node but the driver's, by address."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [
        (n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes() if n["Alive"] and n["NodeID"] != here
    ]
    return sorted(nodes, key=lambda n: tuple(int(p) if p.isdigit() else 0 for p in n[1].split(".")))


def run_on_cluster(
    hosts: Sequence[int], sizes_mib: Sequence[float], per_host: int, repeats: int, peers: bool, out: Any
) -> None:
    """Run every case on the Ray cluster this process is connected to, one
    JSON line per case on ``out``. ``hosts``: receiving host counts (at most
    the nodes other than this one)."""
    import ray
    import torch.distributed as dist
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = receiving_nodes()
    if max(hosts) > len(nodes):
        raise SystemExit(
            f"{max(hosts)} receiving hosts asked for, the cluster has {len(nodes)} besides this one"
        )
    actor_class: Any = ray.remote(num_cpus=0)(HostActor)
    actors: dict[str, list[Any]] = {
        node: [
            actor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            for _ in range(per_host)
        ]
        for node, _ in nodes[: max(hosts)]
    }
    address = str(ray.util.get_node_ip_address())
    store = dist.TCPStore(
        address, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    # On an emulated cluster (see :func:`emulate`): its hosts' namespaces,
    # host 0 (this one) first, then one per receiving node in the order of
    # their addresses, which is the order of ``nodes``.
    names = os.environ.get(NAMESPACES_ENV, "").split()
    hosts_here = namespace_inodes(names)
    case_number = 0
    for size in sizes_mib:
        shapes = mlp_shapes(int(size * MIB), 8)
        source = {name: torch.randn(shape) for name, shape in shapes.items()}
        nbytes = sum(t.numel() * 4 for t in source.values())
        for count in hosts:
            case_number += 1
            targets = [a for node, _ in nodes[:count] for a in actors[node]]
            want = tensor_checksums(source)

            def check(step: int, want: list[int] = want, targets: list[Any] = targets) -> None:
                got = ray.get([a.checksums.remote() for a in targets])
                bad = [i for i, g in enumerate(got) if g != want]
                if bad:
                    raise SystemExit(f"step {step}: actors {bad} do not hold the trainer's weights")

            def change(step: int, want: list[int] = want, source: dict[str, torch.Tensor] = source) -> None:
                first = next(iter(source.values()))
                first.view(-1)[step % first.numel()] += 1.0
                want[:] = tensor_checksums(source)

            row: dict[str, Any] = {"hosts": count, "per_host": per_host, "mib": size, "bytes": nbytes}
            # weightsync
            scheme = ws.RayWeightSyncScheme(timeout=300.0)
            model_id = f"case{case_number}"
            ray.get([a.setup.remote(shapes, scheme, model_id) for a in targets])
            scheme.init_on_sender(model_id, remote_collectors=targets, model=source)
            # The initial send sets up the actors, the relay agents and the
            # chain; one more, untimed, touches every buffer once.
            scheme.connect()
            scheme.send()
            receiving = namespace_inodes(names[1 : count + 1])
            times, cpu, host_cpu = [], 0.0, 0.0
            for step in range(repeats):
                change(step)
                before = cpu_seconds_in(hosts_here) if hosts_here else 0.0
                before_hosts = cpu_seconds_in(receiving) if receiving else 0.0
                started = time.perf_counter()
                scheme.send()
                times.append(time.perf_counter() - started)
                cpu += cpu_seconds_in(hosts_here) - before if hosts_here else 0.0
                host_cpu += cpu_seconds_in(receiving) - before_hosts if receiving else 0.0
                check(step)
            row["weightsync"] = times
            if hosts_here:
                # The share of this machine's CPUs that the emulated hosts
                # used during those sends: near 100%, the CPUs they all run
                # on, not the emulated network, set the time.
                row["cluster_cpu"] = cpu / (sum(times) * (os.cpu_count() or 1))
            if receiving and count >= 2:
                # What one relayed host's processes (its relay agent, actors,
                # raylet) spend on a send, per GiB sent: the cost each real
                # host would pay with its own CPUs.
                row["host_cpu_ms_per_gib"] = host_cpu * 1e3 / (repeats * count * nbytes / (1 << 30))
            scheme.shutdown()
            if peers:
                # Ray put/get: a star from the trainer's node.
                times = []
                for step in range(-1, repeats):  # a first round untimed, as for weightsync
                    change(step)
                    started = time.perf_counter()
                    ref = ray.put(tuple(t.numpy() for t in source.values()))
                    ray.get([a.put_apply.remote(ref) for a in targets])
                    times += [time.perf_counter() - started][: step + 1]
                    del ref
                    check(step)
                row["ray_put"] = times
                # gloo broadcast of one flat buffer, one rank per actor.
                prefix = f"bcast{case_number}"
                joins = [
                    a.gloo_join.remote(address, int(store.port), prefix, i + 1, len(targets) + 1)
                    for i, a in enumerate(targets)
                ]
                group = gloo_peer_group(store, prefix, 0, len(targets) + 1, address)
                ray.get(joins)
                times = []
                flat = torch.empty(nbytes // 4)
                for step in range(-1, repeats):
                    change(step)
                    started = time.perf_counter()
                    torch.cat([t.view(-1) for t in source.values()], out=flat)
                    calls = [a.gloo_receive.remote() for a in targets]
                    group.broadcast(flat, 0).wait()
                    ray.get(calls)
                    times += [time.perf_counter() - started][: step + 1]
                    check(step)
                row["gloo_bcast"] = times
                del group
            ray.get([a.teardown.remote() for a in targets])
            print(json.dumps(row), file=out, flush=True)


def tcp_chain_seconds(cluster: EmulatedCluster, nbytes: int, hosts: int) -> float:
    """Seconds for ``nbytes`` to cross a chain of plain TCP relays over hosts
    0..``hosts`` at once (each host forwards each 1 MiB as it arrives): the
    emulator's own ceiling for a pipelined chain."""
    relay = (
        "import socket, sys, time\n"
        "me, nxt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind((me, {_STORE_PORT + 1})); s.listen(); print('up', flush=True)\n"
        f"out = socket.create_connection((nxt, {_STORE_PORT + 1})) if nxt != '-' else None\n"
        "conn, _ = s.accept(); buf = bytearray(1 << 20); view = memoryview(buf); got = 0\n"
        "while got < n:\n"
        "    k = conn.recv_into(view)\n"
        "    if not k: break\n"
        "    got += k\n"
        "    if out: out.sendall(view[:k])\n"
        "print(time.time(), got, flush=True)\n"
    )
    procs = []
    for i in range(hosts, 0, -1):  # the last host listens first
        nxt = cluster.addresses[i + 1] if i < hosts else "-"
        proc = cluster.popen(i, [sys.executable, "-c", relay, cluster.addresses[i], nxt, str(nbytes)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout is not None
        proc.stdout.readline()
        procs.append(proc)
    send = (
        "import socket, sys, time\n"
        f"s = socket.create_connection((sys.argv[1], {_STORE_PORT + 1})); chunk = b'x' * (1 << 20)\n"
        "start = time.time()\n"
        f"for _ in range({nbytes} // len(chunk)): s.sendall(chunk)\n"
        "s.close(); print(start, flush=True)\n"
    )
    sender = cluster.popen(
        0, [sys.executable, "-c", send, cluster.addresses[1]], stdout=subprocess.PIPE, text=True
    )
    started = float(sender.communicate(timeout=600)[0].split()[0])
    last = procs[0].communicate(timeout=600)[0].split()
    for proc in procs[1:]:
        proc.communicate(timeout=60)
    return float(last[0]) - started


def emulate(
    total_hosts: int,
    rate: str,
    hosts: Sequence[int],
    sizes_mib: Sequence[float],
    per_host: int,
    repeats: int,
    peers: bool = True,
    progress: Any = None,
) -> dict[str, Any]:
    """Make an emulated cluster of ``total_hosts`` hosts (the trainer on host
    0), start Ray on it, and run every case there; return the rows, the TCP
    ceiling per size, and the link rate in bytes/s. Needs root."""
    log = progress or (lambda text: None)
    with EmulatedCluster(total_hosts, rate) as cluster:
        log(f"emulated cluster: {total_hosts} hosts, {rate} NICs; starting Ray on each")
        cluster.start_ray(cpus=per_host + 2, object_store_mib=max(1024, int(3 * max(sizes_mib))))
        ceiling = {}
        for size in sizes_mib:
            ceiling[size] = tcp_chain_seconds(cluster, int(size * MIB), max(hosts))
            log(f"plain TCP chain over {max(hosts) + 1} hosts, {size:g} MiB: {ceiling[size] * 1e3:.0f} ms")
        argv = [
            *(sys.executable, "-m", "weightsync.bench._hosts", "--hosts", *map(str, hosts)),
            *("--size", *map(str, sizes_mib), "--per-host", str(per_host), "--repeats", str(repeats)),
        ]
        if not peers:
            argv.append("--no-peers")
        driver = cluster.popen(0, argv, env={"RAY_ADDRESS": cluster.ray_address or "",
                                    NAMESPACES_ENV: " ".join(cluster.namespaces)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        rows = []
        assert driver.stdout is not None
        for line in driver.stdout:
            if line.startswith("{"):
                rows.append(json.loads(line))
                log(format_hosts_table([rows[-1]], cluster.bytes_per_second, ceiling, header=False))
        err = driver.stderr.read() if driver.stderr else ""
        if driver.wait() != 0:
            raise RuntimeError(f"the driver on host 0 failed: {err[-3000:]}")
        return {
            "rows": rows,
            "ceiling_s": ceiling,
            "bytes_per_second": cluster.bytes_per_second,
            "rate": rate,
        }


def format_hosts_table(
    rows: Sequence[dict[str, Any]], bytes_per_second: float | None, ceiling: dict[float, float] | None = None,
    header: bool = True,
) -> str:  # fmt: skip
    """The table of :func:`emulate` (or of a real cluster: no floor unless
    ``bytes_per_second`` is given): median ms, and x the floor S/B."""
    lines = []
    if header:
        lines.append(
            f"{'hosts':>5} {'act/h':>5} {'MiB':>6} {'floor ms':>9} {'TCP chain':>10} "
            f"{'weightsync ms':>14} {'x floor':>7} {'ray put/get':>12} {'x floor':>7} "
            f"{'gloo bcast':>11} {'x floor':>7} {'cluster cpu':>11} {'host core-ms/GiB':>16}"
        )
    for row in rows:
        floor = row["bytes"] / bytes_per_second if bytes_per_second else None

        def cell(key: str, row: dict[str, Any] = row, floor: float | None = floor) -> str:
            if key not in row:
                return f"{'-':>12} {'':>7}"
            med = statistics.median(row[key])
            ratio = f"{med / floor:.2f}x" if floor else "-"
            return f"{med * 1e3:>12.0f} {ratio:>7}"

        tcp = (ceiling or {}).get(row["mib"])
        busy = f"{row['cluster_cpu']:.0%}" if row.get("cluster_cpu") is not None else "-"
        per_host = row.get("host_cpu_ms_per_gib")
        host_cpu = f"{per_host:.0f}" if per_host is not None else "-"
        lines.append(
            f"{row['hosts']:>5} {row['per_host']:>5} {row['mib']:>6g} "
            f"{(floor or 0) * 1e3:>9.0f} {(f'{tcp * 1e3:.0f}' if tcp else '-'):>10} "
            f"{cell('weightsync'):>22} {cell('ray_put')} {cell('gloo_bcast')} {busy:>11} {host_cpu:>16}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """The driver, run where the trainer runs: ``python -m weightsync.bench._hosts``."""
    parser = argparse.ArgumentParser(prog="python -m weightsync.bench._hosts")
    parser.add_argument("--hosts", type=int, nargs="+", required=True)
    parser.add_argument("--size", type=float, nargs="+", required=True)
    parser.add_argument("--per-host", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-peers", action="store_true")
    args = parser.parse_args(argv)
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.ERROR, log_to_driver=False)
    try:
        run_on_cluster(args.hosts, args.size, args.per_host, args.repeats, not args.no_peers, sys.stdout)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
