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
import contextlib
import multiprocessing.process
import os
import pickle
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import anyio
import torch

from .._copy import usable_cores
from .._exceptions import SenderClosedError, SenderLostError, WorkerLostError, WorkerProtocolError
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


# How long a lost peer's exit status may take to show once its pipe closed:
# it closes its descriptors before it becomes a zombie, and a fork server
# reports its children's status a moment after reaping them.
_STATUS_WAIT = 0.25


def started_here(pid: int) -> multiprocessing.process.BaseProcess | None:
    """The ``multiprocessing`` Process object of ``pid`` if this process
    started it (by any start method; a fork server's children are not our
    children, but their Process objects still learn how they ended)."""
    # multiprocessing keeps the unjoined children of this process here.
    for process in list(getattr(multiprocessing.process, "_children", ())):
        if process.pid == pid:
            return process
    return None


def _status_now(
    pid: int, process: multiprocessing.process.BaseProcess | None
) -> tuple[int | None, int | None] | None:
    """(exit code, signal) of process ``pid`` if it ended and this process can
    tell; None otherwise."""
    code: int | None = None
    if process is not None:
        with contextlib.suppress(ValueError):  # the user closed the Process object
            code = process.exitcode
    if code is not None:
        return (code, None) if code >= 0 else (None, -code)
    try:
        # Our child: read its status without reaping it (its Process object
        # or the user's waitpid still gets it).
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except OSError:  # not our child
        info = None
    if info is not None:
        if info.si_code == os.CLD_EXITED:
            return info.si_status, None
        return None, info.si_status
    # A zombie of another parent: /proc still has its wait status (field 52).
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        if fields[0] == b"Z" and len(fields) > 49:
            status = int(fields[49])
            return ((status >> 8) & 0xFF, None) if status & 0x7F == 0 else (None, status & 0x7F)
    except (OSError, ValueError, IndexError):
        pass
    return None


def exit_status(
    pid: int, process: multiprocessing.process.BaseProcess | None = None
) -> tuple[int | None, int | None]:
    """(exit code, signal) of a peer that is gone, waiting briefly for it to
    show; (None, None) when it cannot be told (or it still runs)."""
    deadline = time.monotonic() + _STATUS_WAIT
    while True:
        found = _status_now(pid, process)
        if found is not None or time.monotonic() >= deadline:
            return found or (None, None)
        time.sleep(0.01)


def describe_exit(exit_code: int | None, exit_signal: int | None) -> str:
    if exit_signal is not None:
        try:
            name = signal.Signals(exit_signal).name
        except ValueError:
            name = f"signal {exit_signal}"
        if exit_signal == signal.SIGKILL:
            return f"it was killed by {name} (a kill -9, or the out-of-memory killer)"
        return f"it was killed by {name}"
    if exit_code is not None:
        return f"it exited with status {exit_code}"
    return ""


class PipeChannel:
    """One end of a pipe carrying pickled control tuples.

    ``lost(reason)`` builds the exception raised when the peer is gone, and
    ``garbled(reason)`` the one raised for bytes that are not a message; the
    transport decides whether that is about a worker or the sender.
    """

    def __init__(
        self, conn: Connection, lost: Callable[[str], Exception], garbled: Callable[[str], Exception]
    ) -> None:
        self.conn = conn
        self._fd = conn.fileno()
        self._lost = lost
        self._garbled = garbled
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
            data = self.conn.recv_bytes()
        except (OSError, EOFError, ValueError) as exc:
            raise self._closed(exc) from exc
        try:
            # Trusted: the pipe the user set up between their own processes
            # (unpickling runs code; see the README on what the channel trusts).
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

# What a worker may send: kind -> length of the tuple.
_WORKER_MESSAGES = {"hello": 4, "ack": 3, "error": 3}


class PipeSenderTransport:
    """The sender's channel to one worker process, over the user's pipe; the
    bytes go through ``staging``, shared by all the workers of the scheme."""

    def __init__(
        self,
        pipe: Connection,
        worker_id: int,
        staging: Staging,
        model_id: str | None,
        *,
        fault_hint: str | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.model_id = model_id
        self._staging = staging
        # Said along with a worker's SIGSEGV: what the scheme knows may cause one.
        self._fault_hint = fault_hint
        self._channel = PipeChannel(pipe, self._lost, self._garbled)
        self.layout: Manifest | None = None
        self.worker_pid: int | None = None
        # The worker's Process object, when multiprocessing started it here:
        # it tells how the worker ended even after the user joined it.
        self._process: multiprocessing.process.BaseProcess | None = None
        self._posted = 0
        self._closed = False

    def _lost(self, reason: str) -> WorkerLostError:
        code: int | None = None
        sig: int | None = None
        if self.worker_pid is not None and self.worker_pid != os.getpid():  # (in-process workers never exit)
            code, sig = exit_status(self.worker_pid, self._process)
        why = describe_exit(code, sig)
        if why:
            reason = f"{why}; {reason}"
        if sig == signal.SIGSEGV and self._fault_hint:
            reason = f"{reason}. {self._fault_hint}"
        return worker_lost(self.worker_id, self.model_id, reason, exit_code=code, exit_signal=sig)

    def _garbled(self, reason: str) -> WorkerProtocolError:
        return WorkerProtocolError(
            f"worker {self.worker_id} (model {self.model_id!r}) broke the protocol: {reason}",
            worker_id=self.worker_id,
            model_id=self.model_id,
        )

    def _checked(self, message: tuple) -> tuple:
        """``message`` if it is one a worker may send now.

        :raises WorkerProtocolError: it is not.
        """
        kind = message[0]
        if _WORKER_MESSAGES.get(kind) != len(message):
            raise self._garbled(f"it sent {message!r:.80}, which is not a message")
        if kind == "hello":
            model_id = message[1]
            if model_id is not None and self.model_id is not None and model_id != self.model_id:
                raise self._garbled(f"it announced model {model_id!r} on this model's channel")
        elif not isinstance(message[1], int) or message[1] > self._posted:
            raise self._garbled(
                f"it answered version {message[1]!r}, never sent to it (newest sent: {self._posted})"
            )
        return message

    def _handle_hello(self, message: tuple) -> None:
        _, _model_id, pid, signature = message
        try:
            layout = Manifest.from_signature(signature)
            pid = int(pid)
        except Exception as exc:
            raise self._garbled(f"it announced a model that cannot be read ({exc})") from exc
        self.worker_pid = pid
        self._process = started_here(pid)
        self._channel.watch(pid)
        self.layout = layout
        # A fresh worker runs on its own memory.
        self._staging.released(self.worker_id, 0, None)

    async def connect(self) -> Manifest | None:
        while self.layout is None:
            message = await self._channel.recv()
            if message is not None and self._checked(message)[0] == "hello":
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
            kind = self._checked(message)[0]
            if kind == "ack":
                self._staging.released(self.worker_id, message[1], message[2])
                if message[1] == packet.version:
                    return
            elif kind == "error" and message[1] == packet.version:
                raise worker_failed(self.worker_id, self.model_id, packet.version, str(message[2]))
            elif kind == "hello":
                # The worker re-initialised: tell it about this update again.
                self._handle_hello(message)
                await self._channel.send(self._update(packet))
            # Anything else is an ack or error of an older, abandoned send,
            # or a duplicate: a stale ack never completes this one.

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
        self._channel = PipeChannel(pipe, self.lost, self.lost)
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
            if len(message) != 6:
                raise self.lost(f"it sent {message!r:.80}, which is not a message")
            _, version, layout_id, descriptor, threads, sender_pid = message
            self._channel.watch(sender_pid)
            return PipeUpdate(version, layout_id, descriptor, threads, self)
        if kind == "close":
            raise SenderClosedError(
                f"the sender of model {self.model_id!r} shut down", model_id=self.model_id
            )
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
