"""RayWeightSyncScheme against torchrl's RayWeightSyncScheme.

Both send a trainer's weights from the Ray driver to Ray actors and return
once every actor applied them. weightsync's scheme puts the weights into
Ray's object store once and calls every actor; torchrl's
(``torchrl.weight_update.RayWeightSyncScheme``) calls every actor's
``_receive_weights_scheme`` through Ray and streams the tensors over a
torch.distributed gloo process group (the trainer is rank 0).

A thin caller of ``weightsync bench``'s engine: the bench's Ray actors
serve both, torchrl's scheme set up as torchrl's collectors set it up (the
bench's ``torchrl-ray`` alternative); the two alternate case by case
(``--rounds``), and after each send every actor's weights are checked
against the trainer's, outside the timing. The same run on the command
line::

    weightsync bench --scheme ray --compare torchrl-ray --size 512 512 --workers 4 --repeats 8 --warmup 3

Target: weightsync at least 2x faster than torchrl at 512 MiB to 4 actors.

Run (torchrl must be importable, it is not in the repository's own venv):
``python benchmarks/ray_vs_torchrl.py [--size 512] [--workers 4] [--repeats 15] [--warmup 3]``
"""

from __future__ import annotations

import argparse
import statistics
import sys

from weightsync.bench import ALTERNATIVES, BenchConfig, BenchError, format_table, run_bench

TARGET = 2.0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=float, nargs="+", default=[512.0], help="MiB")
    parser.add_argument("--workers", type=int, nargs="+", default=[4])
    parser.add_argument("--repeats", type=int, default=15, help="timed sends of each, in all its rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="cases of each, alternating (default: 2)")
    args = parser.parse_args()
    why = ALTERNATIVES["torchrl-ray"].unavailable()
    if why is not None:
        print(f"this comparison needs torchrl and ray: {why}", file=sys.stderr)
        return 2
    config = BenchConfig(
        schemes=("ray",),
        compare=("torchrl-ray",),
        sizes_mib=tuple(size for size in args.size for _ in range(args.rounds)),
        workers=tuple(args.workers),
        repeats=max(args.repeats // args.rounds, 1),
        warmup=args.warmup,
        timeout=120.0,
    )
    try:
        run = run_bench(config)
    except BenchError as exc:  # VerificationError included
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(run.results))
    print(f"{'MiB':>5} {'actors':>6} {'weightsync ms':>14} {'torchrl ms':>11} {'speed-up':>9}")
    for size in args.size:
        for workers in args.workers:
            ours, theirs = (
                statistics.median(
                    s
                    for r in run.results
                    if (r.case.scheme, r.case.size_mib, r.case.workers) == (name, size, workers)
                    for s in r.send_s
                )
                * 1e3
                for name in ("ray", "torchrl-ray")
            )
            speedup = theirs / ours
            verdict = "met" if speedup >= TARGET else "missed"
            print(
                f"{size:>5g} {workers:>6} {ours:>14.2f} {theirs:>11.2f} {speedup:>9.2f}"
                f"  (target >= {TARGET:g}: {verdict})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
