"""A ``multiprocessing`` pipe as a coroutine channel of small pickled tuples.

A read waits in the event loop for the pipe *or* the peer's pidfd to become
readable, whichever comes first: a peer that died while another process still
holds its end of the pipe never produces EOF, and must still be reported
promptly. Where pidfds are missing, the peer is polled every
:data:`LIVENESS_PERIOD` seconds instead. A peer that is gone is described by
how it ended, when this process can tell.

This is the hot path of every send: readiness is checked with one ``select``
call, and a wait is one future on the loop, not a cancel scope. Messages
are framed as ``multiprocessing.Connection`` frames them (a 4-byte
big-endian length, then the bytes), so either end may be a plain
``Connection``; but the channel writes each frame with one ``os.write``
(a send's notice is framed once for all its workers: :func:`frame`) and
reads through a buffer of its own, one ``os.read`` for whatever came.
"""

from __future__ import annotations

import _socket
import asyncio
import os
import pickle
import select
import socket
import stat
import struct
import time
from collections.abc import Callable, Collection
from multiprocessing.connection import Connection
from typing import Any

import anyio

from ..._readiness import ProcessWatch, wait_readable_any

__all__ = ["LIVENESS_PERIOD", "PipeChannel", "encode", "frame"]

LIVENESS_PERIOD = 0.2
# Writes up to this size fit in a free pipe slot, so a write that follows a
# "writable" poll does not block.
_SMALL = 4096


def encode(message: tuple[Any, ...]) -> bytes:
    """A message as it travels (unframed)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")
# What a read takes at once: every message but a large model's hello.
_READ_SIZE = 1 << 16


def frame(message: tuple[Any, ...]) -> bytes:
    """A message framed for the pipe, as ``Connection.send_bytes`` frames it."""
    data = encode(message)
    if len(data) > 0x7FFFFFFF:
        return _LENGTH.pack(-1) + _LONG_LENGTH.pack(len(data)) + data
    return _LENGTH.pack(len(data)) + data


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def _socket_of(fd: int) -> _socket.socket | None:
    """``fd`` as a socket object where it is a socket
    (``multiprocessing.Pipe()`` on POSIX is a socket pair), else None:
    through it, a read or a write that must not wait is one system call
    (``MSG_DONTWAIT``) rather than a poll and then the call. The
    descriptor stays the user's ``Connection``'s (closing it closes the
    pipe, as the peer must see): the object is detached from it before
    it goes (:meth:`PipeChannel.close`, or as the channel is collected),
    never closing it. (The C type: no cycle collection ever finalizes it
    before the channel that detaches it.)"""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        return _socket.socket(fileno=fd)
    except OSError:
        return None


def _now() -> float:
    return asyncio.get_running_loop().time()


class PipeChannel:
    """One end of a pipe carrying pickled control tuples.

    ``lost(reason)`` builds the exception raised when the peer is gone, and
    ``garbled(reason)`` the one raised for bytes that are not a message; the
    transport decides whether that is about a worker or the sender.
    """

    _sock: _socket.socket | None = None  # (also where __init__ did not finish)

    def __init__(
        self, conn: Connection, lost: Callable[[str], Exception], garbled: Callable[[str], Exception]
    ) -> None:
        self.conn = conn
        self._fd = conn.fileno()
        self._lost = lost
        self._garbled = garbled
        self.peer: ProcessWatch | None = None
        self._fds: tuple[int, ...] | None = None
        # Bytes read but not yet taken as messages (the start of a frame
        # whose rest has not come, or the frames after the one taken).
        self._pending = bytearray()
        # wait_ready() saw the pipe readable, and nothing read since: the
        # next read need not ask again (one system call less per message).
        self._readable_seen = False
        # Where the pipe is a socket: reads and writes that never wait.
        self._sock = _socket_of(self._fd)

    def watch(self, pid: int) -> None:
        """Start watching process ``pid`` (the peer) for its exit."""
        if self.peer is None or self.peer.pid != pid:
            if self.peer is not None:
                self.peer.close()
            self.peer = ProcessWatch(pid)
            self._fds = None

    def seen_readable(self, fds: Collection[int]) -> None:
        """The caller's own wait (an epoll set) saw these descriptors
        readable just now: if the pipe's is one, the next read does not ask
        again."""
        if self._fd in fds:
            self._readable_seen = True

    def peer_alive(self) -> bool:
        return self.peer is None or self.peer.alive()

    def fds(self) -> tuple[int, ...] | None:
        """The pipe's descriptor and the peer's pidfd: one of them turns
        readable when a message comes or the peer exits. None without a
        pidfd (the peer is then polled now and then: :meth:`recv`). The
        same tuple object until the peer changes (``ReadyWatch.keep``
        relies on it)."""
        if self._fds is None:
            watch = self.peer.fd if self.peer is not None else None
            self._fds = None if watch is None else (self._fd, watch)
        return self._fds

    def _closed(self, exc: BaseException) -> Exception:
        return self._lost(f"its pipe is closed ({exc.__class__.__name__}: {exc})")

    async def _wait(self, timeout: float | None) -> None:
        """Wait for the pipe to be readable, the peer to exit, or ``timeout``
        (None: no limit)."""
        watch = self.peer.fd if self.peer is not None else None
        if watch is None:  # no pidfd: wake up now and then to poll the peer
            await wait_readable_any([self._fd], min(timeout or LIVENESS_PERIOD, LIVENESS_PERIOD))
        else:
            await wait_readable_any([self._fd, watch], timeout)

    async def send(self, message: tuple[Any, ...]) -> None:
        """Send one message; waits (in the loop) only while the pipe is full.

        :raises: ``lost(...)`` if the peer closed its end or died.
        """
        data = frame(message)
        try:
            while not select.select([], [self._fd], [], 0)[1]:
                with anyio.move_on_after(LIVENESS_PERIOD):
                    await anyio.wait_writable(self._fd)
                if not self.peer_alive():
                    raise self._lost("its process exited")
            if len(data) <= _SMALL:
                self._write(data)
            else:
                await anyio.to_thread.run_sync(self._write, data)
        except (OSError, EOFError, ValueError) as exc:
            raise self._closed(exc) from exc

    def _write(self, data: bytes) -> None:
        """Write a whole frame (blocking for the part the pipe has no room for)."""
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def try_send(self, message: tuple[Any, ...]) -> bool:
        """Send one small message now if that cannot block; False otherwise.

        :raises: ``lost(...)`` if the peer closed its end.
        """
        return self.try_send_framed(frame(message))

    def try_send_framed(self, data: bytes) -> bool:
        """:meth:`try_send` for a message already framed (:func:`frame`):
        one ``os.write`` where the pipe has room for it (a small frame then
        goes whole)."""
        if len(data) > _SMALL:
            return False
        try:
            if self._sock is not None:
                try:
                    # (A frame this small goes whole or not at all.)
                    sent = self._sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return False
                if sent < len(data):
                    self._write(data[sent:])
                return True
            if not select.select([], [self._fd], [], 0)[1]:
                return False
            self._write(data)
        except (OSError, EOFError, ValueError) as exc:
            raise self._closed(exc) from exc
        return True

    def _extent(self) -> tuple[int, int] | None:
        """Where the next frame's bytes start and end in the buffer; None
        while its length has not all come."""
        pending = self._pending
        if len(pending) < 4:
            return None
        size = _LENGTH.unpack_from(pending)[0]
        if size != -1:
            return 4, 4 + size
        if len(pending) < 12:
            return None
        return 12, 12 + _LONG_LENGTH.unpack_from(pending, 4)[0]

    def _frame(self) -> bytes | None:
        """The next whole frame's bytes, taken out of the buffer; None while none is whole."""
        extent = self._extent()
        if extent is None or len(self._pending) < extent[1]:
            return None
        start, end = extent
        data = bytes(self._pending[start:end])
        del self._pending[:end]
        return data

    def _frame_ready(self) -> bool:
        extent = self._extent()
        return extent is not None and len(self._pending) >= extent[1]

    def _recv_some(self) -> bytes | None:
        """What the pipe holds now, read without waiting; None if nothing."""
        try:
            seen, self._readable_seen = self._readable_seen, False
            extent = self._extent()
            want = _READ_SIZE if extent is None else max(_READ_SIZE, extent[1] - len(self._pending))
            if self._sock is not None:
                try:
                    got = self._sock.recv(want, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return None
            else:
                if not seen and not _readable(self._fd):
                    return None
                got = os.read(self._fd, want)
        except (OSError, ValueError) as exc:
            raise self._closed(exc) from exc
        if not got:
            raise self._closed(EOFError(""))
        return got

    def _read_some(self) -> bool:
        """Read what the pipe holds into the buffer, without waiting; False
        if it held nothing."""
        got = self._recv_some()
        if got is None:
            return False
        self._pending += got
        return True

    def _read_whole(self) -> tuple[Any, ...] | bool:
        """:meth:`_read_some` with nothing buffered, where a read that held
        exactly one frame (the usual case: an ack, a notice) is that
        message, taken as it came, past the buffer."""
        got = self._recv_some()
        if got is None:
            return False
        if len(got) > 4 and _LENGTH.unpack_from(got)[0] == len(got) - 4:
            return self._decode(memoryview(got)[4:])
        self._pending += got
        return True

    def poll(self) -> tuple[Any, ...] | None:
        """The next message if one is ready, without waiting."""
        if not self._pending:
            whole = self._read_whole()
            if whole is not True:
                return whole or None
            return None if (data := self._frame()) is None else self._decode(data)
        data = self._frame()
        if data is None:
            if not self._read_some():
                return None
            data = self._frame()
            if data is None:
                return None  # (the rest of the frame is still to come)
        return self._decode(data)

    def poll_all(self) -> list[tuple[Any, ...]]:
        """Every message the pipe holds now, in order, without waiting (one
        read, where the pipe is readable)."""
        if not self._pending:
            whole = self._read_whole()
            if whole is not True:
                return [whole] if whole else []
        else:
            self._read_some()
        messages = []
        while (data := self._frame()) is not None:
            messages.append(self._decode(data))
        return messages

    def _decode(self, data: bytes | memoryview) -> tuple[Any, ...]:
        try:
            # Trusted: the pipe the user set up between their own processes
            # (unpickling runs code; see docs/usage.md on what the channel trusts).
            message = pickle.loads(data)
        except Exception as exc:
            raise self._garbled(f"it sent bytes that are not a message ({type(exc).__name__})") from exc
        if not isinstance(message, tuple) or not message:
            raise self._garbled(f"it sent {type(message).__name__} {message!r:.80}, not a message")
        return message

    async def recv(self, timeout: float | None = None) -> tuple[Any, ...] | None:
        """The next message; None if ``timeout`` seconds pass first.

        With ``timeout=None`` it waits until a message comes or the peer is
        gone; callers bound it with a cancel scope.

        :raises: ``lost(...)`` if the peer closed its end or died.
        """
        message = self.poll()
        if message is not None:
            return message
        deadline = None if timeout is None else _now() + timeout
        while True:
            remaining = None if deadline is None else deadline - _now()
            if remaining is not None and remaining <= 0:
                return None
            await self._wait(remaining)
            message = self.poll()
            if message is not None:
                return message
            if not self.peer_alive():
                raise self._lost("its process exited")

    def wait_ready(self, timeout: float) -> bool:
        """Block this thread up to ``timeout`` seconds until the pipe is
        readable or the peer exited; True if either happened (or a message
        was read already)."""
        if self._readable_seen or self._frame_ready():
            return True  # (seen readable, and nothing read since: no need to ask again)
        fds = [self._fd]
        watch = self.peer.fd if self.peer is not None else None
        if watch is not None:
            fds.append(watch)
        elif timeout > LIVENESS_PERIOD:
            # No pidfd: look at the peer now and then while waiting.
            end = time.monotonic() + timeout
            while (remaining := end - time.monotonic()) > 0:
                if self.wait_ready(min(remaining, LIVENESS_PERIOD)) or not self.peer_alive():
                    return True
            return False
        try:
            ready = select.select(fds, [], [], timeout)[0]
        except (OSError, ValueError):
            return True  # closed: the next read reports it
        self._readable_seen = self._fd in ready
        return bool(ready)

    def _let_go(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.detach()  # (the descriptor is the Connection's: never closed here)

    def __del__(self) -> None:
        self._let_go()

    def close(self) -> None:
        self._fds = None
        self._let_go()
        if self.peer is not None:
            self.peer.close()
            self.peer = None
