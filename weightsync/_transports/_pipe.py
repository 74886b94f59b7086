"""Control messages over a ``multiprocessing`` pipe, as coroutines.

Messages are small tuples (a version, a layout, an ack); bulk bytes never
travel here. A read waits in the event loop for the pipe *or* the peer's
pidfd to become readable, whichever comes first: a peer that died while
another process still holds its end of the pipe never produces EOF, and must
still be reported promptly. Where pidfds are missing, the peer is polled every
:data:`LIVENESS_PERIOD` seconds instead.

This is the hot path of every send: readiness is checked with one
``select`` call, and a wait is one future on the loop, not a cancel scope.
"""

from __future__ import annotations

import asyncio
import pickle
import select
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import anyio

from .._segment import ProcessWatch

__all__ = ["LIVENESS_PERIOD", "PipeChannel"]

LIVENESS_PERIOD = 0.2
# Writes up to this size fit in a free pipe slot, so a write that follows a
# "writable" poll does not block.
_SMALL = 4096


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


async def _wait_readable_any(fds: list[int], timeout: float) -> None:
    """Wait until one of ``fds`` is readable or ``timeout`` seconds pass.
    Cancellable. The caller checks which, if any, happened."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not an asyncio loop (trio): one descriptor at a time
        with anyio.move_on_after(timeout):
            await anyio.wait_readable(fds[0])
        return
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    # A timer handle, not a cancel scope: this wait is on every send's path,
    # and a scope costs more than the rest of the wait.
    timer = loop.call_later(timeout, wake)
    for fd in fds:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        timer.cancel()
        for fd in fds:
            loop.remove_reader(fd)


def _now() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return anyio.current_time()


class PipeChannel:
    """One end of a pipe carrying pickled control tuples.

    ``lost(reason)`` builds the exception raised when the peer is gone; the
    transport decides whether that is a lost worker or a lost sender.
    """

    def __init__(self, conn: Connection, lost: Callable[[str], Exception]) -> None:
        self.conn = conn
        self._fd = conn.fileno()
        self._lost = lost
        self.peer: ProcessWatch | None = None

    def watch(self, pid: int) -> None:
        """Start watching process ``pid`` (the peer) for its exit."""
        if self.peer is None or self.peer.pid != pid:
            if self.peer is not None:
                self.peer.close()
            self.peer = ProcessWatch(pid)

    def peer_alive(self) -> bool:
        return self.peer is None or self.peer.alive()

    def _closed(self, exc: BaseException) -> Exception:
        return self._lost(f"its pipe is closed ({exc.__class__.__name__}: {exc})")

    async def _wait(self, timeout: float) -> None:
        """Wait for the pipe to be readable, the peer to exit, or ``timeout``."""
        watch = self.peer.fd if self.peer is not None else None
        if watch is None:  # no pidfd: wake up now and then to poll the peer
            await _wait_readable_any([self._fd], min(timeout, LIVENESS_PERIOD))
        else:
            await _wait_readable_any([self._fd, watch], timeout)

    async def send(self, message: tuple[Any, ...]) -> None:
        """Send one message; waits (in the loop) only while the pipe is full.

        :raises: ``lost(...)`` if the peer closed its end or died.
        """
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            while not select.select([], [self._fd], [], 0)[1]:
                with anyio.move_on_after(LIVENESS_PERIOD):
                    await anyio.wait_writable(self._fd)
                if not self.peer_alive():
                    raise self._lost("its process exited")
            if len(data) <= _SMALL:
                self.conn.send_bytes(data)
            else:
                await anyio.to_thread.run_sync(self.conn.send_bytes, data)
        except (OSError, EOFError, ValueError) as exc:
            raise self._closed(exc) from exc

    def try_send(self, message: tuple[Any, ...]) -> bool:
        """Send one small message now if that cannot block; False otherwise.

        :raises: ``lost(...)`` if the peer closed its end.
        """
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > _SMALL:
            return False
        try:
            if not select.select([], [self._fd], [], 0)[1]:
                return False
            self.conn.send_bytes(data)
        except (OSError, EOFError, ValueError) as exc:
            raise self._closed(exc) from exc
        return True

    def poll(self) -> tuple[Any, ...] | None:
        """The next message if one is ready, without waiting."""
        try:
            if not _readable(self._fd):
                return None
            # Trusted: the pipe the user set up between their own processes.
            return pickle.loads(self.conn.recv_bytes())
        except (OSError, EOFError, ValueError) as exc:
            raise self._closed(exc) from exc

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
            remaining = 3600.0 if deadline is None else deadline - _now()
            if remaining <= 0:
                return None
            await self._wait(remaining)
            message = self.poll()
            if message is not None:
                return message
            if not self.peer_alive():
                raise self._lost("its process exited")

    def wait_ready(self, timeout: float) -> bool:
        """Block this thread up to ``timeout`` seconds until the pipe is
        readable or the peer exited; True if either happened."""
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
            return bool(select.select(fds, [], [], timeout)[0])
        except (OSError, ValueError):
            return True  # closed: the next read reports it

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
