"""The background paths against a blocking send() of the same bytes, in one run.

A README-style trainer (``MultiProcessWeightSyncScheme`` over ``spawn``ed
worker processes that call ``receive()`` at their safe point) sends the same
model three ways, in alternating blocks of ``--sends`` sends each, so that a
change in the machine's load hits every way alike:

- ``send()``: the blocking send, as the README's trainer calls it;
- ``send_async()`` then ``wait_async()`` at once (torchrl's pair);
- ``await sender.send()`` on the trainer's own asyncio loop, the sender
  from ``scheme.get_async_sender()``.

The model changes before every send, outside the timing. Each way's median
is printed with its ratio to the blocking send's (target: 1.3 at most).

Run: ``python benchmarks/background_vs_blocking.py [--size MIB | --model mlp]
[--workers N] [--sends N] [--rounds N]``; ``--model mlp`` sends a 4-layer,
64-wide float32 model (66 KiB) instead of 8 float32 tensors of ``--size``
MiB in all.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

# (Run as a script from benchmarks/: the model is send_profile.py's.)
from send_profile import make_model
from torch import nn

import weightsync as ws


def worker(scheme: ws.WeightSyncScheme, pipe: Any, kind: str, nbytes: int) -> None:
    torch.set_num_threads(1)
    scheme.init_on_worker("policy", pipe=pipe, model=make_model(kind, nbytes))
    receiver = scheme.get_receiver()
    try:
        while True:
            receiver.async_receiver.wait_ready(1.0)
            scheme.receive()
    except ws.SenderLostError:
        pass
    finally:
        scheme.shutdown()


def change(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=1.0, help="MiB, as 8 tensors (default: %(default)s)")
    parser.add_argument("--model", choices=["flat", "mlp"], default="flat", help="(default: %(default)s)")
    parser.add_argument("--workers", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--sends", type=int, default=60, help="sends per block (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=6, help="blocks of each way (default: %(default)s)")
    args = parser.parse_args()
    nbytes = int(args.size * (1 << 20))

    ctx = mp.get_context("spawn")
    scheme = ws.MultiProcessWeightSyncScheme()
    pipes, procs = [], []
    for _ in range(args.workers):
        ours, theirs = ctx.Pipe()
        procs.append(ctx.Process(target=worker, args=(scheme, theirs, args.model, nbytes)))
        procs[-1].start()
        pipes.append(ours)
    model = make_model(args.model, nbytes)
    scheme.init_on_sender("policy", pipes=pipes, model=model)
    sender = scheme.get_sender()
    scheme.wait_for_workers()
    for _ in range(30):
        sender.send()
    times: dict[str, list[float]] = {"send()": [], "send_async() + wait_async()": [], "await send()": []}
    async_sender = scheme.get_async_sender()

    async def awaited() -> list[float]:
        out = []
        for _ in range(args.sends):
            change(model)
            start = time.perf_counter()
            await async_sender.send()
            out.append(time.perf_counter() - start)
        return out

    loop = asyncio.new_event_loop()
    try:
        for _ in range(args.rounds):
            for _ in range(args.sends):
                change(model)
                start = time.perf_counter()
                sender.send()
                times["send()"].append(time.perf_counter() - start)
            for _ in range(args.sends):
                change(model)
                start = time.perf_counter()
                sender.send_async()
                sender.wait_async()
                times["send_async() + wait_async()"].append(time.perf_counter() - start)
            times["await send()"] += loop.run_until_complete(awaited())
        loop.run_until_complete(async_sender.aclose())
    finally:
        loop.close()
        scheme.shutdown()
        for proc in procs:
            proc.join()
    what = "a 4-layer, 64-wide MLP" if args.model == "mlp" else f"{args.size:g} MiB as 8 tensors"
    blocks = f"{args.rounds} alternating blocks of {args.sends} sends each way"
    print(f"{what} to {args.workers} worker(s), {blocks}")
    blocking = statistics.median(times["send()"])
    for way, samples in times.items():
        median = statistics.median(samples)
        print(f"  {way:30s} median {median * 1e3:.3f} ms  x send() {median / blocking:.2f}")
    worst = max(statistics.median(s) for s in times.values()) / blocking
    verdict = "met" if worst <= 1.3 else "missed"
    print(f"worst background path / send() = {worst:.2f} (target <= 1.3: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
