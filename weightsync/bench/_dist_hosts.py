"""``weightsync bench --scheme distributed --emulate-hosts N``: the
torch.distributed scheme across hosts, against the network floor and two
gloo peers, on an emulated cluster (no Ray).

A case sends S bytes (a model of 8 float32 tensors) from the trainer (rank
0, host 0) to ``per_host`` workers on each of H receiving hosts (ranks
round robin over the hosts), timed three ways, each verified bit for bit
(CRC32 of every tensor on every worker) after every send, outside the
timing:

- ``weightsync``: ``DistributedWeightSyncScheme.send()`` (a pipelined gloo
  chain of the workers, host by host);
- ``gloo bcast``: a gloo ``broadcast`` of one flat buffer to every worker,
  which each copies into its model;
- ``gloo star``: one gloo ``send`` of the flat buffer to each worker in
  turn, as torchrl's ``DistributedWeightSyncScheme`` sends.

With several workers per host, the scheme's target is the floor plus one
local copy (a host leader's followers copy the bytes out of its shared
memory): the row's ``copy`` is a one-thread copy of S bytes, timed in the
trainer's process (as the workers copy), median of 5.

Processes: :func:`run_case` (in the machine's own namespace) starts
``python -m weightsync.bench._dist_hosts trainer ...`` on host 0 and one
``... worker ...`` per rank on its host. The trainer drives the workers
through commands in a TCPStore of its own (``cmd/<k>``, read by every
worker in order) and prints one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import weightsync as ws

from ._hosts import NAMESPACES_ENV, cpu_seconds_in, gloo_peer_group, namespace_inodes
from ._memcpy import memcpy_seconds
from ._model import mlp_shapes, tensor_checksums, unflatten_into
from ._netns import EmulatedCluster

__all__ = [
    "control_store",
    "emulate_distributed",
    "format_distributed_table",
    "run_trainer_and_workers",
    "wait_keys",
]

MIB = 1 << 20
MODEL_ID = "bench"
_POLL = 0.002
_TIMEOUT = 300.0


def control_store(host: str, port: int, master: bool) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        host, port, is_master=master, wait_for_workers=False, timeout=datetime.timedelta(seconds=_TIMEOUT)
    )


def wait_keys(store: Any, keys: Sequence[str], timeout: float = _TIMEOUT) -> list[bytes]:
    deadline = time.monotonic() + timeout
    while not store.check(list(keys)):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {list(keys)[:3]}... in the store within {timeout} s")
        time.sleep(_POLL)
    return [bytes(store.get(k)) for k in keys]


# -- a worker (one rank) ------------------------------------------------------


def worker_main(host: str, port: int, ctrl_port: int, rank: int, mib: float) -> None:
    """Worker ``rank``: takes the trainer's sends whichever way they come."""
    # torch's default thread count, as users' processes run.
    tensors = {name: torch.zeros(shape) for name, shape in mlp_shapes(int(mib * MIB), 8).items()}
    # Applied in the background as each update arrives, so that this thread
    # waits for commands in the control store's server: on one machine
    # that emulates every host, polling workers would take CPU from the sends.
    scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=_TIMEOUT)
    scheme.init_on_worker(MODEL_ID, model=tensors, worker_idx=rank, store_info={"host": host, "port": port})
    ctrl = control_store(host, ctrl_port, master=False)
    ctrl.set(f"up/{rank}", b"1")
    scheme.connect()
    group: Any = None
    flat = torch.empty(sum(t.numel() for t in tensors.values()))
    k = 0
    try:
        while True:
            key = f"cmd/{k + 1}"
            try:
                ctrl.wait([key], datetime.timedelta(seconds=1))
            except RuntimeError:  # its timeout: is the trainer still there?
                try:
                    scheme.receive()
                except ws.SenderLostError:
                    return
                continue
            k += 1
            command, tag = json.loads(bytes(ctrl.get(key)))
            if command == "crc":
                ctrl.set(f"crc/{tag}/{rank}", json.dumps(tensor_checksums(tensors)).encode())
            elif command == "join":
                address = str(ctrl.get(f"address/{rank}").decode())
                group = gloo_peer_group(ctrl, tag, rank, int(ctrl.get("size")), address, _TIMEOUT)
            elif command in ("bcast", "star"):
                if command == "bcast":
                    group.broadcast(flat, 0).wait()
                else:
                    group.recv([flat], 0, 0).wait()
                unflatten_into(flat, tensors)
                ctrl.set(f"done/{tag}/{rank}", b"1")
            elif command == "quit":
                return
    finally:
        scheme.shutdown()


# -- the trainer ----------------------------------------------------------------


def trainer_main(
    host: str, workers: int, mib: float, repeats: int, peers: bool, addresses: list[str]
) -> None:
    """The trainer: prints ``PORTS <scheme store> <control store>``, waits for
    the workers, times every way, prints one JSON row."""
    # torch's default thread count, as users' processes run.
    shapes = mlp_shapes(int(mib * MIB), 8)
    source = {name: torch.randn(shape) for name, shape in shapes.items()}
    nbytes = sum(t.numel() * 4 for t in source.values())
    scheme = ws.DistributedWeightSyncScheme(timeout=_TIMEOUT)
    scheme.init_on_sender(MODEL_ID, num_workers=workers, model=source, host=host)
    ctrl = control_store(host, 0, master=True)
    info = scheme.get_store_info()
    assert info is not None
    print(f"PORTS {info['port']} {ctrl.port}", flush=True)
    ranks = range(1, workers + 1)
    wait_keys(ctrl, [f"up/{r}" for r in ranks])
    commands = 0

    def command(name: str, tag: Any) -> None:
        nonlocal commands
        commands += 1
        ctrl.set(f"cmd/{commands}", json.dumps([name, tag]).encode())

    want = tensor_checksums(source)

    def change(step: int) -> None:
        first = next(iter(source.values()))
        first.view(-1)[step % first.numel()] += 1.0
        want[:] = tensor_checksums(source)

    def check(tag: str) -> None:
        command("crc", tag)
        got = [json.loads(v) for v in wait_keys(ctrl, [f"crc/{tag}/{r}" for r in ranks])]
        bad = [r for r, g in zip(ranks, got, strict=True) if g != want]
        if bad:
            raise SystemExit(f"{tag}: ranks {bad} do not hold the trainer's weights")

    row: dict[str, Any] = {"hosts": len(set(addresses)), "workers": workers, "mib": mib, "bytes": nbytes}
    row["copy"] = memcpy_seconds(nbytes, 5)
    scheme.connect()
    scheme.send()  # untimed: every buffer touched once
    times, cpu = [], 0.0
    report: ws.SendReport | None = None
    hosts_here = namespace_inodes(os.environ.get(NAMESPACES_ENV, "").split())
    for step in range(repeats):
        change(step)
        before = cpu_seconds_in(hosts_here) if hosts_here else 0.0
        started = time.perf_counter()
        report = scheme.send()
        times.append(time.perf_counter() - started)
        cpu += cpu_seconds_in(hosts_here) - before if hosts_here else 0.0
        check(f"ws{step}")
    row["weightsync"] = times
    if hosts_here:
        # The share of this machine's CPUs the emulated hosts used during the sends.
        row["cpu"] = cpu / (sum(times) * (os.cpu_count() or 1))
    if report is not None and report.chain is not None and report.chain.routes:
        chain, fed = report.chain.routes[-1]
        row["chain"], row["fed"] = list(chain), {str(k): list(v) for k, v in fed.items()}
    if peers:
        for r, address in zip(ranks, addresses, strict=True):
            ctrl.set(f"address/{r}", address.encode())
        ctrl.set("size", str(workers + 1).encode())
        command("join", "peers/")
        group = gloo_peer_group(ctrl, "peers/", 0, workers + 1, host, _TIMEOUT)
        flat = torch.empty(nbytes // 4)
        for name in ("bcast", "star"):
            times = []
            for step in range(-1, repeats):  # a first round untimed
                change(1000 + step)
                tag = f"{name}{step}"
                started = time.perf_counter()
                torch.cat([t.view(-1) for t in source.values()], out=flat)
                command(name, tag)
                if name == "bcast":
                    group.broadcast(flat, 0).wait()
                else:
                    for r in ranks:  # one worker after the other, as torchrl's scheme
                        group.send([flat], r, 0).wait()
                wait_keys(ctrl, [f"done/{tag}/{r}" for r in ranks])
                if step >= 0:
                    times.append(time.perf_counter() - started)
                check(f"c{tag}")
            row[f"gloo_{name}"] = times
    command("quit", 0)
    scheme.shutdown()
    print(json.dumps(row), flush=True)


# -- on the emulated cluster ----------------------------------------------------------


def host_of(rank: int, hosts: int) -> int:
    """The host of ``rank``: round robin over hosts 1..``hosts``."""
    return (rank - 1) % hosts + 1


# An emulated host has no name its resolver knows: c10d warns so on every
# store connection, between the rows of the table. Its errors still show.
_QUIET = {"TORCH_CPP_LOG_LEVEL": "ERROR"}


def run_trainer_and_workers(
    cluster: EmulatedCluster,
    trainer_argv: list[str],
    workers: Callable[[list[str]], list[tuple[int, list[str]]]],
    timeout: float,
) -> dict[str, Any]:
    """Start ``trainer_argv`` on host 0 (it prints ``PORTS ...`` first, then
    one JSON row), then ``workers(ports)``: (host, argv) of each worker, given
    what followed ``PORTS``. Returns the trainer's last row; every process is
    waited for (killed after 30 s) before it returns.

    :raises RuntimeError: the trainer did not start, or failed.
    """
    env = {**_QUIET, NAMESPACES_ENV: " ".join(cluster.namespaces)}
    trainer = cluster.popen(
        0, trainer_argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    procs = []
    try:
        assert trainer.stdout is not None
        first = trainer.stdout.readline().split()
        if first[:1] != ["PORTS"]:
            raise RuntimeError(f"the trainer did not start: {trainer.communicate()[1][-3000:]}")
        for host, argv in workers(first[1:]):
            procs.append(cluster.popen(host, argv, env=_QUIET, stdout=subprocess.DEVNULL))
        out, err = trainer.communicate(timeout=timeout)
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if trainer.returncode != 0 or not rows:
            raise RuntimeError(f"the trainer failed: {err[-3000:]}")
        return dict(rows[-1])
    finally:
        for proc in [trainer, *procs]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_case(
    cluster: EmulatedCluster, hosts: int, per_host: int, mib: float, repeats: int, peers: bool
) -> dict[str, Any]:
    """One case on ``cluster``: the trainer on host 0, ``per_host`` workers on
    each of hosts 1..``hosts``. Returns the trainer's row.

    :raises RuntimeError: a process failed.
    """
    workers = hosts * per_host
    host = cluster.addresses[0]
    addresses = [cluster.addresses[host_of(r, hosts)] for r in range(1, workers + 1)]
    argv = [sys.executable, "-m", "weightsync.bench._dist_hosts", "trainer", host,
            str(workers), str(mib), str(repeats), "1" if peers else "0", *addresses]  # fmt: skip

    def worker_argvs(ports: list[str]) -> list[tuple[int, list[str]]]:
        module = [sys.executable, "-m", "weightsync.bench._dist_hosts", "worker", host, *ports[:2]]
        return [(host_of(r, hosts), [*module, str(r), str(mib)]) for r in range(1, workers + 1)]

    return run_trainer_and_workers(cluster, argv, worker_argvs, _TIMEOUT * 2)


def emulate_distributed(
    total_hosts: int,
    rate: str,
    hosts: Sequence[int],
    sizes_mib: Sequence[float],
    per_host: int,
    repeats: int,
    peers: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Make an emulated cluster of ``total_hosts`` hosts and run every case
    there; return the rows and the link rate in bytes/s. Needs root."""
    log = progress or (lambda text: None)
    rows = []
    with EmulatedCluster(total_hosts, rate) as cluster:
        log(f"emulated cluster: {total_hosts} hosts, {rate} NICs")
        for mib in sizes_mib:
            for count in hosts:
                rows.append(run_case(cluster, count, per_host, mib, repeats, peers))
                log(format_distributed_table(rows[-1:], cluster.bytes_per_second, header=False))
        return {"rows": rows, "bytes_per_second": cluster.bytes_per_second, "rate": rate}


def format_distributed_table(
    rows: Sequence[dict[str, Any]], bytes_per_second: float, header: bool = True
) -> str:
    """Median ms of each way, and x the floor S/B; with several workers per
    host, the copy (ms) and the scheme's time over floor + copy."""
    import statistics

    lines = []
    if header:
        lines.append(
            f"{'hosts':>5} {'wkr/h':>5} {'MiB':>6} {'floor ms':>9} {'weightsync ms':>14} {'x floor':>7} "
            f"{'gloo bcast':>11} {'x floor':>7} {'gloo star':>10} {'x floor':>7} {'cpu':>4} {'copy ms':>8} "
            f"{'x(f+c)':>7}"
        )
    for row in rows:
        floor = row["bytes"] / bytes_per_second

        def cell(key: str, width: int, row: dict[str, Any] = row, floor: float = floor) -> str:
            if key not in row:
                return f"{'-':>{width}} {'':>7}"
            med = statistics.median(row[key])
            return f"{med * 1e3:>{width}.0f} {f'{med / floor:.2f}x':>7}"

        per_host = row["workers"] // max(row["hosts"], 1)
        copy = ""
        if per_host > 1 and row.get("copy"):
            med, ws_med = statistics.median(row["copy"]), statistics.median(row["weightsync"])
            copy = f" {med * 1e3:>8.0f} {f'{ws_med / (floor + med):.2f}x':>7}"
        cpu = f"{row['cpu']:.0%}" if "cpu" in row else "-"
        lines.append(
            f"{row['hosts']:>5} {per_host:>5} {row['mib']:>6g} {floor * 1e3:>9.0f} "
            f"{cell('weightsync', 14)} {cell('gloo_bcast', 11)} {cell('gloo_star', 10)} {cpu:>4}{copy}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m weightsync.bench._dist_hosts")
    roles = parser.add_subparsers(dest="role", required=True)
    trainer = roles.add_parser("trainer")
    trainer.add_argument("host")
    trainer.add_argument("workers", type=int)
    trainer.add_argument("mib", type=float)
    trainer.add_argument("repeats", type=int)
    trainer.add_argument("peers", type=int)
    trainer.add_argument("addresses", nargs="+")
    worker = roles.add_parser("worker")
    worker.add_argument("host")
    worker.add_argument("port", type=int)
    worker.add_argument("ctrl_port", type=int)
    worker.add_argument("rank", type=int)
    worker.add_argument("mib", type=float)
    args = parser.parse_args(argv)
    if args.role == "trainer":
        trainer_main(args.host, args.workers, args.mib, args.repeats, bool(args.peers), args.addresses)
    else:
        worker_main(args.host, args.port, args.ctrl_port, args.rank, args.mib)


if __name__ == "__main__":
    main()
