"""Large updates: weightsync against the memcpys a send cannot avoid.

128 and 512 MiB of float32 weights (8 tensors) to 1, 2 and 4 worker processes.
A send through one staging buffer copies the bytes ``workers + 1`` times (once
into staging, once out per worker); the reference is the time this machine
takes for those ``workers + 1`` memcpys of the same bytes on 2 threads (two
threads each copying half), measured in the same run, in the same process, by
``weightsync bench``'s engine. Every send is verified (outside the timing):
each worker must hold exactly the trainer's weights.

One case runs at a time and its models and staging are freed before the next:
512 MiB x (trainer + 4 workers + staging) fits in memory, more would not.

Target: weightsync median / (workers+1)-memcpy on 2 threads <= 1.15.

Run: ``python benchmarks/large_vs_memcpy.py [--size 128 512] [--workers 1 2 4]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from weightsync.bench import (
    MIB,
    BenchConfig,
    BenchError,
    CaseResult,
    VerificationError,
    describe_machine,
    format_row,
    machine_facts,
    run_bench,
    table_header,
)

TARGET = 1.15


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size", nargs="+", type=float, default=[128.0, 512.0], help="MiB (default: %(default)s)"
    )
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4], help="(default: %(default)s)")
    parser.add_argument("--tensors", type=int, default=8, help="tensors (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="timed sends per case (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed sends first (default: %(default)s)")
    parser.add_argument(
        "--worker-threads", type=int, default=1, help="torch threads per worker; 0: torch's default"
    )
    parser.add_argument("--json", metavar="PATH", help="also write raw samples and machine facts to PATH")
    args = parser.parse_args()

    config = BenchConfig(
        sizes_mib=tuple(args.size),
        workers=tuple(args.workers),
        tensors=(args.tensors,),
        repeats=args.repeats,
        warmup=args.warmup,
        timeout=120.0,
        worker_threads=args.worker_threads or None,
    )
    print(describe_machine(machine_facts()), flush=True)
    print(table_header(), flush=True)

    def show(result: CaseResult) -> None:
        print(format_row(result), flush=True)

    try:
        run = run_bench(config, on_result=show)
    except VerificationError as exc:
        print(f"verification failed: {exc}", file=sys.stderr)
        return 1
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        run.write_json(args.json)

    print()
    print("ratio = weightsync median / median of (workers+1) memcpys on 2 threads")
    worst = 0.0
    for r in run.results:
        split = statistics.median(r.floor_split_s)
        ratio = r.median_s / split
        worst = max(worst, ratio)
        print(
            f"{r.nbytes / MIB:8.2f} MiB  {r.case.workers} workers: weightsync {r.median_s * 1e3:8.2f} ms, "
            f"{r.case.workers + 1} memcpys on 2 threads {split * 1e3:8.2f} ms, "
            f"1 memcpy {r.memcpy_median_s * 1e3:7.2f} ms, ratio {ratio:.2f}"
        )
    print(f"worst ratio {worst:.2f} (target <= {TARGET}: {'met' if worst <= TARGET else 'missed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
