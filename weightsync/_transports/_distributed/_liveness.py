"""Liveness for the torch.distributed transport: one TCP connection per
worker to a listening socket of the trainer, held open for the worker's
life.

Nothing is written on it but the worker's rank and nonce at first and,
from the trainer, a *bell* byte each time it leaves the worker a notice in
the store and, at a clean shutdown, one closing byte. The kernel closes it
when either process ends, however it ends, so the trainer names a dead
worker at once and a worker tells a trainer that died (its end closes
bare) from one that shut down (the closing byte first); a stopped process
keeps it open, and is reported at the deadline, as under the other
schemes. An idle worker waits on this connection for the bell, not in
the store: polled, every idle worker would cost the trainer's store CPU
all the time (and the store's ``wait()`` with a timeout is not safe: see
``_dist_relay``).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time

__all__ = ["Liveness", "TrainerLink"]

_HELLO = struct.Struct("!4sIQ")
_MAGIC = b"WSL1"
_CLOSING = b"C"
_BELL = b"N"


class Liveness:
    """The trainer's listening socket for the workers' liveness connections.

    Never blocks: connections are accepted, and their first bytes (worker
    rank and nonce) read, when a worker's state is asked for. Safe to call
    from several threads (the chain's and the sender's loop).
    """

    def __init__(self, host: str) -> None:
        self._listener = socket.create_server((host, 0), backlog=256)
        self._listener.setblocking(False)
        self.address = (host, self._listener.getsockname()[1])
        self._unread: list[socket.socket] = []
        self._known: dict[tuple[int, int], socket.socket] = {}
        self._closed = False
        self._lock = threading.Lock()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, OSError):
                break
            conn.setblocking(False)
            self._unread.append(conn)
        still: list[socket.socket] = []
        for conn in self._unread:
            try:
                head = conn.recv(_HELLO.size, socket.MSG_PEEK)
            except BlockingIOError:
                still.append(conn)
                continue
            except OSError:
                conn.close()
                continue
            if len(head) < _HELLO.size:
                if head:
                    still.append(conn)
                else:
                    conn.close()
                continue
            conn.recv(_HELLO.size)
            magic, rank, nonce = _HELLO.unpack(head)
            if magic != _MAGIC:
                conn.close()
                continue
            old = self._known.pop((rank, nonce), None)
            if old is not None:
                old.close()
            self._known[(rank, nonce)] = conn
        self._unread = still

    def _conn(self, rank: int, nonce: int) -> socket.socket | None:
        """Worker ``rank``'s connection (accepting those that came), or None
        while it has not connected, or once closed. Under the lock."""
        if self._closed:
            return None
        conn = self._known.get((rank, nonce))
        if conn is None:
            self._accept()
            conn = self._known.get((rank, nonce))
        return conn

    def state(self, rank: int, nonce: int) -> str:
        """``"alive"``, ``"gone"`` (its connection closed: the worker ended),
        or ``"unknown"`` (not connected yet)."""
        with self._lock:
            conn = self._conn(rank, nonce)
            if conn is None:
                return "unknown"
            try:
                data = conn.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return "alive"
            except OSError:
                return "gone"
            return "alive" if data else "gone"

    def ring(self, rank: int, nonce: int) -> None:
        """Tell worker ``rank`` a notice waits for it in the store (a bell);
        never blocks. A connection that is gone, or full (of bells not yet
        read: the worker is busy and reads the store anyway), is not told."""
        with self._lock:
            conn = self._conn(rank, nonce)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(_BELL)

    def forget(self, rank: int, nonce: int) -> None:
        """Close worker ``rank``'s connection, with the closing byte (the
        trainer let go of it cleanly), and forget it. Never blocks."""
        with self._lock:
            conn = self._known.pop((rank, nonce), None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(_CLOSING)
                conn.close()

    def close(self) -> None:
        """Close every connection: each worker hears the trainer gone. Idempotent."""
        with self._lock:
            self._closed = True
            for conn in self._known.values():
                # One byte before the end: a clean shutdown, which a worker
                # then tells from a trainer that died (its end closes bare).
                with contextlib.suppress(OSError):
                    conn.send(_CLOSING)
            for conn in [*self._unread, *self._known.values()]:
                conn.close()
            self._unread, self._known = [], {}
            self._listener.close()


class TrainerLink:
    """A worker's liveness connection to its trainer.

    Blocks while it is built: it connects to ``address`` (up to ``timeout``
    seconds) and says who it is.

    :raises OSError: the trainer did not answer in time.
    """

    def __init__(self, address: tuple[str, int], rank: int, nonce: int, timeout: float) -> None:
        self._sock = socket.create_connection(address, timeout=timeout)
        self._sock.sendall(_HELLO.pack(_MAGIC, rank, nonce))
        self._sock.setblocking(False)
        #: The address the trainer reaches this host by.
        self.local_address: str = self._sock.getsockname()[0]
        # What the trainer said so far: "alive", "closed" or "gone".
        self._heard = "alive"

    def fileno(self) -> int:
        """Readable when the trainer rang, shut down or died (see :meth:`state`)."""
        return self._sock.fileno()

    def _drain(self) -> None:
        """Read what the trainer wrote: bells, its closing byte, its end."""
        while self._heard == "alive":
            try:
                data = self._sock.recv(4096)
            except BlockingIOError:
                return
            except OSError:
                self._heard = "gone"
                return
            if not data:
                self._heard = "gone"
            elif _CLOSING in data:
                self._heard = "closed"

    def state(self, wait: float = 0.0) -> str:
        """``"alive"``, ``"closed"`` (it shut down cleanly) or ``"gone"``
        (it died); waits up to ``wait`` seconds for it to tell. Reads the
        bells that came: one rung after this call makes the connection
        readable again."""
        deadline = time.monotonic() + wait
        self._drain()
        while self._heard == "alive" and (left := deadline - time.monotonic()) > 0:
            select.select([self._sock], [], [], left)
            self._drain()
        return self._heard

    def close(self) -> None:
        self._sock.close()
