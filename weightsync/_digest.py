"""Digests of tensors' bytes, for the end-to-end check of ``verify=True``.

The trainer digests the bytes of each tensor it sends; each worker digests
the bytes it is about to apply (the staging it reads, or Ray's arrays) and
refuses the update, its model untouched, if one differs.

Each tensor's bytes are cut into blocks of :data:`BLOCK` bytes (a tensor of
no bytes is one empty block), and each block gets an XXH3-64 digest (the
``xxhash`` package, the ``verify`` extra): about 16 GB/s a core from memory
on the project's machine, against 16.5 for CRC32C and 2.1 for zlib's CRC32,
and 45 GB/s on bytes already in cache. A send's digests are those of its
blocks, tensor by tensor in manifest order. Blocks, not whole tensors, so a
model of one large tensor is still digested on every thread, and so the
trainer can digest each block right after copying it into the staging, while
its bytes are still in cache (:func:`copy_with_digests`), rather than read
the whole model again.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._copy import byte_view, check_same_layout, copy_tensors, plain, run_on_threads, split_evenly
from ._exceptions import import_extra

__all__ = [
    "BLOCK",
    "copy_and_check",
    "copy_out",
    "copy_with_digests",
    "digests",
    "mismatched",
    "require_xxh3",
]

#: Bytes per digested block: small enough that a block just copied is still
#: in the core's cache when it is digested.
BLOCK = 1 << 20

Block = tuple[int, int, int]  # (tensor index, first byte, bytes)


def require_xxh3() -> Callable[[Any], int]:
    """XXH3-64 of a buffer, from xxhash (imported on first use).

    :raises MissingExtraError: xxhash is not installed; the message names
        the ``verify`` extra.
    """
    try:  # a plain import first: this runs once per digested block list
        import xxhash
    except ImportError:
        import_extra("xxhash", extra="verify", needed_by="verify=True")
        raise
    return xxhash.xxh3_64_intdigest


def _blocks(sizes: Sequence[int]) -> list[Block]:
    blocks: list[Block] = []
    for index, size in enumerate(sizes):
        blocks.extend((index, start, min(BLOCK, size - start)) for start in range(0, size, BLOCK))
        if size == 0:
            blocks.append((index, 0, 0))
    return blocks


def _on_threads(
    blocks: list[Block], threads: int, work: Callable[[int, int], None], keep_alive: object
) -> None:
    """``work(lo, hi)`` over runs of blocks of about equal bytes, one run a thread."""
    parts = max(1, min(threads, sum(b[2] for b in blocks) // (4 * BLOCK)))
    runs = split_evenly([b[2] for b in blocks], parts)
    run_on_threads([functools.partial(work, lo, hi) for lo, hi in runs], keep_alive, "weightsync-digest")


def digests(tensors: Sequence[torch.Tensor], threads: int = 1) -> tuple[int, ...]:
    """The digests of ``tensors``' blocks (see the module's docstring), on up
    to ``threads`` threads. Blocks the calling thread."""
    return _digested(tensors, threads)[1]


def _digested(tensors: Sequence[torch.Tensor], threads: int) -> tuple[list[Block], tuple[int, ...]]:
    """The blocks of ``tensors`` and their digests."""
    digest = require_xxh3()
    views = [byte_view(t) for t in tensors]
    blocks = _blocks([v.nbytes for v in views])
    out = [0] * len(blocks)

    def work(lo: int, hi: int) -> None:
        for k in range(lo, hi):
            index, start, size = blocks[k]
            out[k] = digest(views[index][start : start + size])

    _on_threads(blocks, threads, work, views)
    return blocks, tuple(out)


def copy_with_digests(
    destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], threads: int = 1
) -> tuple[int, ...]:
    """Copy ``sources`` into ``destinations`` (same shapes and dtypes) and
    return the digests of the sources' blocks, each block digested right
    after its copy, from the cache. Blocks the calling thread.

    Where a pair is not two plain CPU tensors (a GPU source), the copy goes
    through torch and the destinations are digested afterwards.
    """
    if not all(plain(d) and plain(s) for d, s in zip(destinations, sources, strict=True)):
        copy_tensors(destinations, sources, threads=threads)
        return digests(destinations, threads)
    for dst, src in zip(destinations, sources, strict=True):
        check_same_layout(dst, src)
    digest = require_xxh3()
    views = [byte_view(s) for s in sources]
    targets = [d.data_ptr() for d in destinations]
    origins = [s.data_ptr() for s in sources]
    blocks = _blocks([v.nbytes for v in views])
    out = [0] * len(blocks)

    def work(lo: int, hi: int) -> None:
        for k in range(lo, hi):
            index, start, size = blocks[k]
            if targets[index] != origins[index]:  # (else the bytes are there: only digested)
                ctypes.memmove(targets[index] + start, origins[index] + start, size)
            out[k] = digest(views[index][start : start + size])

    _on_threads(blocks, threads, work, (destinations, sources, views))
    return tuple(out)


def copy_out(
    destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], digest: bool, threads: int = 1
) -> tuple[int, ...] | None:
    """Copy ``sources`` into ``destinations``; with ``digest``, digest each
    block as it is copied and return the digests (else None). Blocks."""
    if digest:
        return copy_with_digests(destinations, sources, threads=threads)
    copy_tensors(destinations, sources, threads=threads)
    return None


def copy_and_check(
    destinations: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    threads: int = 1,
    after_copy: Callable[[int, int], None] | None = None,
) -> tuple[tuple[int, ...], list[int]]:
    """Copy ``sources`` into ``destinations`` (same shapes and dtypes), and
    check each block right after its copy, while both are in cache: the
    digest of the destination's block against the source's. Returns the
    sources' digests and the indices of the tensors with a block that
    differs (none: the destinations hold exactly the sources' bytes).
    Blocks the calling thread.

    ``after_copy(tensor index, first byte)``, a testing hook, runs between
    a block's copy and its check. Where a pair is not two plain CPU tensors
    (a GPU source), the copy goes through torch and both sides are digested
    afterwards.
    """
    if not all(plain(d) and plain(s) for d, s in zip(destinations, sources, strict=True)):
        copy_tensors(destinations, sources, threads=threads)
        sums = digests(sources, threads)
        blocks, got = _digested(destinations, threads)
        return sums, sorted({blocks[k][0] for k, (a, b) in enumerate(zip(got, sums, strict=True)) if a != b})
    for dst, src in zip(destinations, sources, strict=True):
        check_same_layout(dst, src)
    digest = require_xxh3()
    views = [byte_view(s) for s in sources]
    copies = [byte_view(d) for d in destinations]
    targets = [d.data_ptr() for d in destinations]
    origins = [s.data_ptr() for s in sources]
    blocks = _blocks([v.nbytes for v in views])
    out = [0] * len(blocks)
    bad: set[int] = set()

    def work(lo: int, hi: int) -> None:
        for k in range(lo, hi):
            index, start, size = blocks[k]
            ctypes.memmove(targets[index] + start, origins[index] + start, size)
            if after_copy is not None:
                after_copy(index, start)
            out[k] = digest(views[index][start : start + size])
            if digest(copies[index][start : start + size]) != out[k]:
                bad.add(index)

    _on_threads(blocks, threads, work, (destinations, sources, views, copies))
    return tuple(out), sorted(bad)


def mismatched(
    names: Sequence[str], tensors: Sequence[torch.Tensor], expected: Sequence[int], threads: int = 1
) -> list[str]:
    """The names of the tensors with a block whose digest is not the
    expected one (every name, if ``expected`` has the wrong length)."""
    blocks, got = _digested(tensors, threads)
    if len(got) != len(expected):
        return list(names)
    bad = sorted({blocks[k][0] for k, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b})
    return [names[i] for i in bad]
