"""Where a small send's time goes: a README-style trainer and its workers,
timed from both sides, beside a bare byte's round trip in the same run.

The trainer is the README's: a ``MultiProcessWeightSyncScheme`` over
``spawn``ed worker processes that call ``receive()`` at their safe point,
and a blocking ``send()`` after each change of the model. For each send
it records the wall time and the CPU time of the trainer's sending thread
(``time.thread_time``); each worker records, for each update it applies,
the wall and CPU time of the ``receive()`` that applied it (the wait for
the update is not in it). Before that, the same number of processes bounce
one byte each over a socket pair, ``os.write`` then ``epoll`` and
``os.read``, the least any send's notice and ack cost.

``--steps`` also times the send's main steps on the trainer (the model
read into a packet, the staging's write, the notices, the wait for and
the taking of acks, the machine between them), by wrapping them, and
prints each one's median over the sends: the wrapping adds a little to
each, so their sum is above the plain run's.

``--calls`` counts the calls (Python functions and the C functions they
call) a send makes on the trainer, with ``sys.setprofile`` (which slows
the sends it counts); ``--cprofile N`` prints the N functions that took
the trainer's thread most time over the timed sends (cProfile, which
slows them too).

``--async`` sends as a trainer that overlaps its next step does:
``send_async()``, then ``wait_async()``; it also prints the median stall
(until ``send_async()`` returned, the weights staged and every worker
told), which ``--steps`` and ``--cprofile`` then cover alone.
``--device cuda`` puts the trainer's model and every worker's on the GPU
(the bench's "GPU → same GPU" rows); ``--steps`` then also times the copy
into the sender's GPU memory and the wait for it. ``--gap MS`` idles the
trainer after each send (as the bench does while it checks every worker),
so that each send starts from a machine that was idle meanwhile.

Run: ``python benchmarks/send_profile.py [--size MIB] [--workers N] [--sends N] [--steps] [--calls]``;
``--model mlp`` sends a 4-layer, 64-wide float32 model instead;
``--model transformer`` a 12-layer, 64-wide transformer encoder (144
tensors in 122 modules, 1.6 MB), where reading the model is a larger
part of a send.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import select
import socket
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import weightsync as ws


def make_model(kind: str, nbytes: int, device: str = "cpu") -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).to(device)
    if kind == "transformer":
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False).to(device)
    module = nn.Module()
    for i in range(8):
        module.register_parameter(f"p{i}", nn.Parameter(torch.zeros(max(nbytes // 32, 1), device=device)))
    return module


def worker(
    scheme: ws.WeightSyncScheme, pipe: Any, kind: str, nbytes: int, device: str, cprofile: int, out: Any
) -> None:
    torch.set_num_threads(1)
    model = make_model(kind, nbytes, device)
    scheme.init_on_worker("policy", pipe=pipe, model=model)
    receiver = scheme.get_receiver()
    walls: list[float] = []
    cpus: list[float] = []
    profiler = None
    if cprofile:
        import cProfile

        profiler = cProfile.Profile()
    try:
        while True:
            receiver.async_receiver.wait_ready(1.0)  # (the wait is not timed)
            wall, cpu = time.perf_counter(), time.thread_time()
            if profiler is not None:
                profiler.enable()
            version = scheme.receive()
            if profiler is not None:
                profiler.disable()
            if version is not None:
                walls.append(time.perf_counter() - wall)
                cpus.append(time.thread_time() - cpu)
    except ws.SenderLostError:
        pass
    finally:
        scheme.shutdown()
    stats = ""
    if profiler is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(cprofile)
        stats = text.getvalue()
    out.send(((statistics.median(walls), statistics.median(cpus)) if walls else None, stats))


def bounce(sock: socket.socket) -> None:
    while sock.recv(1) == b"x":
        sock.send(b"a")


def bare_round_trip(workers: int, sends: int) -> float:
    """The median time of one byte to each of ``workers`` processes and
    one back from each, blocked in epoll between."""
    ctx = mp.get_context("fork")
    pairs = [socket.socketpair() for _ in range(workers)]
    procs = [ctx.Process(target=bounce, args=(theirs,)) for _, theirs in pairs]
    for proc in procs:
        proc.start()
    watch = select.epoll()
    for ours, _ in pairs:
        watch.register(ours.fileno(), select.EPOLLIN)
    times = []
    try:
        for _ in range(sends):
            start = time.perf_counter()
            for ours, _ in pairs:
                os.write(ours.fileno(), b"x")
            left = workers
            while left:
                for fd, _ in watch.poll(1.0):
                    os.read(fd, 1)
                    left -= 1
            times.append(time.perf_counter() - start)
    finally:
        for ours, _ in pairs:
            os.write(ours.fileno(), b"q")
        for proc in procs:
            proc.join()
        watch.close()
    return statistics.median(times)


def wrap_steps(totals: collections.Counter[str]) -> list[str]:
    """Time the send's main steps on the trainer (see the module's
    docstring); their labels, in the order a send takes them."""
    from weightsync._drive import SendIO
    from weightsync._packing import Packer
    from weightsync._send import SendMachine

    def timed(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def step(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start

        setattr(owner, name, step)
        labels.append(label)

    labels: list[str] = []
    timed(SendMachine, "__init__", "the send's machine: made")
    timed(Packer, "packet", "read the model into a packet")
    timed(SendIO, "write", "the staging's write (with its copy)")
    if torch.cuda.is_initialized():
        from weightsync._memory import _slab

        timed(_slab, "copy_on_stream", "  of which the copy into GPU memory")
        timed(torch.cuda.Event, "synchronize", "    of which the wait for it")
    timed(SendMachine, "feed", "the send's machine: fed")
    timed(SendIO, "post", "the notices (a write to each worker)")
    timed(SendIO, "listen_blocking", "the wait for acks, and taking them")
    timed(SendIO, "take", "  of which taking the acks")
    return labels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=0.0625, help="MiB, as 8 tensors (default: %(default)s)")
    parser.add_argument(
        "--model", choices=["flat", "mlp", "transformer"], default="flat", help="(default: %(default)s)"
    )
    parser.add_argument("--workers", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument("--sends", type=int, default=2000, help="timed sends (default: %(default)s)")
    parser.add_argument("--steps", action="store_true", help="also time the trainer's steps")
    parser.add_argument(
        "--calls", action="store_true", help="also count the calls a send makes on the trainer (slow)"
    )
    parser.add_argument(
        "--cprofile", type=int, default=0, metavar="N", help="print the N costliest functions of each side"
    )
    parser.add_argument("--async", dest="overlap", action="store_true", help="send_async() + wait_async()")
    parser.add_argument("--device", default="cpu", help="the models' device (default: %(default)s)")
    parser.add_argument(
        "--gap", type=float, default=0.0, metavar="MS", help="idle milliseconds after each send (default: 0)"
    )
    args = parser.parse_args()
    nbytes = int(args.size * (1 << 20))
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is visible")

    bare = bare_round_trip(args.workers, args.sends)

    ctx = mp.get_context("spawn")
    scheme = ws.MultiProcessWeightSyncScheme()
    pipes, procs, outs = [], [], []
    for _ in range(args.workers):
        ours, theirs = ctx.Pipe()
        results, out = ctx.Pipe(duplex=False)
        procs.append(
            ctx.Process(
                target=worker, args=(scheme, theirs, args.model, nbytes, args.device, args.cprofile, out)
            )
        )
        procs[-1].start()
        pipes.append(ours)
        outs.append(results)
    model = make_model(args.model, nbytes, args.device)
    scheme.init_on_sender("policy", pipes=pipes, model=model)
    sender = scheme.get_sender()
    scheme.wait_for_workers()
    for _ in range(50):
        sender.send()
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
    totals: collections.Counter[str] = collections.Counter()
    steps: dict[str, list[float]] = collections.defaultdict(list)
    order = wrap_steps(totals) if args.steps else []
    walls, cpus, stalls = [], [], []
    calls = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    for _ in range(args.sends):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        wall, cpu = time.perf_counter(), time.thread_time()
        if args.calls:
            sys.setprofile(count)
        if profiler is not None:
            profiler.enable()
        if args.overlap:
            sender.send_async()
            stalls.append(time.perf_counter() - wall)
        else:
            sender.send()
        if profiler is not None:
            profiler.disable()
        if args.calls:
            sys.setprofile(None)
        for label, seconds in totals.items():
            steps[label].append(seconds)
        totals.clear()
        if args.overlap:
            sender.wait_async()
            totals.clear()  # (the steps are the stall's)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
        if args.gap:
            time.sleep(args.gap / 1000)
    scheme.shutdown()
    received = [out.recv() for out in outs]
    for proc in procs:
        proc.join()

    size = sum(p.numel() * p.element_size() for p in model.parameters())
    how = "send_async() + wait_async()" if args.overlap else "blocking send()"
    print(f"{size} bytes as {len(list(model.parameters()))} tensors on {args.device} to {args.workers} "
          f"worker(s), {args.sends} sends, {how}; torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"bare byte round trip to each worker (median): {bare * 1e6:.0f} us")
    print(f"{how} (median): {statistics.median(walls) * 1e6:.0f} us; "
          f"the trainer's thread CPU per send: {statistics.median(cpus) * 1e6:.0f} us")  # fmt: skip
    if stalls:
        print(f"stall, until send_async() returned (median): {statistics.median(stalls) * 1e6:.0f} us")
    for i, (got, _) in enumerate(received):
        if got is not None:
            print(f"worker {i}: receive() that applied an update (median): "
                  f"{got[0] * 1e6:.0f} us wall, {got[1] * 1e6:.0f} us CPU")  # fmt: skip
    if args.calls:
        print(f"calls a send makes on the trainer (Python functions and the C functions they call): "
              f"{calls[0] / args.sends:.0f}")  # fmt: skip
    for label in order:
        if steps.get(label):
            print(f"  {label:40s} {statistics.median(steps[label]) * 1e6:7.1f} us (median per send)")
    if profiler is not None:
        import pstats

        print(f"the {args.cprofile} costliest functions on the trainer's thread, over {args.sends} sends:")
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.cprofile)
        for i, (_, stats) in enumerate(received):
            print(f"worker {i}: the {args.cprofile} costliest functions of its receive() calls:\n{stats}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
