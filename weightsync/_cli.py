"""The ``weightsync`` command line. ``weightsync bench`` times full sends and
compares them with memcpy of the same bytes; see :mod:`weightsync._bench`."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from ._bench import (
    SCHEMES,
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

__all__ = ["main"]

_DEFAULTS = BenchConfig()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightsync", description="Move model weights from a trainer to its workers."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    known = "\n".join(f"  {info.name:<14} {info.summary}" for info in SCHEMES.values())
    bench = commands.add_parser(
        "bench",
        help="time full sends (every ack in) against memcpy of the same bytes",
        description=(
            "Time scheme.send() (the whole send: every worker applied and acked) for each "
            "combination of scheme, size, workers and tensors; verify after every send that each "
            "worker holds exactly the trainer's weights; compare with a single-threaded memcpy and "
            "with (workers+1) memcpys on 2 threads, measured in the same run."
        ),
        epilog=f"known schemes:\n{known}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--scheme", nargs="+", choices=sorted(SCHEMES), default=list(_DEFAULTS.schemes), metavar="NAME",
        help=f"schemes to run (default: %(default)s; known: {', '.join(sorted(SCHEMES))})",
    )
    bench.add_argument(
        "--size", nargs="+", type=float, default=list(_DEFAULTS.sizes_mib), metavar="MIB",
        help="bytes of weights, in MiB (default: %(default)s)",
    )
    bench.add_argument(
        "--workers", nargs="+", type=int, default=list(_DEFAULTS.workers), metavar="N",
        help="numbers of worker processes (default: %(default)s)",
    )
    bench.add_argument(
        "--tensors", nargs="+", type=int, default=list(_DEFAULTS.tensors), metavar="N",
        help="numbers of tensors the bytes are split into (default: %(default)s)",
    )
    bench.add_argument(
        "--repeats", type=int, default=_DEFAULTS.repeats, help="timed sends per case (default: %(default)s)"
    )
    bench.add_argument(
        "--warmup", type=int, default=_DEFAULTS.warmup, help="untimed sends first (default: %(default)s)"
    )
    bench.add_argument(
        "--timeout", type=float, default=_DEFAULTS.timeout,
        help="deadline of each send, and of each wait for a worker, in seconds (default: %(default)s)",
    )
    bench.add_argument(
        "--worker-threads", type=int, default=_DEFAULTS.worker_threads, metavar="N",
        help="torch threads in each worker; 0: torch's default (default: %(default)s)",
    )
    bench.add_argument("--json", metavar="PATH", help="also write the raw samples and machine facts to PATH")
    # Testing hook: this worker corrupts its model after applying, so verification must fail.
    bench.add_argument("--corrupt-worker", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = BenchConfig(
            schemes=tuple(args.scheme),
            sizes_mib=tuple(args.size),
            workers=tuple(args.workers),
            tensors=tuple(args.tensors),
            repeats=args.repeats,
            warmup=args.warmup,
            timeout=args.timeout,
            worker_threads=args.worker_threads or None,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(describe_machine(machine_facts()), flush=True)
    print(table_header(), flush=True)

    def show(result: CaseResult) -> None:
        print(format_row(result), flush=True)

    started = time.perf_counter()
    try:
        run = run_bench(config, on_result=show, corrupt_worker=args.corrupt_worker)
    except VerificationError as exc:
        print(f"weightsync bench: verification failed: {exc}", file=sys.stderr)
        return 1
    except BenchError as exc:
        print(f"weightsync bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("weightsync bench: interrupted", file=sys.stderr)
        return 130
    print(f"{len(run.results)} cases in {time.perf_counter() - started:.1f} s", flush=True)
    if args.json:
        try:
            run.write_json(args.json)
        except OSError as exc:
            print(f"weightsync bench: cannot write {args.json}: {exc}", file=sys.stderr)
            return 1
        print(f"raw samples and machine facts: {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``weightsync`` command line with ``argv`` (default: ``sys.argv[1:]``).

    Blocks until the command is done and returns its exit status: 0 on
    success, 1 when a benchmark failed (a worker held other weights than the
    trainer, died or timed out), 130 after Ctrl-C.

    :raises SystemExit: the arguments are invalid (status 2) or ``--help`` was asked.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args, parser)
    parser.print_help()
    return 2
