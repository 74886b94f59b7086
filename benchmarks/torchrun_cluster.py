"""``weightsync bench --scheme distributed`` under ``torchrun``, across the
hosts of an emulated cluster: one ``torchrun`` per host (static rendezvous
on host 0), as a job on a real cluster starts its ranks. Rank 0 (host 0)
is the trainer; its table is printed.

    sudo python benchmarks/torchrun_cluster.py --hosts 8 --per-host 1 --link-rate 1gbit --size 64 256

With torchrl installed (its own environment: it needs tensordict < 0.15),
the table has torchrl's ``DistributedWeightSyncScheme`` as a column too.
Needs root and iproute2, like ``--emulate-hosts``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from weightsync.bench import EmulatedCluster, emulation_unavailable_reason


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--hosts", type=int, default=8, help="hosts, the trainer's among them (default: 8)")
    parser.add_argument("--per-host", type=int, default=1, help="ranks per host (default: 1)")
    parser.add_argument("--link-rate", default="1gbit", help="each host's NIC (default: 1gbit)")
    parser.add_argument("--size", type=float, nargs="+", default=[64.0], help="MiB (default: 64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=29541, help="the rendezvous port on host 0")
    args = parser.parse_args()
    reason = emulation_unavailable_reason()
    if reason is not None:
        print(f"cannot emulate hosts here: {reason}", file=sys.stderr)
        return 2
    bench = ["-m", "weightsync", "bench", "--scheme", "distributed", "--link-rate", args.link_rate,
             "--repeats", str(args.repeats), "--size", *map(str, args.size)]  # fmt: skip
    # The bench's gloo peers use the world group, whose sockets would bind to
    # the address of the host's name (the machine's): eth0 is each host's NIC.
    env = {"GLOO_SOCKET_IFNAME": "eth0", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    with EmulatedCluster(args.hosts, args.link_rate) as cluster:
        procs = []
        for node in range(args.hosts):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.hosts),
                        "--node-rank", str(node), "--nproc-per-node", str(args.per_host),
                        "--master-addr", cluster.addresses[0], "--master-port", str(args.port)]  # fmt: skip
            argv = [*torchrun, *bench]
            out = None if node == 0 else subprocess.DEVNULL
            procs.append(cluster.popen(node, argv, env=env, stdout=out, stderr=subprocess.DEVNULL))
        codes = [proc.wait() for proc in procs]
    if any(codes):
        print(f"a torchrun failed: exit codes {codes}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
