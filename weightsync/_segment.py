"""Anonymous shared-memory segments (Linux ``memfd``) and process liveness.

A segment is created by the sender with ``memfd_create``: it has no name in
``/dev/shm`` or anywhere else, so nothing can be left behind when either side
is killed, and nobody can guess or open it by name. A worker on the same host
opens it through ``/proc/<sender pid>/fd/<fd>`` (same user only) and maps it
read-only, so a buggy worker cannot write into what the others read.

Layout: a 64-byte header, then the data::

    [0:8]    published version (int64); -1 while the sender is writing
    [8:24]   random token identifying this segment
    [64:..]  data
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import select
import struct
import warnings

import torch

__all__ = ["HEADER_BYTES", "Segment", "ProcessWatch"]

HEADER_BYTES = 64
WRITING = -1
_VERSION = struct.Struct("<q")


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
        with warnings.catch_warnings():
            # A reader's mapping is read-only on purpose; torch warns that it
            # cannot be written, which is exactly the point.
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(mapping, dtype=torch.uint8)
        self.data: torch.Tensor | None = whole[HEADER_BYTES : HEADER_BYTES + nbytes]

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """Create a segment of ``nbytes`` data bytes, readable and writable
        by this process only until a worker is told its descriptor."""
        fd = os.memfd_create("weightsync-staging", os.MFD_CLOEXEC)
        try:
            # memfd starts out as mode 0777; only this user's workers, which
            # open it through /proc, are meant to read it.
            os.fchmod(fd, 0o600)
            size = HEADER_BYTES + max(nbytes, 1)
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        token = secrets.token_bytes(16)
        mapping[8:24] = token
        _VERSION.pack_into(mapping, 0, 0)
        return cls(fd, nbytes, mapping, token, owner=True)

    @classmethod
    def attach(cls, pid: int, fd: int, nbytes: int, token: bytes) -> Segment:
        """Map another process's segment read-only.

        :raises OSError: the process or its descriptor is gone.
        :raises ValueError: the descriptor now names another file.
        """
        local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = HEADER_BYTES + max(nbytes, 1)
            mapping = mmap.mmap(local, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
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

    def close(self) -> None:
        """Unmap and close; idempotent. Views handed out must be dropped first
        for the unmap to happen now; otherwise it happens when they are freed."""
        self.data = None
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            # A view still alive keeps the mapping; it goes when the view does.
            with contextlib.suppress(BufferError):
                mapping.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ProcessWatch:
    """Tells whether another process on this host is still alive.

    Uses a pidfd where the kernel has them (exact, immune to pid reuse) and
    ``/proc/<pid>/stat`` otherwise; a zombie counts as dead.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    @property
    def fd(self) -> int | None:
        """A descriptor that becomes readable when the process exits, if any."""
        return self._pidfd

    def alive(self) -> bool:
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], 0)
            return not readable
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in (b"Z", b"X")

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
