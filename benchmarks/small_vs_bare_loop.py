"""Small updates: weightsync against a bare shared-memory copy loop.

1 MiB of weights as 8 float32 tensors, sent to 4 worker processes. Both sides
are measured in this script, on the same machine, in the same run:

- weightsync: the median of ``MultiProcessWeightSyncScheme.send()`` (every
  worker applied and acked), verified after every send (outside the timing)
  by ``weightsync bench``'s engine;
- bare loop: the trainer copies its tensors into one preallocated shared
  buffer (``Tensor.share_memory_()``), writes a few bytes to each worker's
  pipe, each worker copies the tensors out into its own preallocated tensors
  and replies; the median of full rounds. Like weightsync's sends, every
  round is verified (each worker's checksums against the trainer's) after it,
  outside the timing. Half of its rounds run before the
  weightsync run and half after, so a change in the machine's load in the
  meantime hits both alike.

The bare loop is the least a correct transport must do (one copy in, one out
per worker, one notification and one reply per worker); everything weightsync
adds on top (the event loop, acks with versions, liveness checks, validation)
shows as the ratio.

Target: weightsync median / bare loop median <= 1.5.

Run: ``python benchmarks/small_vs_bare_loop.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import struct
import sys
import time
from multiprocessing.connection import Connection

import torch

from weightsync.bench import (
    MIB,
    BenchConfig,
    BenchError,
    GeneratedMLP,
    VerificationError,
    describe_machine,
    format_table,
    machine_facts,
    mlp_shapes,
    run_bench,
    tensor_checksums,
)

TARGET = 1.5
ALIGN = 64  # the same cache-line alignment weightsync gives each tensor
_VERSION = struct.Struct("<q")
_STOP = -1


def _layout(shapes: dict[str, tuple[int, ...]]) -> tuple[list[tuple[str, tuple[int, ...], int]], int]:
    """(name, shape, offset) per tensor in name order, and the buffer's size."""
    entries = []
    offset = 0
    for name in sorted(shapes):
        shape = shapes[name]
        entries.append((name, shape, offset))
        nbytes = 4 * int(torch.Size(shape).numel())
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def _views(buffer: torch.Tensor, entries: list[tuple[str, tuple[int, ...], int]]) -> list[torch.Tensor]:
    views = []
    for _, shape, offset in entries:
        nbytes = 4 * int(torch.Size(shape).numel())
        views.append(buffer[offset : offset + nbytes].view(torch.float32).view(shape))
    return views


def bare_worker(
    buffer: torch.Tensor,
    shapes: dict[str, tuple[int, ...]],
    conn: Connection,
    threads: int,
) -> None:
    """A bare-loop worker: on each version, copy every tensor out of the shared
    buffer into its own, then echo the version. On stop, reply with the
    checksums of its tensors and exit."""
    torch.set_num_threads(threads)
    entries, _ = _layout(shapes)
    sources = _views(buffer, entries)
    model = GeneratedMLP(shapes)
    named = model.state_dict()
    targets = [named[name] for name, _, _ in entries]
    with torch.no_grad():
        while True:
            message = conn.recv_bytes()
            if _VERSION.unpack(message)[0] == _STOP:
                conn.send(tensor_checksums(named))
                return
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source)
            conn.send_bytes(message)
            # Verified after every round, outside the timed region, exactly
            # as weightsync's sends are: both loops run under the same rhythm.
            conn.send(tensor_checksums(named))


class BareLoop:
    """The trainer's side of the bare loop, with its worker processes."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], workers: int, threads: int) -> None:
        ctx = mp.get_context("spawn")
        entries, nbytes = _layout(shapes)
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8).share_memory_()
        self.model = GeneratedMLP(shapes, fill="pattern")
        named = self.model.state_dict()
        self.named = named
        self.sources = [named[name] for name, _, _ in entries]
        self.targets = _views(self.buffer, entries)
        self.version = 0
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        try:
            for _ in range(workers):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=bare_worker, args=(self.buffer, shapes, theirs, threads), daemon=True
                )
                proc.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(proc)
            self.round()  # every worker is up and its pages are touched
        except BaseException:
            self.close()
            raise

    def round(self) -> float:
        """One full round: copy in, notify every worker, wait for every reply.
        Returns its seconds."""
        self.version += 1
        message = _VERSION.pack(self.version)
        start = time.perf_counter()
        with torch.no_grad():
            for target, source in zip(self.targets, self.sources, strict=True):
                target.copy_(source)
        for conn in self.conns:
            conn.send_bytes(message)
        for conn in self.conns:
            if conn.recv_bytes() != message:
                raise RuntimeError("a bare-loop worker echoed another version")
        elapsed = time.perf_counter() - start
        expected = tensor_checksums(self.named)
        for conn in self.conns:
            if conn.recv() != expected:
                raise VerificationError("a bare-loop worker does not hold the trainer's weights")
        return elapsed

    def change(self, step: int) -> None:
        with torch.no_grad():
            self.sources[step % len(self.sources)].add_(1.0)

    def measure(self, rounds: int) -> list[float]:
        samples = []
        for step in range(rounds):
            self.change(step)
            samples.append(self.round())
        return samples

    def close(self) -> list[list[int]]:
        """Stop the workers; return each one's checksums (empty if it was gone)."""
        sums: list[list[int]] = []
        for conn in self.conns:
            try:
                conn.send_bytes(_VERSION.pack(_STOP))
                sums.append(conn.recv() if conn.poll(30) else [])
            except (OSError, EOFError):
                sums.append([])
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        return sums


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=1.0, help="MiB of weights (default: %(default)s)")
    parser.add_argument("--tensors", type=int, default=8, help="tensors (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=300, help="timed sends/rounds (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed first (default: %(default)s)")
    parser.add_argument(
        "--worker-threads", type=int, default=1, help="torch threads of each worker (default: %(default)s)"
    )
    args = parser.parse_args()

    shapes = mlp_shapes(int(args.size * MIB), args.tensors)
    print(describe_machine(machine_facts()), flush=True)
    bare = BareLoop(shapes, args.workers, args.worker_threads)
    try:
        bare.measure(args.warmup)
        before = bare.measure(args.repeats // 2)
        config = BenchConfig(
            sizes_mib=(args.size,),
            workers=(args.workers,),
            tensors=(args.tensors,),
            repeats=args.repeats,
            warmup=args.warmup,
            worker_threads=args.worker_threads,
        )
        try:
            run = run_bench(config)
        except VerificationError as exc:
            print(f"verification failed: {exc}", file=sys.stderr)
            return 1
        except BenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        after = bare.measure(args.repeats - args.repeats // 2)
    finally:
        worker_sums = bare.close()
    expected = tensor_checksums(bare.named)
    if any(sums != expected for sums in worker_sums):
        print("the bare loop's workers do not hold the trainer's weights", file=sys.stderr)
        return 1

    result = run.results[0]
    bare_samples = before + after
    bare_median = statistics.median(bare_samples)
    ratio = result.median_s / bare_median
    print(format_table(run.results))
    print(
        f"{result.nbytes / MIB:.3f} MiB as {args.tensors} tensors to {args.workers} workers, "
        f"{args.repeats} timed rounds each"
    )
    print(
        f"weightsync median {result.median_s * 1e3:.3f} ms (p90 {result.p90_s * 1e3:.3f} ms); "
        f"bare loop median {bare_median * 1e3:.3f} ms (before {statistics.median(before) * 1e3:.3f}, "
        f"after {statistics.median(after) * 1e3:.3f})"
    )
    verdict = "met" if ratio <= TARGET else "missed"
    print(f"ratio weightsync / bare loop = {ratio:.2f} (target <= {TARGET}: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
