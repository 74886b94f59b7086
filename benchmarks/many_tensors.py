"""Many small tensors: the cost of a layout's tensor count.

The same 16 MiB of float32 weights, as 128 tensors and as 8 tensors, sent to 4
worker processes; the median of full sends (every worker applied and acked,
each send verified outside the timing) by ``weightsync bench``'s engine. The
two layouts alternate (``--rounds``, each a fresh case) so a change in the
machine's load hits both alike; each layout's median is over all its rounds.

Per-tensor work (extracting the state dict, one copy per tensor on each side,
validation) is what the ratio measures; the bytes are the same.

Target: median(128 tensors) / median(8 tensors) <= 1.3.

Run: ``python benchmarks/many_tensors.py [--repeats N] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from weightsync.bench import (
    BenchConfig,
    BenchError,
    VerificationError,
    describe_machine,
    format_table,
    machine_facts,
    run_bench,
)

TARGET = 1.3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=16.0, help="MiB (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default: %(default)s)")
    parser.add_argument("--many", type=int, default=128, help="tensors, many layout (default: %(default)s)")
    parser.add_argument("--few", type=int, default=8, help="tensors, few layout (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=40, help="timed sends per case (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed sends first (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="layout alternations (default: %(default)s)")
    parser.add_argument(
        "--worker-threads", type=int, default=1, help="torch threads per worker; 0: torch's default"
    )
    args = parser.parse_args()

    config = BenchConfig(
        sizes_mib=(args.size,),
        workers=(args.workers,),
        tensors=(args.few, args.many) * args.rounds,
        repeats=args.repeats,
        warmup=args.warmup,
        worker_threads=args.worker_threads or None,
    )
    print(describe_machine(machine_facts()), flush=True)
    try:
        run = run_bench(config)
    except VerificationError as exc:
        print(f"verification failed: {exc}", file=sys.stderr)
        return 1
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(run.results))

    def samples(tensors: int) -> list[float]:
        return [s for r in run.results if r.case.tensors == tensors for s in r.send_s]

    few, many = samples(args.few), samples(args.many)
    few_median, many_median = statistics.median(few), statistics.median(many)
    ratio = many_median / few_median
    print(
        f"{args.size:g} MiB to {args.workers} workers, {len(few)} and {len(many)} timed sends: "
        f"{args.many} tensors median {many_median * 1e3:.3f} ms, "
        f"{args.few} tensors median {few_median * 1e3:.3f} ms"
    )
    verdict = "met" if ratio <= TARGET else "missed"
    print(f"ratio {args.many}/{args.few} tensors = {ratio:.2f} (target <= {TARGET}: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
