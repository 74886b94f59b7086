"""The pipe transport: control messages over a ``multiprocessing`` pipe, bulk
bytes through a :class:`Staging` (one segment that workers copy out of, or
versioned slots that they run on).

Messages are small pickled tuples; bulk bytes never travel here::

    worker -> sender   ("hello", model_id, pid, signature)
                       ("ack", version, holding)      holding: what the worker runs on now
                       ("error", version, message)
    sender -> worker   ("update", version, layout_id, descriptor, copy_threads, sender_pid)
                       ("close",)

A read waits in the event loop for the pipe *or* the peer's pidfd to become
readable, whichever comes first: a peer that died while another process still
holds its end of the pipe never produces EOF, and must still be reported
promptly. Where pidfds are missing, the peer is polled every
:data:`LIVENESS_PERIOD` seconds instead.

This is the hot path of every send: readiness is checked with one ``select``
call, and a wait is one future on the loop, not a cancel scope.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import anyio
import torch

from .._copy import usable_cores
from .._exceptions import SenderLostError, WorkerLostError
from .._packet import Manifest, Packet
from ._base import Staging, StagingReader, worker_failed, worker_lost

__all__ = ["LIVENESS_PERIOD", "PipeChannel", "PipeEndpoint", "PipeSenderTransport", "ProcessWatch"]

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


# -- the sender's channel to one worker ----------------------------------------


class PipeSenderTransport:
    """The sender's channel to one worker process, over the user's pipe; the
    bytes go through ``staging``, shared by all the workers of the scheme."""

    def __init__(self, pipe: Connection, worker_id: int, staging: Staging, model_id: str | None) -> None:
        self.worker_id = worker_id
        self.model_id = model_id
        self._staging = staging
        self._channel = PipeChannel(pipe, self._lost)
        self.layout: Manifest | None = None
        self.worker_pid: int | None = None
        self._posted = 0
        self._closed = False

    def _lost(self, reason: str) -> WorkerLostError:
        return worker_lost(self.worker_id, self.model_id, reason)

    def _handle_hello(self, message: tuple) -> None:
        _, _model_id, pid, signature = message
        self.worker_pid = pid
        self._channel.watch(pid)
        self.layout = Manifest.from_signature(signature)
        # A fresh worker runs on its own memory.
        self._staging.released(self.worker_id, 0, None)

    async def connect(self) -> Manifest | None:
        while self.layout is None:
            message = await self._channel.recv()
            if message is not None and message[0] == "hello":
                self._handle_hello(message)
        if not self._channel.peer_alive():
            raise self._lost("its process exited")
        return self.layout

    def _update(self, packet: Packet) -> tuple[Any, ...]:
        threads = max(1, usable_cores() // packet.fanout)
        descriptor = self._staging.descriptor(self.worker_id)
        return ("update", packet.version, packet.manifest.layout_id, descriptor, threads, os.getpid())

    def post(self, packet: Packet) -> bool:
        if self._channel.try_send(self._update(packet)):
            self._posted = packet.version
            return True
        return False

    async def deliver(self, packet: Packet) -> None:
        if self._posted != packet.version:
            await self._channel.send(self._update(packet))
            self._posted = packet.version
        while True:
            message = await self._channel.recv()
            if message is None:
                continue
            kind = message[0]
            if kind == "ack":
                self._staging.released(self.worker_id, message[1], message[2])
                if message[1] == packet.version:
                    return
            elif kind == "error" and message[1] == packet.version:
                raise worker_failed(self.worker_id, self.model_id, packet.version, message[2])
            elif kind == "hello":
                # The worker re-initialised: tell it about this update again.
                self._handle_hello(message)
                await self._channel.send(self._update(packet))
            # Anything else is an ack or error of an older, abandoned send: a
            # stale ack never completes this one.

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.move_on_after(0.5):
                await self._channel.send(("close",))
        except WorkerLostError:
            pass
        self._channel.close()


# -- the worker's end ------------------------------------------------------------


@dataclass(eq=False)
class PipeUpdate:
    """An update announced over the pipe, read through the staging reader."""

    version: int
    layout_id: str
    descriptor: Any
    threads: int
    endpoint: PipeEndpoint

    def is_current(self) -> bool:
        try:
            return self.endpoint.reader.is_current(self.descriptor, self.version)
        except (OSError, ValueError) as exc:
            raise self.endpoint.lost(f"its staging memory cannot be opened ({exc})") from exc

    def apply(self, model: Any, targets: list[torch.Tensor], manifest: Manifest) -> None:
        try:
            self.endpoint.reader.apply(self.descriptor, model, targets, manifest, self.threads)
        except (OSError, ValueError) as exc:
            raise self.endpoint.lost(f"its staging memory cannot be opened ({exc})") from exc


class PipeEndpoint:
    """A worker's end of its pipe; updates are read through ``reader``."""

    def __init__(self, pipe: Connection, model_id: str | None, reader: StagingReader) -> None:
        self.model_id = model_id
        self.reader = reader
        self._channel = PipeChannel(pipe, self.lost)
        self._closed = False

    def lost(self, reason: str) -> SenderLostError:
        return SenderLostError(
            f"the sender of model {self.model_id!r} is gone: {reason}", model_id=self.model_id
        )

    async def announce(self, manifest: Manifest) -> None:
        await self._channel.send(("hello", self.model_id, os.getpid(), manifest.signature))

    def _handle(self, message: tuple, latest: PipeUpdate | None) -> PipeUpdate | None:
        kind = message[0]
        if kind == "update":
            _, version, layout_id, descriptor, threads, sender_pid = message
            self._channel.watch(sender_pid)
            return PipeUpdate(version, layout_id, descriptor, threads, self)
        if kind == "close":
            raise self.lost("it shut down")
        return latest

    def _drain(self, latest: PipeUpdate | None) -> PipeUpdate | None:
        # Only the newest update can still be read: skip the older ones.
        while (message := self._channel.poll()) is not None:
            latest = self._handle(message, latest)
        return latest

    async def next_update(self, timeout: float) -> PipeUpdate | None:
        latest = self._drain(None)
        if latest is not None or timeout <= 0:
            return latest
        message = await self._channel.recv(timeout)
        if message is None:
            return None
        return self._drain(self._handle(message, None))

    async def reply(self, version: int, error: str | None = None) -> None:
        if error is None:
            await self._channel.send(("ack", version, self.reader.holding()))
        else:
            await self._channel.send(("error", version, error))

    def wait_ready(self, timeout: float) -> bool:
        return self._channel.wait_ready(timeout)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.reader.close()
        self._channel.close()
