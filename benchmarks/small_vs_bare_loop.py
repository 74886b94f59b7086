"""Small updates: weightsync against the tightest bare shared-memory loop.

1 MiB of weights as 8 float32 tensors, sent to 4 worker processes. Both
sides are cases of one ``weightsync bench`` run, in the same pool of
workers, alternating (``--rounds`` of each, every round a fresh case), so a
change in the machine's load hits both alike. The command line of the same
run::

    weightsync bench --scheme multiprocess --compare bare-tight --blocking --check-once \\
        --size 1 1 1 1 --workers 4 --repeats 75 --warmup 20

- weightsync: ``MultiProcessWeightSyncScheme``, as the README's trainer
  uses it: ``scheme.get_sender().send()`` (``--blocking``), each worker
  calling ``receive()`` at its safe point; a send returns once every worker
  applied it and acked;
- the bare loop: the bench's ``bare-tight`` alternative, written as tightly
  as a user could: the trainer copies its tensors into one preallocated
  shared buffer and writes one byte to each worker's socket; each worker,
  blocked in ``os.read``, copies the tensors out into its model and writes
  one byte back.

The trainer's process runs torch on one thread (``--trainer-threads``).
Neither side checks anything between sends (``--check-once``): the model
changes before every send, outside the timing, and every worker's weights
are compared bit for bit with the trainer's once, after each case's last
send, so no worker's check runs while another still applies a timed send.

The bare loop is the least a correct transport must do (one copy in, one out
per worker, one notification and one reply per worker); everything weightsync
adds on top (its event loop or loop-free path, acks with versions, liveness
checks, validation) shows as the ratio.

Target: weightsync median / bare loop median <= 1.5 (1 MiB to 4 workers);
<= 2 for 64 KiB to one worker (``--size 0.0625 --workers 1 --target 2``).
Both sides' trainer CPU per send (the sending thread's, ``cpu us``) and
a worker's CPU per update (the call that took it, ``wkr cpu us``) are
printed too: where the difference is spent.

Run: ``python benchmarks/small_vs_bare_loop.py [--repeats N] [--rounds N] [--bare bare-shm]
[--size MIB] [--workers N] [--target RATIO]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

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
    parser.add_argument(
        "--repeats", type=int, default=300, help="timed sends/rounds of each side (default: %(default)s)"
    )
    parser.add_argument(
        "--rounds", type=int, default=4, help="cases of each side, alternating (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=20, help="untimed first, per case (default: %(default)s)"
    )
    parser.add_argument(
        "--worker-threads", type=int, default=1, help="torch threads of each worker (default: %(default)s)"
    )
    parser.add_argument(
        "--trainer-threads",
        type=int,
        default=1,
        help="torch threads of the trainer's process; 0: torch's default (default: %(default)s)",
    )
    parser.add_argument(
        "--bare",
        choices=["bare-tight", "bare-shm"],
        default="bare-tight",
        help="the bare loop: bare-tight, or bare-shm (framed messages, checked after every round, "
        "and weightsync then timed as send_async() + wait_async() with the same checks) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--target", type=float, default=TARGET, help="the ratio to meet (default: %(default)s)"
    )
    args = parser.parse_args()
    if args.trainer_threads:
        # Neither side copies on torch's intra-op threads, but the bench's own
        # work between cases (building the model, the memcpy references) wakes
        # them, and on a machine with fewer cores than processes their
        # spin-wait once held up the first rounds of a case by 30 ms each.
        torch.set_num_threads(args.trainer_threads)
    tight = args.bare == "bare-tight"
    config = BenchConfig(
        schemes=("multiprocess",),
        compare=(args.bare,),
        # The same size once per round: each round is a case of each side, in turn.
        sizes_mib=(args.size,) * args.rounds,
        workers=(args.workers,),
        tensors=(args.tensors,),
        repeats=max(args.repeats // args.rounds, 1),
        warmup=args.warmup,
        worker_threads=args.worker_threads,
        blocking=tight,
        check_once=tight,
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
    ours = [r for r in run.results if r.case.scheme == "multiprocess"]
    bare = [r for r in run.results if r.case.scheme == args.bare]
    ours_median = statistics.median(s for r in ours for s in r.send_s)
    bare_median = statistics.median(s for r in bare for s in r.send_s)
    ratio = ours_median / bare_median
    first = run.results[0]
    print(
        f"{first.nbytes / MIB:.3f} MiB as {args.tensors} tensors to {args.workers} workers, "
        f"{len(ours)} alternating cases of {config.repeats} timed sends each side"
    )
    call = "send()" if tight else "send_async() + wait_async()"
    print(
        f"weightsync {call} median {ours_median * 1e3:.3f} ms "
        f"(per case: {', '.join(f'{r.median_s * 1e3:.3f}' for r in ours)}); "
        f"{args.bare} median {bare_median * 1e3:.3f} ms "
        f"(per case: {', '.join(f'{r.median_s * 1e3:.3f}' for r in bare)})"
    )
    ours_cpu = statistics.median(c for r in ours for c in r.cpu_s)
    bare_cpu = statistics.median(c for r in bare for c in r.cpu_s)
    print(
        f"the trainer's CPU per send (its sending thread): weightsync {ours_cpu * 1e6:.0f} us, "
        f"{args.bare} {bare_cpu * 1e6:.0f} us"
    )
    ours_worker = [c for r in ours for c in r.worker_cpu_s]
    bare_worker = [c for r in bare for c in r.worker_cpu_s]
    if ours_worker and bare_worker:
        print(
            f"a worker's CPU per update (the call that took it): weightsync "
            f"{statistics.median(ours_worker) * 1e6:.0f} us, {args.bare} "
            f"{statistics.median(bare_worker) * 1e6:.0f} us"
        )
    target = args.target
    verdict = "met" if ratio <= target else "missed"
    print(f"ratio weightsync / {args.bare} = {ratio:.2f} (target <= {target:g}: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
