"""Page-locked host memory, and the copies from a GPU into it.

A copy between a GPU and pageable host memory goes through a bounce buffer
of the CUDA driver, at a fraction of the bus's speed, and one from the
device blocks the calling thread until it is done. Into page-locked memory
it runs at the bus's speed, and a copy enqueued ``non_blocking`` is left to
the GPU while the caller goes on. So the host memory a GPU copies to or
from is registered with CUDA (``cudaHostRegister``): once, for as long as
it is used, never twice (a second registration of a range fails, and
leaves an error behind that torch would raise at its next kernel launch),
and let go before the memory is freed.

- :func:`register` and :func:`unregister`: the two calls, which never
  raise; a refusal is logged at the ``weightsync`` logger's DEBUG, and
  copies then go through pageable memory, as they would without this.
- :func:`host_buffer`: a flat host tensor in pages of its own, so that
  its registration never overlaps another's (CUDA pins whole pages: two
  buffers that share a page could not both be registered).
- :class:`PageLocks`: an owner's host tensors, each one's memory
  registered the first time it is asked for (however many times, whatever
  view of it), kept registered (and alive) until the owner says it no
  longer uses it. Buffers that change roles (a staging buffer that becomes
  a delta's base, and back) stay registered once throughout.
- :func:`copy_to_host`: a send's tensors copied into host views, those on
  a GPU enqueued on the caller's stream in chunks of :data:`EVENT_BYTES`
  with a CUDA event after each (:class:`DeviceCopies`), so that what reads
  the host bytes can start on the first chunks while the later ones copy.
- :func:`pins`: the one decision of whether host memory is page-locked
  (a GPU copies to or from it), for every staging and reader;
  :func:`staging_buffer` and :func:`stage_from_device`: the trainer's host
  buffer of a send from a GPU (Ray's put, torch.distributed's chain), and
  the copy into it.

Without CUDA nothing is registered and nothing else changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .._copy import check_same_layout, copy_tensors
from .._frames import piece_spans
from .._packet import Packet
from ._placement import gpu_stream, on_gpu, on_stream

__all__ = [
    "EVENT_BYTES",
    "DeviceCopies",
    "PageLocks",
    "copy_to_host",
    "host_buffer",
    "pins",
    "register",
    "stage_from_device",
    "staging_buffer",
    "unregister",
]

_log = logging.getLogger("weightsync")

#: The bytes copied from a GPU between two events: a reader of the host
#: bytes waits for one chunk at a time (a few MiB: a fraction of a
#: millisecond on the bus, and few events per send).
EVENT_BYTES = 4 << 20

# cudaHostRegisterPortable: for every CUDA context of the process;
# cudaHostRegisterReadOnly: memory the process cannot write.
_PORTABLE, _READ_ONLY = 1, 8
# More bytes than any buffer: a wait for it waits for every copy.
_EVERY_BYTE = 1 << 62
# The polls of a wait with a deadline (seconds): the first, and the longest.
_POLL = (0.0001, 0.002)


def register(ptr: int, size: int, *, read_only: bool = False, what: str = "host memory") -> bool:
    """Register ``size`` bytes at ``ptr`` page-locked with CUDA (read-only
    registration where the process cannot write them); whether they are
    now. False where CUDA is not available or refused (``what`` names the
    memory in the DEBUG message). Never raises. The caller registers a
    range once and undoes it (:func:`unregister`) before freeing it."""
    if size <= 0 or not torch.cuda.is_available():
        return False
    flags = _PORTABLE | (_READ_ONLY if read_only else 0)
    try:
        error = int(torch.cuda.cudart().cudaHostRegister(ptr, size, flags))
    except Exception as exc:  # no runtime bindings: copies stay pageable
        _log.debug("weightsync: no page-locked registration of %s: %s", what, exc)
        return False
    if error != 0:
        _clear_error()
        _log.debug("weightsync: CUDA refused to page-lock %s (cudaError %d)", what, error)
        return False
    return True


def unregister(ptr: int) -> None:
    """Undo :func:`register` of the range at ``ptr``. Never raises."""
    with contextlib.suppress(Exception):
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            _clear_error()


@functools.cache
def _runtime_library() -> Any:
    """The CUDA runtime library torch loaded (None: none is loaded as a
    library of its own, or it cannot be found)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:
        return None
    for path in paths:
        with contextlib.suppress(OSError):
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
    return None


def _clear_error() -> None:
    """Take back the error a refused call left for the calling thread
    (``cudaGetLastError``), so that torch does not raise it at its next
    kernel launch as that kernel's."""
    with contextlib.suppress(Exception):
        library = _runtime_library()
        if library is not None:
            library.cudaGetLastError()


def host_buffer(nbytes: int) -> torch.Tensor:
    """A flat ``uint8`` host tensor of ``nbytes``, in pages of its own (an
    anonymous private mapping, unmapped with the last tensor over it): a
    buffer to register, whose pages no other memory shares.

    :raises OSError: out of memory.
    """
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]


class _Lock:
    """One host tensor's memory (its whole storage), registered while held."""

    def __init__(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.ptr, self.size = storage.data_ptr(), storage.nbytes()
        # Held: the memory is never freed while it is registered.
        self.tensor: torch.Tensor | None = tensor
        self.registered = register(self.ptr, self.size, what=f"a staging buffer of {self.size} bytes")

    def covers(self, ptr: int) -> bool:
        return self.ptr <= ptr < self.ptr + max(self.size, 1)

    def release(self) -> None:
        if self.registered:
            self.registered = False
            unregister(self.ptr)
        self.tensor = None


class PageLocks:
    """The host tensors one owner keeps page-locked (see the module's
    docstring). Not thread-safe: one owner's thread at a time."""

    def __init__(self) -> None:
        self._held: list[_Lock] = []

    def lock(self, tensor: torch.Tensor) -> bool:
        """Register ``tensor``'s memory (a CPU tensor: its whole storage)
        unless it is already (by this object, through any view of it);
        whether it is registered. Tried once per memory: a refusal is not
        asked again while the memory is kept."""
        ptr = tensor.data_ptr()
        for held in self._held:
            if held.covers(ptr):
                return held.registered
        held = _Lock(tensor)
        self._held.append(held)
        return held.registered

    def keep_only(self, *used: torch.Tensor | Any | None) -> None:
        """Let go of every memory but that of ``used`` (tensors, numpy
        arrays, None), once nothing copies to or from it any more."""
        addresses = [_address(u) for u in used if u is not None]
        kept: list[_Lock] = []
        for held in self._held:
            if any(held.covers(a) for a in addresses):
                kept.append(held)
            else:
                held.release()
        self._held = kept

    def release(self) -> None:
        """Let go of all of it (nothing copies to or from it any more). Idempotent."""
        self.keep_only()

    def __len__(self) -> int:
        return len(self._held)


def _address(memory: Any) -> int:
    if isinstance(memory, torch.Tensor):
        return int(memory.data_ptr())
    return int(memory.__array_interface__["data"][0])  # a numpy array


class DeviceCopies:
    """The copies :func:`copy_to_host` enqueued: which leading bytes of the
    host buffer each event covers, and waits for them."""

    def __init__(self, marks: list[tuple[int, tuple[Any, ...]]], sources: Sequence[torch.Tensor]) -> None:
        # (bytes of the buffer in once these events completed, the events), in order.
        self._marks = marks
        self._done = 0  # how many marks are known complete
        # The tensors copied from, held until every copy is done: the
        # caller may drop its own references meanwhile.
        self._sources: Sequence[torch.Tensor] | None = sources if marks else None

    def wait_for(self, nbytes: int, until: float | None = None) -> bool:
        """Block until the buffer's first ``nbytes`` bytes are in (every
        copy, for more bytes than they cover); with ``until``
        (``time.monotonic()``), no later than that. Whether they are in.

        :raises RuntimeError: a copy failed (CUDA's error).
        """
        marks = self._marks
        while self._done < len(marks) and self._in() < nbytes:
            for event in marks[self._done][1]:
                if until is None:
                    event.synchronize()
                elif not _wait(event, until):
                    return False
            self._done += 1
        if self._done == len(marks):
            self._sources = None
        return True

    def _in(self) -> int:
        """The leading bytes known to be in."""
        return self._marks[self._done - 1][0] if self._done else 0

    def wait(self) -> None:
        """Block until every copy is done.

        :raises RuntimeError: a copy failed (CUDA's error).
        """
        self.wait_for(_EVERY_BYTE)

    def settle(self) -> None:
        """:meth:`wait`, before the buffer is written again or let go; never
        raises (a copy that failed is the send's failure, already told)."""
        with contextlib.suppress(RuntimeError):
            self.wait()


def _wait(event: Any, until: float) -> bool:
    delay = _POLL[0]
    while not event.query():
        if time.monotonic() >= until:
            return False
        time.sleep(delay)
        delay = min(delay * 2, _POLL[1])
    return True


def copy_to_host(
    destinations: Sequence[torch.Tensor], packet: Packet, chunk: int = EVENT_BYTES
) -> DeviceCopies:
    """Copy ``packet``'s tensors into ``destinations`` (views, in order, of
    one flat host buffer, page-locked for the copies from a GPU to run
    asynchronously), in chunks of ``chunk`` bytes (``_frames.piece_spans``
    over the tensors' bytes), an event recorded after each. Those on a GPU
    are enqueued on the caller's stream (:func:`~._placement.gpu_stream`:
    after the work the caller enqueued before the send, before any it
    enqueues after it); those in host memory are copied at once. Returns
    without waiting for the device: the bytes are in once
    :meth:`DeviceCopies.wait_for` says so."""
    sources = packet.tensors
    for dst, src in zip(destinations, sources, strict=True):
        check_same_layout(dst, src)
    marks: list[tuple[int, tuple[Any, ...]]] = []
    # Per tensor on a GPU: its bytes on the device, the destination's, and the stream.
    flat: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] = {}
    end = 0
    with torch.no_grad():
        for pieces in piece_spans([d.numel() * d.element_size() for d in destinations], chunk):
            streams: dict[torch.device, Any] = {}
            for i, a, b in pieces:
                dst, src = destinations[i], sources[i]
                end = max(end, dst.data_ptr() - dst.untyped_storage().data_ptr() + b)
                if not src.is_cuda:
                    if a == 0:
                        copy_tensors([dst], [src])
                    continue
                if i not in flat:
                    stream = gpu_stream(packet.stream, src.device)
                    with on_stream(stream):
                        # (A strided or lazily conjugated tensor is made plain
                        # on the GPU first, on the same stream: the copies
                        # read it in order, and its memory is not reused
                        # before they did.)
                        plain = src.detach().resolve_conj().resolve_neg().contiguous()
                    flat[i] = (plain.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8), stream)
                out_of, into, stream = flat[i]
                streams[src.device] = stream
                with on_stream(stream):
                    into[a:b].copy_(out_of[a:b], non_blocking=True)
            events = []
            for stream in streams.values():
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
            marks.append((end, tuple(events)))
    return DeviceCopies(marks, sources)


def pins(devices: Iterable[str]) -> bool:
    """Whether host memory that tensors on ``devices`` (``_placement``
    names) are copied to or from is page-locked: where one of them is a GPU
    (the copy then runs at the bus's speed, and one from the device leaves
    the caller free). Every staging, reader and host buffer asks here."""
    return on_gpu(devices)


def staging_buffer(nbytes: int, devices: Iterable[str]) -> torch.Tensor:
    """A flat host buffer of ``nbytes`` for a send of tensors on
    ``devices``: in pages of its own where it will be page-locked
    (:func:`pins`, :func:`host_buffer`), else plain memory."""
    if pins(devices):
        return host_buffer(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8)


def stage_from_device(
    locks: PageLocks, buffer: torch.Tensor, views: list[torch.Tensor], packet: Packet
) -> DeviceCopies:
    """Copy ``packet``'s tensors (some on a GPU) into ``views`` of
    ``buffer``, which ``locks`` page-locks first (once for as long as it
    keeps it), the copies enqueued on the caller's stream in chunks
    (:func:`copy_to_host`): the one device-to-host staging of the trainer's
    host buffers. Blocks for a new registration only."""
    locks.lock(buffer)
    return copy_to_host(views, packet)
