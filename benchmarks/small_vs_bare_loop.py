"""Small updates: weightsync against a bare shared-memory copy loop.

1 MiB of weights as 8 float32 tensors, sent to 4 worker processes. Both sides
are run by ``weightsync bench``'s engine, on the same machine, in the same
run, every send and every round verified after it (outside the timing):

- weightsync: ``MultiProcessWeightSyncScheme.send()`` (every worker applied
  and acked);
- bare loop: the bench's ``bare-shm`` alternative (``weightsync bench
  --compare bare-shm``): the trainer copies its tensors into one
  preallocated shared buffer, writes a few bytes to each worker's pipe, each
  worker copies the tensors out into its own preallocated tensors and
  replies. Half of its rounds run before the weightsync run and half after,
  so a change in the machine's load in the meantime hits both alike.

The bare loop is the least a correct transport must do (one copy in, one out
per worker, one notification and one reply per worker); everything weightsync
adds on top (the event loop, acks with versions, liveness checks, validation)
shows as the ratio.

Target: weightsync median / bare loop median <= 1.5.

Run: ``python benchmarks/small_vs_bare_loop.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from weightsync.bench import (
    MIB,
    BenchConfig,
    BenchError,
    VerificationError,
    describe_machine,
    format_table,
    machine_facts,
    run_bench,
)

TARGET = 1.5


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

    weightsync = BenchConfig(
        schemes=("multiprocess",),
        sizes_mib=(args.size,),
        workers=(args.workers,),
        tensors=(args.tensors,),
        repeats=args.repeats,
        warmup=args.warmup,
        worker_threads=args.worker_threads,
    )
    bare = dataclasses.replace(weightsync, schemes=(), compare=("bare-shm",), repeats=args.repeats // 2)
    print(describe_machine(machine_facts()), flush=True)
    try:
        before = run_bench(bare).results[0]
        run = run_bench(weightsync)
        after = run_bench(dataclasses.replace(bare, repeats=args.repeats - args.repeats // 2)).results[0]
    except VerificationError as exc:
        print(f"verification failed: {exc}", file=sys.stderr)
        return 1
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    result = run.results[0]
    bare_median = statistics.median(before.send_s + after.send_s)
    ratio = result.median_s / bare_median
    print(format_table(run.results))
    print(
        f"{result.nbytes / MIB:.3f} MiB as {args.tensors} tensors to {args.workers} workers, "
        f"{args.repeats} timed rounds each"
    )
    print(
        f"weightsync median {result.median_s * 1e3:.3f} ms (p90 {result.p90_s * 1e3:.3f} ms); "
        f"bare loop median {bare_median * 1e3:.3f} ms (before {before.median_s * 1e3:.3f}, "
        f"after {after.median_s * 1e3:.3f})"
    )
    verdict = "met" if ratio <= TARGET else "missed"
    print(f"ratio weightsync / bare loop = {ratio:.2f} (target <= {TARGET}: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
