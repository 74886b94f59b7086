"""RayWeightSyncScheme against a hand-written zero-copy Ray broadcast.

A thin caller of ``weightsync bench``'s engine, on its Ray actors. The
baseline is the bench's ``ray-put`` alternative, what one would write by
hand with Ray's object store: one ``ray.put`` of the weights as numpy
buffers, then one call per actor that copies the buffers into the actor's
model in place, and ``ray.get`` of the calls. The same actors serve both,
which alternate case by case (``--rounds``), each timed from the first
call until every actor applied the weights; after each send every actor's
weights are checked against the trainer's, outside the timing. The same run
on the command line::

    weightsync bench --scheme ray --compare ray-put torchrl-ray --size 1 1 512 512 --workers 4 \\
        --repeats 8 --warmup 3

torchrl's ``RayWeightSyncScheme`` (the bench's ``torchrl-ray``) is measured
too when torchrl is importable.

Targets: median no more than 1.1x the baseline at 1 MiB and 512 MiB to 4
actors.

Run: ``python benchmarks/ray_vs_baseline.py [--size 1 512] [--workers 4] [--repeats 15] [--mixin]``
(``--mixin``: the actors subclass ``weightsync.RayWeightSyncMixin``).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from weightsync.bench import BenchConfig, BenchError, CaseResult, format_table, resolve, run_bench

TARGET = 1.1


def pooled_median_ms(results: list[CaseResult], scheme: str, size: float, workers: int) -> float | None:
    """The median of every timed send of ``scheme``'s cases of that size and worker count."""
    samples = [
        s
        for r in results
        if (r.case.scheme, r.case.size_mib, r.case.workers) == (scheme, size, workers)
        for s in r.send_s
    ]
    return statistics.median(samples) * 1e3 if samples else None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=float, nargs="+", default=[1.0, 512.0], help="MiB")
    parser.add_argument("--workers", type=int, nargs="+", default=[4])
    parser.add_argument("--repeats", type=int, default=15, help="timed sends of each, in all its rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="cases of each, alternating (default: 2)")
    parser.add_argument("--mixin", action="store_true", help="actors subclass weightsync.RayWeightSyncMixin")
    args = parser.parse_args()
    compare, skipped = resolve(["ray-put", "torchrl-ray"])
    if "ray-put" not in compare:
        print(f"ray_vs_baseline: {skipped['ray-put']}", file=sys.stderr)
        return 2
    config = BenchConfig(
        schemes=("ray",),
        compare=tuple(compare),
        sizes_mib=tuple(size for size in args.size for _ in range(args.rounds)),
        workers=tuple(args.workers),
        repeats=max(args.repeats // args.rounds, 1),
        warmup=args.warmup,
        timeout=120.0,
        ray_mixin=args.mixin,
    )
    try:
        run = run_bench(config)
    except BenchError as exc:  # VerificationError included
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(run.results))
    torchrl = "torchrl-ray" in compare
    print(
        f"{'MiB':>5} {'actors':>6} {'weightsync ms':>14} {'baseline ms':>12} {'ratio':>6}"
        + (f" {'torchrl ms':>11}" if torchrl else "")
    )
    worst = 0.0
    for size in args.size:
        for workers in args.workers:
            ours = pooled_median_ms(run.results, "ray", size, workers)
            base = pooled_median_ms(run.results, "ray-put", size, workers)
            assert ours is not None and base is not None
            worst = max(worst, ours / base)
            line = f"{size:>5g} {workers:>6} {ours:>14.2f} {base:>12.2f} {ours / base:>6.2f}"
            if torchrl:
                line += f" {pooled_median_ms(run.results, 'torchrl-ray', size, workers) or 0.0:>11.2f}"
            print(line)
    print(f"worst ratio {worst:.2f} (target <= {TARGET}: {'met' if worst <= TARGET else 'missed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
