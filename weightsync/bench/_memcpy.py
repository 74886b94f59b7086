"""The memcpy references of ``weightsync bench``: a single-threaded memcpy
of a case's bytes, and the floor of a send's work (``workers + 1`` memcpys,
one into staging and one out per worker, on one thread and split across
every core; and the chain of two of them in sequence), measured in
the trainer process in the same run as the sends; and, where a case
involves a CUDA device, one device-to-device, one page-locked
device-to-host and one page-locked host-to-device copy of the same bytes
(:func:`device_copy_seconds`).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

__all__ = ["device_copy_seconds", "floor_seconds", "memcpy_floor_seconds", "memcpy_seconds"]


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def memcpy_seconds(nbytes: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` single-threaded ``copy_`` of ``nbytes``
    between two preallocated ``uint8`` tensors (after one untimed copy).
    Blocks for the copies; allocates ``2 * nbytes`` for the duration."""
    return _timed_copies(nbytes, 1, repeats)


def _timed_copies(nbytes: int, copies: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``copies`` single-threaded
    ``copy_`` of ``nbytes`` between two preallocated tensors (after one
    untimed copy)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    with _torch_threads(1):
        dst.copy_(src)
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(copies):
                dst.copy_(src)
            times.append(time.perf_counter() - start)
    return times


def memcpy_floor_seconds(nbytes: int, copies: int, repeats: int, threads: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` rounds of ``copies`` memcpys of ``nbytes``,
    the bytes split evenly across ``threads`` threads (torch single-threaded in
    each). With ``copies = workers + 1`` this is the least work a send through
    one staging buffer can do on this machine. Blocks for the copies.

    Each round hands work to the threads, which costs tens of microseconds:
    for small buffers :func:`floor_seconds` is the fairer floor.
    """
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    bounds = [nbytes * k // threads for k in range(threads + 1)]
    halves = [(src[a:b], dst[a:b]) for a, b in itertools.pairwise(bounds)]

    def work(part: int) -> None:
        source, target = halves[part]
        for _ in range(copies):
            target.copy_(source)

    times = []
    with _torch_threads(1), ThreadPoolExecutor(threads, thread_name_prefix="bench-memcpy") as pool:
        list(pool.map(work, range(threads)))
        for _ in range(repeats):
            start = time.perf_counter()
            for future in [pool.submit(work, part) for part in range(threads)]:
                future.result()
            times.append(time.perf_counter() - start)
    return times


def floor_threads() -> int:
    """The threads a floor's copies are split across: every core this
    process may run on (a send's copies, the trainer's and each worker's,
    run on as many)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def floor_seconds(
    nbytes: int, copies: int, repeats: int, threads: int | None = None
) -> tuple[list[float], list[float]]:
    """``copies`` memcpys of ``nbytes``, measured both ways: all on one
    thread, and split across ``threads`` threads (default: every core,
    :func:`floor_threads`; :func:`memcpy_floor_seconds`). Returns both
    sample lists; the faster median is what this machine can do, because
    handing a small buffer to other threads costs more than copying it.
    With ``copies = workers + 1`` it bounds a send's copies by the
    machine's memory bandwidth; with ``copies = 2``, by the chain of the
    two copies that must follow one another (into the staging, out of
    it). Blocks for the copies."""
    serial = _timed_copies(nbytes, copies, repeats)
    return serial, memcpy_floor_seconds(nbytes, copies, repeats, threads or floor_threads())


def device_copy_seconds(nbytes: int, device: str, repeats: int) -> dict[str, list[float]]:
    """Seconds of each of ``repeats`` copies of ``nbytes`` on CUDA device
    ``device``, of each kind: ``"d2d"`` (device to device), ``"d2h"`` (device
    to page-locked host memory) and ``"h2d"`` (the reverse), each issued with
    ``non_blocking=True`` and timed until ``torch.cuda.synchronize()``
    returned, after one untimed copy. Blocks for the copies; holds
    ``2 * nbytes`` on the device and ``nbytes`` page-locked for the duration
    (torch's caching allocators keep them for the next case)."""
    gpu = torch.device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=gpu)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=gpu)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pairs = {"d2d": (dst, src), "d2h": (host, src), "h2d": (dst, host)}
    times: dict[str, list[float]] = {}
    with torch.cuda.device(gpu):
        for kind, (target, source) in pairs.items():
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
            samples = times.setdefault(kind, [])
            for _ in range(repeats):
                start = time.perf_counter()
                target.copy_(source, non_blocking=True)
                torch.cuda.synchronize()
                samples.append(time.perf_counter() - start)
    return times
