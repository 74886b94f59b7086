"""A relayed send's copy on one host, in shared memory that the host's Ray
actors map.

The Ray relay's agent receives each send straight into a memfd segment of
its own (:class:`HostBuffers`); the actors of its node map that segment
read-only and copy from it into their models (:meth:`HostReader.lease`).
The bytes land in the host's memory once, then once more per actor, with
no copy into the node's object store between.

The guard. A send can be abandoned at its deadline while an actor of it has
not yet read, or is still reading, its host's copy, and the next send's
agent must never rewrite bytes under a reader. Each fill of a segment gets
a *stamp* (a number the agent never reuses, kept in the segment's header
as its published version; -1 while the segment is being written), and the
kernel's advisory lock of the segment (``flock``) counts its readers:

- a reader opens a descriptor of its own on the segment, takes the lock
  shared, checks that the stamp is the one it was told, copies, checks the
  stamp again and lets go;
- before it rewrites a segment, the agent tries the lock exclusive without
  waiting. If it gets it, it marks the segment "being written" and lets go
  at once: from then on every reader finds another stamp and refuses,
  before it has touched its model. If a reader holds the lock, the agent
  leaves that segment to its readers and receives into a fresh one.

So a reader either copies bytes that nothing writes while it copies, or
refuses with its model untouched: a torn read cannot be applied. A reader
that dies lets go with its descriptor (the kernel drops its lock), and a
segment the agent left is freed when its last reader unmaps it.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

from ..._memory._segment import AttachedSegments, Segment, SegmentRef

if TYPE_CHECKING:
    import numpy as np

# The segment's header, as _segment lays it out: the published version
# (here the stamp) at 0, the segment's token at 8.
_STAMP = struct.Struct("<q")
_TOKEN_AT = 8
# How long a reader waits for the agent to let go of the lock (seconds).
_LOCK_WAIT = 5.0

__all__ = ["HostBuffers", "HostCopy", "HostCopyError", "HostReader", "UnmappedError"]


class HostCopy(NamedTuple):
    """Where a host's actors read a relayed send: the agent's segment and
    the stamp of the fill that holds the send. Small and picklable."""

    segment: SegmentRef
    stamp: int
    #: The bytes of each tensor, in the order of the send's arrays.
    sizes: tuple[int, ...]


class HostCopyError(RuntimeError):
    """The host's copy no longer holds the send (a later send began
    rewriting it): nothing was read from it."""


class UnmappedError(OSError):
    """This process cannot map the host's copy (another host, another
    user, out of descriptors): it reads the send from the object store."""


def _take_from_readers(segment: Segment) -> bool:
    """Mark ``segment`` "being written" unless a reader holds it; whether
    it was marked. Never waits."""
    assert segment.fd >= 0
    try:
        fcntl.flock(segment.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        # A reader that takes the lock after this finds no stamp it knows.
        segment.begin_write()
    finally:
        fcntl.flock(segment.fd, fcntl.LOCK_UN)
    return True


class HostBuffers:
    """A relay agent's receive buffer, in shared memory: one segment, reused
    by the sends of the same size; a fresh one when readers still hold it
    (see the module's docstring), or when another relay call of the agent
    still writes it (a chain of an abandoned send, ending within its stall
    limit). Thread-safe."""

    def __init__(self) -> None:
        #: The segment the next send reuses.
        self.segment: Segment | None = None
        self._all: list[Segment] = []
        self._writing: set[int] = set()  # ids of the segments a relay call writes
        self._lock = threading.Lock()
        self._stamps = itertools.count(1)

    def claim(self, nbytes: int) -> Segment:
        """The segment to receive the next send of ``nbytes`` bytes into,
        marked "being written" (see the module's docstring); give it back
        with :meth:`release`."""
        with self._lock:
            current = self.segment
            if (
                current is not None
                and current.nbytes == nbytes
                and id(current) not in self._writing
                and _take_from_readers(current)
            ):
                self._writing.add(id(current))
                return current
            fresh = Segment.create(nbytes)
            fresh.begin_write()
            self._writing.add(id(fresh))
            self._all.append(fresh)
            self.segment = fresh
            return fresh

    def publish(self, segment: Segment) -> int:
        """``segment`` holds a whole send: give it a new stamp; the stamp."""
        with self._lock:
            stamp = next(self._stamps)
        segment.publish(stamp)
        return stamp

    def release(self, segment: Segment, keep: Segment | None) -> None:
        """The relay call that claimed ``segment`` is done with it. The
        agent's side of every segment that is neither reused next, nor
        written, nor ``keep`` (the one holding the agent's base) is closed:
        its readers keep their mappings, and the memory goes with the last
        of them."""
        with self._lock:
            self._writing.discard(id(segment))
            for old in list(self._all):
                if old is not self.segment and old is not keep and id(old) not in self._writing:
                    old.close()
                    self._all.remove(old)

    def close(self) -> None:
        with self._lock:
            for segment in self._all:
                segment.close()
            self._all, self.segment = [], None


class HostReader:
    """An actor's side, for one model: its mappings of its host agent's
    segments (kept between sends: a mapping made again for every send
    would fault each of its pages in again), the newest two."""

    def __init__(self) -> None:
        self._mapped = AttachedSegments(keep=2)
        self._lock = threading.Lock()  # (a threaded actor may apply two sends at once)
        #: The actor's model is on a GPU: each mapping is page-locked once
        #: (read-only), so that the copy into the model runs at the bus's speed.
        self.pin = False

    @contextlib.contextmanager
    def lease(self, copy: HostCopy) -> Iterator[list[np.ndarray]]:
        """The send's byte arrays in the host's copy, which the agent does
        not rewrite until the block is left (see the module's docstring).

        :raises UnmappedError: this process cannot map the copy.
        :raises HostCopyError: a later send began rewriting it (before
            anything was read), or, which the lock rules out, during the block.
        """
        ref = copy.segment
        try:
            with self._lock:
                segment = self._mapped.segment(ref)
                if self.pin:
                    segment.pin()
                arrays = _arrays(segment, copy.sizes)
            # A descriptor of this lease's own: a lock belongs to the open
            # file, and two applies of one process must not share one.
            lock = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError) as exc:
            raise UnmappedError(f"{type(exc).__name__}: {exc}") from exc
        try:
            if os.pread(lock, len(ref.token), _TOKEN_AT) != ref.token:
                # The agent let that segment go, and its number names another file now.
                raise HostCopyError("the host's copy was replaced by a later send's before it was read")
            _lock_shared(lock)
            # (The stamp is read through the descriptor: the mapping may be
            # let go meanwhile by another apply of this process; the arrays
            # keep its memory.)
            if _stamp(lock) != copy.stamp:
                raise HostCopyError("the host's copy was rewritten by a later send before it was read")
            yield arrays
            if _stamp(lock) != copy.stamp:
                raise HostCopyError("the host's copy was rewritten by a later send while it was read")
        finally:
            os.close(lock)  # and with it the lock

    def close(self) -> None:
        self._mapped.close()


def _lock_shared(fd: int) -> None:
    """Take the segment's lock shared. The agent holds it exclusive only to
    change the stamp (microseconds); one stopped in between is waited for
    up to :data:`_LOCK_WAIT` seconds."""
    deadline = time.monotonic() + _LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise HostCopyError("the host's agent kept its copy locked") from None
            time.sleep(0.001)


def _stamp(fd: int) -> int:
    return int(_STAMP.unpack(os.pread(fd, _STAMP.size, 0))[0])


def _arrays(segment: Segment, sizes: Sequence[int]) -> list[np.ndarray]:
    data = segment.data
    assert data is not None
    flat = data.numpy()
    arrays, offset = [], 0
    for size in sizes:
        arrays.append(flat[offset : offset + size])
        offset += size
    return arrays
