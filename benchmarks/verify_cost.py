"""The cost of ``verify=True``: the trainer's digests, then whole sends.

1. The trainer's side, in this process: copying 512 MiB (8 float32 tensors)
   into a buffer on 2 threads with weightsync's copy engine, the same copy
   digesting each 1 MiB block right after copying it (what the multiprocess
   scheme's staging does with ``verify=True``), the copy that also digests
   each copied block and compares (what the shared scheme's staging does:
   the check once for the host), and the copy followed by a separate digest
   pass. Target: the digesting copy within 1.15x of the plain copy.
2. Whole sends of 512 MiB to 4 worker processes under the multiprocess and
   shared schemes, unchecked and with ``verify=True``, in the same run (what
   ``weightsync bench --verify`` times). Targets: multiprocess at most 1.5x
   (each worker's check reads every byte once more before it writes
   anything: about (2 + 3K) / (2 + 2K) of an unchecked send for K workers
   once memory bandwidth is the limit), shared at most 1.3x (checked once
   for the host by the trainer; each worker only checks the slot it maps).

Run: ``python benchmarks/verify_cost.py [--size 512] [--workers 4]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from weightsync._copy import copy_tensors
from weightsync._digest import copy_and_check, copy_with_digests, digests
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

COPY_TARGET = 1.15
SEND_TARGETS = {"multiprocess": 1.5, "shared": 1.3}


def _median_ms(step: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1e3


def trainer_side(size_mib: float, repeats: int) -> bool:
    numel = int(size_mib * MIB) // 4 // 8
    sources = [torch.randn(numel) for _ in range(8)]
    targets = [torch.zeros(numel) for _ in range(8)]
    copy_tensors(targets, sources, threads=2)  # touch every page once
    plain = _median_ms(lambda: copy_tensors(targets, sources, threads=2), repeats)
    fused = _median_ms(lambda: copy_with_digests(targets, sources, threads=2), repeats)
    checked = _median_ms(lambda: copy_and_check(targets, sources, threads=2), repeats)

    def copy_then_digest() -> None:
        copy_tensors(targets, sources, threads=2)
        digests(sources, 2)

    apart = _median_ms(copy_then_digest, repeats)
    ratio = fused / plain
    print(f"trainer side, {size_mib:g} MiB on 2 threads, median of {repeats}:")
    print(f"  copy {plain:7.1f} ms   copy digesting each block {fused:7.1f} ms", end="")
    print(f"   copy digesting and checking each block {checked:7.1f} ms   copy, then digests {apart:7.1f} ms")
    met = ratio <= COPY_TARGET
    print(f"  digesting copy / copy = {ratio:.2f} (target <= {COPY_TARGET}: {'met' if met else 'missed'})")
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=512.0, help="MiB (default: %(default)s)")
    parser.add_argument("--workers", nargs="+", type=int, default=[4], help="(default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=10, help="timed sends per case (default: %(default)s)")
    args = parser.parse_args()

    print(describe_machine(machine_facts()), flush=True)
    trainer_side(args.size, args.repeats)
    print()
    config = BenchConfig(
        schemes=("multiprocess", "shared"),
        sizes_mib=(args.size,),
        workers=tuple(args.workers),
        tensors=(8,),
        verify=(False, True),
        repeats=args.repeats,
        warmup=2,
        timeout=120.0,
    )
    print(table_header(), flush=True)

    def show(result: CaseResult) -> None:
        print(format_row(result), flush=True)

    try:
        run = run_bench(config, on_result=show)
    except (VerificationError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print()
    unchecked = {(r.case.scheme, r.case.workers): r.median_s for r in run.results if not r.case.verify}
    for r in run.results:
        if r.case.verify:
            ratio = r.median_s / unchecked[(r.case.scheme, r.case.workers)]
            target = SEND_TARGETS[r.case.scheme]
            print(
                f"{r.case.scheme:>12} {r.case.workers} workers: verify=True / unchecked = {ratio:.2f} "
                f"(target <= {target}: {'met' if ratio <= target else 'missed'})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
