"""What the CUDA calls of a send cost on this machine's CPU side: torch's
stream and grad-mode helpers beside the ones weightsync calls instead, and
the copy a send on the GPU makes into its staging, with and without the
wait for it.

A send to workers on the trainer's GPU asks for the current stream, enters
a stream context and a grad mode, enqueues one copy per tensor, records an
event and waits for it, on both sides. Each line is the median of
``--calls`` calls of one of those, in one process, one after another on the
GPU's current stream.

``--ipc`` then times the round trip of a send to one worker process on
the same GPU, as a hand-written loop: the trainer copies into a staging
tensor it shared once by CUDA IPC and waits for the copy, writes a byte;
the worker copies out of the staging into its own tensors, waits, writes
a byte back. The worker's copy and wait are made in several ways, each
timed from both sides (``--gap MS``: the trainer idles after each round).

Run: ``python benchmarks/cuda_calls.py [--size MIB] [--tensors N] [--calls N] [--ipc [--gap MS]]``
(needs a CUDA device).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from weightsync._memory._placement import current_stream, on_stream
from weightsync._memory._slab import copy_on_stream


def timed(calls: int, action: Callable[[], object]) -> float:
    """The median seconds of one ``action()``, over ``calls`` calls."""
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# The worker's ways to copy out of the staging and wait, by name.
def _worker_copies(
    targets: Sequence[torch.Tensor], staged: Sequence[torch.Tensor]
) -> dict[str, Callable[[], object]]:
    destinations, sources = list(targets), list(staged)
    device = destinations[0].device
    pairs = list(zip(destinations, sources, strict=True))

    def foreach_event() -> None:
        copy_on_stream(destinations, sources, current_stream(device.index))

    def loop_event() -> None:
        stream = current_stream(device.index)
        with torch.inference_mode():
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()

    def loop_device_sync() -> None:
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    def foreach_stream_sync() -> None:
        with torch.inference_mode():
            torch._foreach_copy_(destinations, sources, non_blocking=True)
        current_stream(device.index).synchronize()

    return {
        "copy_on_stream (foreach, an event)": foreach_event,
        "copy_ per tensor, an event": loop_event,
        "copy_ per tensor, torch.cuda.synchronize (as cuda-ipc)": loop_device_sync,
        "foreach, the stream synchronized": foreach_stream_sync,
    }


def _ipc_worker(conn: Any, shapes: list[int], rounds: int) -> None:
    staging = conn.recv()  # (a CUDA IPC handle, opened here)
    device = staging.device
    torch.cuda.set_device(device)
    destinations = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in shapes]
    sources = list(torch.split(staging, shapes))
    timings: dict[str, float] = {}
    for name, copy in _worker_copies(destinations, sources).items():
        samples = []
        for step in range(rounds):
            if conn.recv_bytes() != b"g":
                return
            start = time.perf_counter()
            copy()
            samples.append(time.perf_counter() - start)
            # (checked before the answer: the trainer writes the staging again after it)
            if step == rounds - 1 and not all(
                torch.equal(d, s) for d, s in zip(destinations, sources, strict=True)
            ):
                raise AssertionError(f"{name}: the worker's copy differs from the staging")
            conn.send_bytes(b"a")
        timings[name] = statistics.median(samples)
    conn.recv_bytes()
    conn.send(timings)


def ipc_round_trips(args: argparse.Namespace, sources: list[torch.Tensor]) -> None:
    """See the module's docstring (``--ipc``)."""
    import torch.multiprocessing as tmp

    shapes = [t.numel() for t in sources]
    staging = torch.zeros(sum(shapes), device=sources[0].device)
    views = list(torch.split(staging, shapes))
    ctx = tmp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    rounds = max(args.calls // 10, 50)
    child = ctx.Process(target=_ipc_worker, args=(theirs, shapes, rounds))
    child.start()
    ours.send(staging)
    names = list(_worker_copies(views, views))
    trips = {}
    try:
        for name in names:
            samples = []
            for step in range(rounds):
                sources[step % len(sources)].add_(1)  # (every round sends other bytes)
                start = time.perf_counter()
                copy_on_stream(views, sources, current_stream(staging.device.index))
                ours.send_bytes(b"g")
                if ours.recv_bytes() != b"a":
                    raise AssertionError("the worker answered out of turn")
                samples.append(time.perf_counter() - start)
                if args.gap:
                    time.sleep(args.gap / 1000)
            trips[name] = statistics.median(samples)
        ours.send_bytes(b"e")
        worker_side = ours.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    print(f"a round trip to one worker process on the same GPU ({rounds} rounds each, gap {args.gap:g} ms):")
    for name in names:
        print(f"  {name:55s} {trips[name] * 1e6:8.1f} us, of which the worker's copy and wait "
              f"{worker_side[name] * 1e6:6.1f} us")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=64, help="MiB copied (default: %(default)s)")
    parser.add_argument("--tensors", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--calls", type=int, default=2000, help="(default: %(default)s)")
    parser.add_argument("--ipc", action="store_true", help="also the round trip to a worker process")
    parser.add_argument("--gap", type=float, default=0.0, metavar="MS", help="(--ipc) idle after each round")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("no CUDA device is visible")
    device = torch.device("cuda", torch.cuda.current_device())
    numel = max(int(args.size * (1 << 20)) // 4 // args.tensors, 1)
    sources = [torch.rand(numel, device=device) for _ in range(args.tensors)]
    destinations = [torch.empty_like(t) for t in sources]
    stream = current_stream(device.index)

    def torch_stream_context() -> None:
        with torch.cuda.stream(stream):
            pass

    def our_stream_context() -> None:
        with on_stream(stream):
            pass

    def inference_mode() -> None:
        with torch.inference_mode():
            pass

    def enqueue() -> None:
        torch._foreach_copy_(destinations, sources, non_blocking=True)

    def event() -> None:
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()

    def torch_copy_and_wait() -> None:
        # (what copy_on_stream did with torch's own stream context)
        with torch.cuda.stream(torch.cuda.current_stream(device)), torch.inference_mode():
            torch._foreach_copy_(destinations, sources, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()

    def our_copy_and_wait() -> None:
        copy_on_stream(destinations, sources, current_stream(device.index))

    def copy_alone() -> None:
        torch._foreach_copy_(destinations, sources, non_blocking=True)
        torch.cuda.synchronize(device)

    rows: list[tuple[str, Callable[[], object]]] = [
        ("torch.cuda.current_stream()", torch.cuda.current_stream),
        ("torch.cuda.current_stream(device)", lambda: torch.cuda.current_stream(device)),
        ("weightsync current_stream(index)", lambda: current_stream(device.index)),
        ("torch.cuda.stream(current) entered and left", torch_stream_context),
        ("weightsync on_stream(current) entered and left", our_stream_context),
        ("torch.inference_mode() entered and left", inference_mode),
        ("torch.cuda.Event() recorded and waited for, idle", event),
        (f"_foreach_copy_ of {args.tensors} tensors, enqueued (no wait)", enqueue),
        ("the same, then torch.cuda.synchronize()", copy_alone),
        ("copy_on_stream as torch's contexts make it", torch_copy_and_wait),
        ("weightsync copy_on_stream", our_copy_and_wait),
    ]
    torch.cuda.synchronize(device)
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; {args.size:g} MiB as "
        f"{args.tensors} float32 tensors; median of {args.calls} calls each"
    )
    for label, action in rows:
        for _ in range(20):
            action()
        torch.cuda.synchronize(device)
        seconds = timed(args.calls, action)
        torch.cuda.synchronize(device)
        print(f"  {label:55s} {seconds * 1e6:8.1f} us")
    if args.ipc:
        ipc_round_trips(args, sources)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
