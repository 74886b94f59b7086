"""Where the CPU goes in a relayed send, on the emulated cluster.

Every emulated host runs on this machine's cores, so past a few hosts the
relay's CPU work, not the emulated NICs, can set the time. This script
makes an emulated cluster (1 Gbit/s NICs; the trainer on host 0, one Ray
actor on each receiving host), makes two untimed sends, then times
``--sends`` sends of ``--size`` MiB with ``RayWeightSyncScheme`` while
counting, from ``/proc``, the CPU time of every process in the cluster's
namespaces (by host and process name) and the machine's softirq time (the
kernel's packet work, which no process is charged for).

It prints the median send, the CPU per send by process and per relayed
host (also as core-ms per GiB sent), and the bound the CPU puts on a
send: (cluster CPU + softirq) per send / cores. A send can be no faster
than that bound on this machine, whatever the network.

Run (root, iproute2): ``python benchmarks/relay_cpu.py [--hosts 7] [--size 64] [--sends 10]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from weightsync.bench import EmulatedCluster
from weightsync.bench import emulation_unavailable_reason as unavailable_reason

# Runs on host 0: the trainer. Prints READY, waits for a line, times the
# sends, prints TIMES [...], waits for a line, shuts down.
DRIVER = """
import json, os, sys, time
import ray, torch
import weightsync as ws
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from weightsync.bench import MIB, HostActor, mlp_shapes, receiving_nodes

hosts, mib, sends = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
actor_class = ray.remote(num_cpus=0)(HostActor)
actors = [
    actor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    for node, _ in receiving_nodes()[:hosts]
]
shapes = mlp_shapes(int(mib * MIB), 8)
source = {name: torch.randn(shape) for name, shape in shapes.items()}
scheme = ws.RayWeightSyncScheme(timeout=300.0)
ray.get([a.setup.remote(shapes, scheme, "policy") for a in actors])
scheme.init_on_sender("policy", remote_collectors=actors, model=source)
scheme.connect()
scheme.send()
scheme.send()
print("READY", flush=True)
sys.stdin.readline()
times = []
first = next(iter(source.values()))
for step in range(sends):
    first.view(-1)[step] += 1.0
    started = time.perf_counter()
    scheme.send()
    times.append(time.perf_counter() - started)
print("TIMES", json.dumps(times), flush=True)
sys.stdin.readline()
scheme.shutdown()
"""


def _cpu_by_process(namespaces: list[str]) -> dict[tuple[int, str], float]:
    """CPU seconds so far of every process in ``namespaces``, summed by
    (host, process name)."""
    inodes = {os.stat(f"/run/netns/{name}").st_ino: host for host, name in enumerate(namespaces)}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, str], float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            host = inodes.get(os.stat(f"/proc/{entry}/ns/net").st_ino)
            if host is None:
                continue
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/comm") as f:
                name = f.read().strip()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        key = (host, name)
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _softirq_seconds() -> float:
    with open("/proc/stat") as f:
        return int(f.readline().split()[7]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=7, help="receiving hosts (default 7)")
    parser.add_argument("--size", type=float, default=64.0, help="MiB per send (default 64)")
    parser.add_argument("--sends", type=int, default=10, help="timed sends (default 10)")
    args = parser.parse_args()
    why = unavailable_reason()
    if why is not None:
        raise SystemExit(f"relay_cpu: cannot run here: {why}")
    with EmulatedCluster(args.hosts + 1, "1gbit") as cluster:
        cluster.start_ray(cpus=3, object_store_mib=max(1024, int(3 * args.size)))
        driver = cluster.popen(
            0, [sys.executable, "-c", DRIVER, str(args.hosts), str(args.size), str(args.sends)],
            env={"RAY_ADDRESS": cluster.ray_address or ""},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert driver.stdin is not None and driver.stdout is not None
        if not driver.stdout.readline().startswith("READY"):
            raise SystemExit("relay_cpu: the driver failed before its first timed send")
        before, soft_before = _cpu_by_process(cluster.namespaces), _softirq_seconds()
        wall_before = time.time()
        driver.stdin.write("\n")
        driver.stdin.flush()
        line = driver.stdout.readline()
        after, soft_after, wall = _cpu_by_process(cluster.namespaces), _softirq_seconds(), time.time()
        driver.stdin.write("\n")
        driver.stdin.flush()
        driver.wait(120)
    if not line.startswith("TIMES"):
        raise SystemExit("relay_cpu: the driver failed during the timed sends")
    times = json.loads(line.removeprefix("TIMES"))
    per_send = {key: (after.get(key, 0.0) - before.get(key, 0.0)) / args.sends for key in after}
    cluster_cpu = sum(per_send.values())
    softirq = (soft_after - soft_before) / args.sends
    cores = os.cpu_count() or 1
    median = statistics.median(times)
    floor = args.size * (1 << 20) / 125e6
    print(f"{args.size:g} MiB to {args.hosts} hosts, 1 Gbit/s NICs, {cores} cores; {args.sends} sends "
          f"in {wall - wall_before:.2f} s")  # fmt: skip
    print(f"median send {median * 1e3:.0f} ms ({median / floor:.2f}x the floor S/B = {floor * 1e3:.0f} ms)")
    print(f"CPU per send: cluster processes {cluster_cpu * 1e3:.0f} ms, softirq {softirq * 1e3:.0f} ms")
    # Each receiving host's processes (relay agent, actor, raylet...), per GiB sent.
    gib = args.size / 1024
    hosts_cpu = [sum(v for (h, _), v in per_send.items() if h == host) for host in range(1, args.hosts + 1)]
    trainer_host = sum(v for (h, _), v in per_send.items() if h == 0)
    print(f"CPU per send of each relayed host: {min(hosts_cpu) * 1e3:.0f} to {max(hosts_cpu) * 1e3:.0f} ms, "
          f"{statistics.mean(hosts_cpu) * 1e3 / gib:.0f} core-ms per GiB on average "
          f"(the trainer's host: {trainer_host * 1e3:.0f} ms)")  # fmt: skip
    bound = (cluster_cpu + softirq) / cores
    print(f"CPU bound on a send here: {bound * 1e3:.0f} ms ({bound / floor:.2f}x the floor)")
    print("by host and process (ms per send):")
    for (host, name), seconds in sorted(per_send.items(), key=lambda kv: -kv[1]):
        if seconds * 1e3 >= 1.0:
            print(f"  host {host}  {name:<24} {seconds * 1e3:7.1f}")


if __name__ == "__main__":
    main()
