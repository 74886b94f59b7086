"""Control messages over a ``multiprocessing`` pipe, as coroutines.

Messages are small tuples (a version, a layout, an ack); bulk bytes never
travel here. Reads wait on the pipe's descriptor in the event loop instead of
blocking it, and check every :data:`LIVENESS_PERIOD` seconds whether the peer
process is still alive: a peer that died while another process still holds its
end of the pipe never produces EOF, and must still be reported promptly.
"""

from __future__ import annotations

import pickle
import select
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


class PipeChannel:
    """One end of a pipe carrying pickled control tuples.

    ``lost(reason)`` builds the exception raised when the peer is gone; the
    transport decides whether that is a lost worker or a lost sender.
    """

    def __init__(self, conn: Connection, lost: Callable[[str], Exception]) -> None:
        self.conn = conn
        self._lost = lost
        self.peer: ProcessWatch | None = None

    def watch(self, pid: int) -> None:
        """Start checking that process ``pid`` (the peer) is alive."""
        if self.peer is None or self.peer.pid != pid:
            if self.peer is not None:
                self.peer.close()
            self.peer = ProcessWatch(pid)

    def peer_alive(self) -> bool:
        return self.peer is None or self.peer.alive()

    async def send(self, message: tuple[Any, ...]) -> None:
        """Send one message; waits (in the loop) only while the pipe is full.

        :raises: ``lost(...)`` if the peer closed its end or died.
        """
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            fd = self.conn.fileno()
            _, writable, _ = select.select([], [fd], [], 0)
            if not writable:
                while True:
                    with anyio.move_on_after(LIVENESS_PERIOD):
                        await anyio.wait_writable(fd)
                        break
                    if not self.peer_alive():
                        raise self._lost("its process exited")
            if len(data) <= _SMALL:
                self.conn.send_bytes(data)
            else:
                await anyio.to_thread.run_sync(self.conn.send_bytes, data)
        except (OSError, EOFError, ValueError) as exc:
            raise self._lost(f"its pipe is closed ({exc.__class__.__name__}: {exc})") from exc

    def poll(self) -> tuple[Any, ...] | None:
        """The next message if one is ready, without waiting."""
        try:
            if not self.conn.poll():
                return None
            return pickle.loads(self.conn.recv_bytes())  # trusted: the pipe the user set up
        except (OSError, EOFError, ValueError) as exc:
            raise self._lost(f"its pipe is closed ({exc.__class__.__name__}: {exc})") from exc

    async def recv(self, timeout: float | None = None) -> tuple[Any, ...] | None:
        """The next message; None if ``timeout`` seconds pass first.

        With ``timeout=None`` it waits until a message comes or the peer is
        gone; callers bound it with a cancel scope.

        :raises: ``lost(...)`` if the peer closed its end or died.
        """
        deadline = None if timeout is None else anyio.current_time() + timeout
        while True:
            message = self.poll()
            if message is not None:
                return message
            wait = LIVENESS_PERIOD
            if deadline is not None:
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    return None
                wait = min(wait, remaining)
            with anyio.move_on_after(wait):
                try:
                    await anyio.wait_readable(self.conn.fileno())
                except (OSError, ValueError) as exc:
                    raise self._lost(f"its pipe is closed ({exc})") from exc
                continue
            if not self.peer_alive():
                # One last look: the peer may have written before exiting.
                message = self.poll()
                if message is not None:
                    return message
                raise self._lost("its process exited")

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
