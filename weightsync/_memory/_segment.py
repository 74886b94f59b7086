"""Anonymous shared-memory segments (Linux ``memfd``).

A segment is created by the sender with ``memfd_create``: it has no name in
``/dev/shm`` or anywhere else, so nothing can be left behind when either side
is killed, and nobody can guess or open it by name. A worker on the same host
opens it through ``/proc/<sender pid>/fd/<fd>`` (same user only) and maps it
read-only, so a buggy worker cannot write into what the others read.

Layout: a 64-byte header, then the data::

    [0:8]    published version (int64); -1 while the sender is writing
    [8:24]   random token identifying this segment
    [24:32]  the version being written (int64), when written progressively
    [32:40]  how many of its bytes are in so far (int64); -1: it never will be
    [64:..]  data

The last two let a reader copy a version out while it is still arriving
(:meth:`Segment.begin_fill`, :meth:`Segment.filled_to`, :meth:`Segment.progress`),
as the torch.distributed transport's host leader does for its host's other
workers.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import struct
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from .._copy import PlanCache, usable_cores
from .._digest import copy_and_check, copy_out
from .._exceptions import out_of_resources
from .._packet import Manifest, Packet
from ._pinned import register, unregister
from ._placement import on_caller_stream
from ._views import LayoutViews

__all__ = ["BROKEN", "HEADER_BYTES", "AttachedSegments", "Segment", "SegmentRef"]

HEADER_BYTES = 64
WRITING = -1
_VERSION = struct.Struct("<q")
_PROGRESS = struct.Struct("<qq")
_PROGRESS_AT = 24
#: ``filled`` of a version that will never be complete.
BROKEN = -1
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class SegmentRef(NamedTuple):
    """What a worker needs to map a sender's segment: small, picklable."""

    pid: int
    fd: int
    nbytes: int
    token: bytes


class Segment:
    """A shared byte buffer with a published-version header.

    The sender writes with :meth:`begin_write` / :meth:`publish`; a reader
    checks :meth:`published` before and after copying out: if the version it
    was told about is not published on both sides of the copy, the sender
    overwrote the data meanwhile and the copy must be discarded.
    """

    def __init__(self, fd: int, nbytes: int, mapping: mmap.mmap, token: bytes, *, owner: bool) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.token = token
        self.owner = owner
        self._mmap: mmap.mmap | None = mapping
        self._ref: SegmentRef | None = None
        with warnings.catch_warnings():
            # A reader's mapping is read-only on purpose; torch warns that it
            # cannot be written, which is exactly the point.
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(mapping, dtype=torch.uint8)
        self.data: torch.Tensor | None = whole[HEADER_BYTES : HEADER_BYTES + nbytes]
        # The whole mapping (page-aligned), for mprotect.
        self._span = (whole.data_ptr(), len(mapping))
        self.protected = False
        # The copy plan of the last write (the writer's views, and the
        # sender's last read of its model, whose tensors it does not own).
        self._plans = PlanCache(sources_move=True)
        # Whether the mapping is registered page-locked with CUDA (None: not
        # tried yet; False: it could not be).
        self._pinned: bool | None = None

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """Create a segment of ``nbytes`` data bytes, readable and writable
        by this process only until a worker is told its descriptor."""
        with out_of_resources(f"create a shared-memory segment of {nbytes} bytes"):
            return cls._create(nbytes)

    @classmethod
    def _create(cls, nbytes: int) -> Segment:
        fd = os.memfd_create("weightsync-staging", os.MFD_CLOEXEC)
        mapping: mmap.mmap | None = None
        try:
            # memfd starts out as mode 0777; only this user's workers, which
            # open it through /proc, are meant to read it.
            os.fchmod(fd, 0o600)
            size = HEADER_BYTES + max(nbytes, 1)
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            token = secrets.token_bytes(16)
            mapping[8:24] = token
            _VERSION.pack_into(mapping, 0, 0)
            return cls(fd, nbytes, mapping, token, owner=True)
        except BaseException:
            # Nothing half-made is left behind, whatever stopped us.
            if mapping is not None:
                mapping.close()
            os.close(fd)
            raise

    @classmethod
    def attach(cls, pid: int, fd: int, nbytes: int, token: bytes, *, writable: bool = False) -> Segment:
        """Map another process's segment, read-only unless ``writable`` (a
        sender group's rank that writes its part into rank 0's buffer).

        :raises ResourceExhaustedError: this process is out of files or memory.
        :raises OSError: the process or its descriptor is gone.
        :raises ValueError: the descriptor now names another file.
        """
        with out_of_resources("map the sender's shared memory"):
            flags, prot = (os.O_RDONLY, mmap.PROT_READ)
            if writable:
                flags, prot = (os.O_RDWR, mmap.PROT_READ | mmap.PROT_WRITE)
            local = os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_CLOEXEC)
            try:
                size = HEADER_BYTES + max(nbytes, 1)
                mapping = mmap.mmap(local, size, flags=mmap.MAP_SHARED, prot=prot)
            finally:
                os.close(local)
        if mapping[8:24] != token:
            mapping.close()
            raise ValueError("the sender's descriptor no longer names its staging segment")
        return cls(-1, nbytes, mapping, token, owner=False)

    def published(self) -> int:
        assert self._mmap is not None
        return int(_VERSION.unpack_from(self._mmap, 0)[0])

    def begin_write(self) -> None:
        assert self._mmap is not None
        _VERSION.pack_into(self._mmap, 0, WRITING)

    def publish(self, version: int) -> None:
        assert self._mmap is not None
        _VERSION.pack_into(self._mmap, 0, version)

    def begin_fill(self, version: int) -> None:
        """Start writing ``version`` progressively: unpublished, none of its
        bytes in yet. (On x86 the stores of a thread are seen by other
        cores in program order, so a reader that sees a count sees the
        bytes before it.)"""
        assert self._mmap is not None
        self.begin_write()
        _PROGRESS.pack_into(self._mmap, _PROGRESS_AT, version, 0)

    def filled_to(self, nbytes: int) -> None:
        """The first ``nbytes`` bytes of the version begun are in
        (:data:`BROKEN`: it will never be complete)."""
        assert self._mmap is not None
        _VERSION.pack_into(self._mmap, _PROGRESS_AT + 8, nbytes)

    def progress(self) -> tuple[int, int, int]:
        """(published version, version being written, its bytes in so far)."""
        assert self._mmap is not None
        writing, filled = _PROGRESS.unpack_from(self._mmap, _PROGRESS_AT)
        return int(_VERSION.unpack_from(self._mmap, 0)[0]), int(writing), int(filled)

    def write(
        self, views: list[torch.Tensor], packet: Packet, digest: bool = False
    ) -> tuple[int, ...] | None:
        """Copy ``packet``'s tensors into ``views`` (of this segment) and
        publish its version; with ``digest``, digest each block as it is
        copied and return the digests (else None). Blocks; run it through
        ``run_blocking``."""
        self.begin_write()
        # Workers read only once this is published: all cores are ours
        # meanwhile. Copies from a GPU follow the caller's stream.
        with on_caller_stream(packet):
            if digest:
                sums = copy_out(views, packet.tensors, True, usable_cores())
            else:
                # (A reused read was checked for moved tensors as it was taken.)
                self._plans.plan(views, packet.tensors, unmoved=packet.reused).run(usable_cores())
                if not packet.reused:
                    self._plans.clear()  # (the caller's tensors, not to be held past the send)
                sums = None
        self.publish(packet.version)
        return sums

    def write_checked(
        self,
        views: list[torch.Tensor],
        packet: Packet,
        after_copy: Callable[[int, int], None] | None = None,
    ) -> tuple[tuple[int, ...], list[int]]:
        """Copy ``packet``'s tensors into ``views`` (of this segment),
        checking each block against its source right after copying it (see
        ``_digest.copy_and_check``); publish the version only if every
        block matched. Returns the sources' digests and the indices of the
        tensors that differ. Blocks; run it through ``run_blocking``."""
        self.begin_write()
        with on_caller_stream(packet):
            sums, bad = copy_and_check(views, packet.tensors, usable_cores(), after_copy)
        if not bad:
            self.publish(packet.version)
        return sums, bad

    def protect(self, writable: bool) -> None:
        """Map this (sender-owned) segment read-only in this process too
        (``writable=False``: a write into it faults in the writer), or
        writable again before it is rewritten.

        :raises OSError: mprotect failed.
        """
        if self._mmap is None or self.protected is not writable:
            return  # (protected is not writable: it is already as asked)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        if _LIBC.mprotect(self._span[0], self._span[1], prot) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect: {os.strerror(err)}")
        self.protected = not writable

    def pin(self) -> bool:
        """Register the mapping page-locked with CUDA, once, so that copies
        between it and a GPU run at the bus's speed rather than through a
        pageable bounce buffer. A reader's read-only mapping is registered
        read-only. Returns whether it is registered: False where CUDA is
        not available or the device refused (copies then go through
        pageable memory, as they would without this). Never raises; a
        refusal is reported once, at the ``weightsync`` logger's DEBUG.

        Registering the same range twice would fail (and leave an error
        behind in CUDA), so it is tried once per segment, and undone by
        :meth:`close`.
        """
        if self._pinned is not None:
            return self._pinned
        self._pinned = False
        if self.data is None:
            return False
        ptr, size = self._span
        # A reader's mapping is read-only: registered read-only.
        self._pinned = register(ptr, size, read_only=not self.owner, what="a staging segment")
        return self._pinned

    def _unpin(self) -> None:
        if self._pinned:
            self._pinned = False
            unregister(self._span[0])

    def ref(self) -> SegmentRef:
        """How a worker on this host finds this (sender-owned) segment.

        Made once: every update of every worker carries it."""
        if self._ref is None:
            self._ref = SegmentRef(os.getpid(), self.fd, self.nbytes, self.token)
        return self._ref

    def close(self) -> None:
        """Let go of the mapping and close the descriptor; idempotent.

        The memory is unmapped when the last tensor over it is freed, never
        before: ``torch.frombuffer`` views hold a reference to the mapping
        (but no buffer export, so ``mmap.close()`` would unmap under them).
        A worker whose parameters still point into a slot keeps it mapped.
        """
        self._unpin()
        self.data = None
        self._plans.clear()
        self._mmap = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class AttachedSegments:
    """A worker's read-only mappings of its sender's segments, each mapped
    once, with typed views cached per (segment, layout).

    ``keep``: how many stay mapped; mapping one more unmaps the oldest
    (1: the sender has a single staging segment; None: all are kept, for
    versioned slots).
    """

    def __init__(self, *, keep: int | None) -> None:
        self._keep = keep
        self._segments: dict[bytes, Segment] = {}
        self._views = LayoutViews()

    def segment(self, ref: SegmentRef) -> Segment:
        """The segment ``ref`` names, mapped on first use.

        :raises OSError: the sender or its descriptor is gone.
        :raises ValueError: the descriptor names another file now.
        """
        segment = self._segments.get(ref.token)
        if segment is None:
            while self._keep is not None and len(self._segments) >= self._keep:
                self._drop(next(iter(self._segments)))  # the oldest
            segment = self._segments[ref.token] = Segment.attach(ref.pid, ref.fd, ref.nbytes, ref.token)
        return segment

    def _drop(self, token: bytes) -> None:
        self._segments.pop(token).close()
        self._views.forget(token)

    def holds(self, ref: SegmentRef, version: int) -> bool:
        """Whether that segment holds ``version`` now (the sender has not
        begun overwriting it).

        :raises OSError: the sender or its descriptor is gone.
        """
        return self.segment(ref).published() == version

    def views(self, ref: SegmentRef, manifest: Manifest) -> list[torch.Tensor]:
        """Read-only typed views of ``manifest``'s tensors in that segment;
        the same list object for as long as the segment and layout stay."""
        return self._views.of(ref.token, manifest, lambda: self._data(ref))

    def _data(self, ref: SegmentRef) -> torch.Tensor:
        data = self.segment(ref).data
        assert data is not None
        return data

    def close(self) -> None:
        self._views.forget()
        for segment in self._segments.values():
            segment.close()
        self._segments = {}
