"""What the CUDA calls of a send cost on this machine's CPU side: torch's
stream and grad-mode helpers beside the ones weightsync calls instead, and
the copy a send on the GPU makes into its staging, with and without the
wait for it.

A send to workers on the trainer's GPU asks for the current stream, enters
a stream context and a grad mode, enqueues one copy per tensor, records an
event and waits for it, on both sides. Each line is the median of
``--calls`` calls of one of those, in one process, one after another on the
GPU's current stream.

Run: ``python benchmarks/cuda_calls.py [--size MIB] [--tensors N] [--calls N]``
(needs a CUDA device).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=64, help="MiB copied (default: %(default)s)")
    parser.add_argument("--tensors", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--calls", type=int, default=2000, help="(default: %(default)s)")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
