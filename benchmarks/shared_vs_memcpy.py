"""Zero-copy sends: SharedMemWeightSyncScheme against one memcpy, and against
the multiprocess scheme for small updates.

Every case runs back to back sends (each returns once every worker moved to
the new version and acked); the workers' weights are checked once, after the
last send, against the trainer's (every element of every tensor holds the
version number). In the same run: a single-threaded memcpy of the same bytes.

Targets: 128 and 512 MiB to 1, 2 and 4 workers, median within 1.2x of one
single-threaded memcpy; 1 MiB to 4 workers, median no more than the
multiprocess scheme's.

Run: ``python benchmarks/shared_vs_memcpy.py [--size 128 512] [--workers 1 2 4]``.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import torch
from tensordict import TensorDict

import weightsync as ws

MIB = 1 << 20
TENSORS = 8


def _model(nbytes: int) -> TensorDict:
    numel = nbytes // 4 // TENSORS
    return TensorDict({f"w{i}": torch.zeros(numel) for i in range(TENSORS)}, batch_size=[])


def worker(scheme: ws.WeightSyncScheme, pipe: Connection, ctrl: Connection, nbytes: int) -> None:
    torch.set_num_threads(1)
    model = _model(nbytes)
    scheme.init_on_worker("policy", pipe=pipe, model=model)
    try:
        while not ctrl.poll():
            try:
                scheme.receive(timeout=0.2)
            except ws.SenderLostError:
                break
        ctrl.recv()
        lo, hi = min(float(t.min()) for t in model.values()), max(float(t.max()) for t in model.values())
        ctrl.send((lo, hi))
    finally:
        scheme.shutdown()


def memcpy_ms(nbytes: int, repeats: int) -> float:
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        ctypes.memmove(b.data_ptr(), a.data_ptr(), nbytes)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def run(kind: str, nbytes: int, workers: int, repeats: int) -> float:
    ctx = mp.get_context("spawn")
    scheme: ws.WeightSyncScheme = (
        ws.SharedMemWeightSyncScheme() if kind == "shared" else ws.MultiProcessWeightSyncScheme()
    )
    pipes, ctrls, procs = [], [], []
    for _ in range(workers):
        ours, theirs = ctx.Pipe()
        ctrl, ctrl_child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(scheme, theirs, ctrl_child, nbytes), daemon=True)
        proc.start()
        theirs.close()
        pipes.append(ours)
        ctrls.append(ctrl)
        procs.append(proc)
    trainer = _model(nbytes)
    scheme.init_on_sender("policy", pipes=pipes, model=trainer)
    samples = []
    try:
        scheme.get_sender().connect(timeout=120)
        for step in range(3 + repeats):
            for tensor in trainer.values():
                tensor.fill_(step + 1)
            start = time.perf_counter()
            scheme.send(timeout=120)
            if step >= 3:
                samples.append(time.perf_counter() - start)
        for ctrl in ctrls:
            ctrl.send("stop")
        for ctrl in ctrls:
            if ctrl.recv() != (3 + repeats, 3 + repeats):
                raise SystemExit(f"a {kind} worker does not hold the last version")
    finally:
        scheme.shutdown()
        for proc in procs:
            proc.join(30)
    return statistics.median(samples) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", nargs="+", type=float, default=[128.0, 512.0], help="MiB")
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    worst = 0.0
    for size in args.size:
        nbytes = int(size * MIB)
        for workers in args.workers:
            copy = memcpy_ms(nbytes, 5)
            shared = run("shared", nbytes, workers, args.repeats)
            copy = (copy + memcpy_ms(nbytes, 5)) / 2
            worst = max(worst, shared / copy)
            print(
                f"{size:7.1f} MiB {workers} workers: shared {shared:8.2f} ms, 1 memcpy {copy:8.2f} ms, "
                f"ratio {shared / copy:.2f}",
                flush=True,
            )
    print(f"worst ratio {worst:.2f} (target <= 1.2: {'met' if worst <= 1.2 else 'missed'})")
    small = {kind: run(kind, MIB, 4, 300) for kind in ("multiprocess", "shared")}
    print(
        f"1 MiB to 4 workers: shared {small['shared']:.3f} ms, multiprocess {small['multiprocess']:.3f} ms "
        f"({'met' if small['shared'] <= small['multiprocess'] else 'missed'}: shared <= multiprocess)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
