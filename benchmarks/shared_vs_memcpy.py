"""Zero-copy sends: SharedMemWeightSyncScheme against one memcpy, and against
the multiprocess scheme for small updates.

A thin caller of ``weightsync bench``'s engine: back to back blocking
``send()`` calls (each returns once every worker moved to the new version
and acked), every worker's weights checked bit for bit once, after the last
send of its case; in the same run, the bench's single-threaded memcpy of the
same bytes. The same runs on the command line::

    weightsync bench --scheme shared --blocking --check-once --size 128 512 --workers 1 2 4 \\
        --repeats 15 --warmup 3
    weightsync bench --scheme multiprocess shared --blocking --check-once --size 1 --workers 4 \\
        --repeats 300 --warmup 3

Targets: 128 and 512 MiB to 1, 2 and 4 workers, median within 1.2x of one
single-threaded memcpy; 1 MiB to 4 workers, median no more than the
multiprocess scheme's.

Run: ``python benchmarks/shared_vs_memcpy.py [--size 128 512] [--workers 1 2 4]``.
"""

from __future__ import annotations

import argparse
import sys

from weightsync.bench import (
    BenchConfig,
    BenchError,
    CaseResult,
    describe_machine,
    format_row,
    machine_facts,
    run_bench,
    table_header,
)

TARGET = 1.2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", nargs="+", type=float, default=[128.0, 512.0], help="MiB")
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    large = BenchConfig(
        schemes=("shared",),
        sizes_mib=tuple(args.size),
        workers=tuple(args.workers),
        repeats=args.repeats,
        warmup=3,
        timeout=120.0,
        blocking=True,
        check_once=True,
    )
    small = BenchConfig(
        schemes=("multiprocess", "shared"),
        sizes_mib=(1.0,),
        workers=(4,),
        repeats=300,
        warmup=3,
        timeout=120.0,
        blocking=True,
        check_once=True,
    )
    print(describe_machine(machine_facts()), flush=True)
    print(table_header(), flush=True)

    def show(result: CaseResult) -> None:
        print(format_row(result), flush=True)

    try:
        runs = [run_bench(config, on_result=show) for config in (large, small)]
    except BenchError as exc:  # VerificationError included
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print()
    worst = 0.0
    for r in runs[0].results:
        ratio = r.median_s / r.memcpy_median_s
        worst = max(worst, ratio)
        print(
            f"{r.case.size_mib:7.1f} MiB {r.case.workers} workers: shared {r.median_s * 1e3:8.2f} ms, "
            f"1 memcpy {r.memcpy_median_s * 1e3:8.2f} ms, ratio {ratio:.2f}"
        )
    print(f"worst ratio {worst:.2f} (target <= {TARGET}: {'met' if worst <= TARGET else 'missed'})")
    medians = {r.case.scheme: r.median_s * 1e3 for r in runs[1].results}
    met = medians["shared"] <= medians["multiprocess"]
    shared, multiprocess = medians["shared"], medians["multiprocess"]
    print(
        f"1 MiB to 4 workers: shared {shared:.3f} ms, multiprocess {multiprocess:.3f} ms "
        f"({'met' if met else 'missed'}: shared <= multiprocess)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
