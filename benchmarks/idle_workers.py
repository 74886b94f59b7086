"""What idle torch.distributed workers cost their trainer and their host.

Between sends (a trainer's step can take seconds), every worker of a
``DistributedWeightSyncScheme`` waits for its next notice. This script
starts ``--workers`` worker processes on this host (spawned, each with
``sync=False``, as a collector whose loop is not the user's), connects
them, makes one send, then counts, from ``/proc``, the CPU time of the
trainer's process and of all the workers over ``--seconds`` of idleness,
and times one more send after it (a worker woken from idle).

Run: ``python benchmarks/idle_workers.py [--workers 12] [--seconds 10]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from typing import Any

import torch

import weightsync as ws

MODEL_ID = "idle"


def _worker(info: dict[str, Any], rank: int, done: Any) -> None:
    model = {"w": torch.zeros(1 << 16)}
    scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=60.0)
    scheme.init_on_worker(MODEL_ID, model=model, worker_idx=rank, store_info=info)
    scheme.connect()
    done.wait()
    scheme.shutdown()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    model = {"w": torch.randn(1 << 16)}
    scheme = ws.DistributedWeightSyncScheme(timeout=120.0)
    scheme.init_on_sender(MODEL_ID, num_workers=args.workers, model=model, host="127.0.0.1")
    info = scheme.get_store_info()
    done = ctx.Event()
    procs = [ctx.Process(target=_worker, args=(info, r, done)) for r in range(1, args.workers + 1)]
    for proc in procs:
        proc.start()
    try:
        scheme.connect()
        scheme.send()
        time.sleep(1.0)  # the first send's acks and the workers' own work settle
        pids = [p.pid for p in procs if p.pid is not None]
        before = _cpu_seconds(os.getpid()), sum(_cpu_seconds(p) for p in pids)
        time.sleep(args.seconds)
        after = _cpu_seconds(os.getpid()), sum(_cpu_seconds(p) for p in pids)
        started = time.perf_counter()
        scheme.send()
        woken = time.perf_counter() - started
        trainer, workers = ((b - a) * 1e3 / args.seconds for a, b in zip(before, after, strict=True))
        print(f"{args.workers} idle workers, {args.seconds:g} s:")
        print(f"  trainer's process: {trainer:.1f} ms of CPU per second")
        print(f"  all workers: {workers:.1f} ms of CPU per second ({workers / args.workers:.2f} each)")
        print(f"  the next send, to workers woken from idle: {woken * 1e3:.1f} ms")
    finally:
        done.set()
        scheme.shutdown()
        for proc in procs:
            proc.join(60)


if __name__ == "__main__":
    main()
