"""The pipe transport: control messages over a ``multiprocessing`` pipe, bulk
bytes through a :class:`Staging` (one segment that workers copy out of, or
versioned slots that they run on).

Messages are small pickled tuples (see ``_channel``); bulk bytes never
travel here::

    worker -> sender   ("hello", model_id, pid, signature, devices, reach)
                       reach: the GPUs it can copy from device to device (an older
                       worker's hello, without it, is read as reaching its own only)
                       ("ack", version, holding)      holding: what the worker runs on now
                       ("error", version, message)
                       ("released",)                  after a close: it let go of the sender's GPU memory
    sender -> worker   ("update", version, layout_id, descriptor, copy_threads, sender_pid, subset, digests)
                       subset: a partial update's signature, or None
                       digests: the tensors' digests (verify=True), or None
                       ("again", version)             the last "update" sent to this worker
                                                      but its version (the steady state)
                       ("close",)

The sender checks every message it reads (:class:`WorkerProtocolError` for
one that breaks the protocol); the worker trusts its sender's.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import signal
import struct
from collections.abc import Collection
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import anyio
import torch

from ..._copy import usable_cores
from ..._exceptions import SenderClosedError, SenderLostError, WorkerLostError, WorkerProtocolError
from ..._memory._placement import reachable
from ..._memory._slab import SlabRef
from ..._packet import Manifest, Packet, Signature
from .._base import EVERY_VERSION, DeviceAwareStaging, Staging, StagingReader, worker_failed, worker_lost
from .._peer import describe_exit, exit_status, started_here
from ._channel import PipeChannel, frame

__all__ = ["EncodedUpdates", "PipeEndpoint", "VersionedFrames", "PipeSenderTransport", "PipeUpdate"]


# -- the sender's channel to one worker ----------------------------------------

# What a worker may send: kind -> length of the tuple.
_WORKER_MESSAGES: dict[str, tuple[int, ...]] = {"hello": (5, 6), "ack": (3,), "error": (3,), "released": (1,)}

# How long the trainer's close waits for a worker told of its GPU memory to
# let go of it. CUDA IPC memory lives as long as the trainer's process: one
# that ends (or frees the memory) while a worker still maps it leaves torch
# warning "Producer process has been terminated before all shared CUDA
# tensors released". A worker lets go as soon as it hears the close (at its
# next receive(), or at once under the applier).
_RELEASE_WAIT = 2.0


# A version no send reaches, pickled as a 4-byte int (BININT): where it
# appears once in a framed notice, any version below 2**31 can be written
# over it (a pickle need not hold the shortest form of an int).
_MARK = 0x7EADBEEF
_MARK_BYTES = b"J" + struct.pack("<i", _MARK)
_VERSION = struct.Struct("<i")


class VersionedFrames:
    """Framed messages whose second field is a version, where from one
    message to the next usually only the version changes (a sender's
    update notices, one for all the workers of a send; a worker's acks).
    Each is framed once per rest, with a mark where the version goes, and
    each message writes its version over the mark: no pickling on a
    send's path."""

    def __init__(self) -> None:
        # (message without its version, the framed template, the mark's offset or -1)
        self._last: tuple[tuple[Any, ...], bytes, int] = ((), b"", -1)
        self._framed: tuple[tuple[Any, ...], bytes] = ((), b"")

    def encoded(self, message: tuple[Any, ...]) -> bytes:
        framed = self._framed  # (one read: another thread may replace it)
        if framed[0] == message:
            return framed[1]
        rest = message[:1] + message[2:]
        last = self._last
        if last[0] != rest:
            template = frame((message[0], _MARK, *message[2:]))
            at = template.find(_MARK_BYTES)
            if at < 0 or template.find(_MARK_BYTES, at + 1) >= 0:
                at = -1  # (the mark is not there once: frame each message whole)
            last = self._last = (rest, template, at)
        version, (_, template, at) = message[1], last
        if at < 0 or not 0 <= version < 2**31:
            data = frame(message)
        else:
            patched = bytearray(template)
            _VERSION.pack_into(patched, at + 1, version)
            data = bytes(patched)
        self._framed = (message, data)
        return data


class EncodedUpdates:
    """The update notices of one sender, framed (:class:`VersionedFrames`):
    the workers of one send are told the same thing (the staging's
    descriptor is one for all of them). A worker told the same notice
    before, but for its version, is told only the version (``("again",
    version)``): it keeps the rest of the last notice it read (the pipe
    delivers in order, so both ends agree on which that is)."""

    def __init__(self) -> None:
        self._full = VersionedFrames()
        self._again = VersionedFrames()

    def encoded(self, message: tuple[Any, ...], *, again: bool) -> bytes:
        """``message`` framed; ``again``: for a worker last told the same
        notice but for its version."""
        if again:
            return self._again.encoded(("again", message[1]))
        return self._full.encoded(message)


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
        updates: EncodedUpdates | None = None,
    ) -> None:
        self.worker_id = worker_id
        # Shared by the transports of one sender (see EncodedUpdates).
        self._updates = updates if updates is not None else EncodedUpdates()
        self.model_id = model_id
        self._staging = staging
        self._placed = staging.placed if isinstance(staging, DeviceAwareStaging) else None
        # Said along with a worker's SIGSEGV: what the scheme knows may cause one.
        self._fault_hint = fault_hint
        self._channel = PipeChannel(pipe, self._lost, self._garbled)
        self.layout: Manifest | None = None
        self.devices: tuple[str, ...] | None = None
        self.reach: tuple[str, ...] = ()
        self.worker_pid: int | None = None
        # The worker's Process object, when multiprocessing started it here:
        # it tells how the worker ended even after the user joined it.
        self._process: multiprocessing.process.BaseProcess | None = None
        self._posted = 0
        # The last notice this worker was sent, without its version (None:
        # none since it announced itself): the next one like it is only
        # its version (see EncodedUpdates).
        self._told: tuple[Any, ...] | None = None
        # The worker re-initialised since the current update was posted.
        self._resend = False
        self._closed = False
        # Whether the worker was told of the trainer's GPU memory (a slab).
        self._told_device = False
        self._pid = os.getpid()  # (sent with every update: the worker watches it)
        # Why the worker is gone (reason, exit code, signal), once it is.
        self._gone: tuple[str, int | None, int | None] | None = None

    def _lost(self, reason: str) -> WorkerLostError:
        if self._gone is None:
            code: int | None = None
            sig: int | None = None
            # (An in-process worker is this very process: it never exits.)
            if self.worker_pid is not None and self.worker_pid != os.getpid():
                code, sig = exit_status(self.worker_pid, self._process)
            why = describe_exit(code, sig)
            if why:
                reason = f"{why}; {reason}"
            if sig == signal.SIGSEGV and self._fault_hint:
                reason = f"{reason}. {self._fault_hint}"
            # A closed pipe or an exited process never comes back: later
            # sends fail at once, and stage nothing more for this worker.
            self._gone = (reason, code, sig)
            if code is not None or sig is not None or not self._channel.peer_alive():
                # Dead for sure: nothing staged is in use by it any more.
                self._staging.released(self.worker_id, EVERY_VERSION, None)
        reason, code, sig = self._gone
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
        if len(message) not in _WORKER_MESSAGES.get(kind, ()):
            raise self._garbled(f"it sent {message!r:.80}, which is not a message")
        if kind == "hello":
            model_id = message[1]
            if model_id is not None and self.model_id is not None and model_id != self.model_id:
                raise self._garbled(f"it announced model {model_id!r} on this model's channel")
        elif kind == "released":
            pass
        elif not isinstance(message[1], int) or message[1] > self._posted:
            raise self._garbled(
                f"it answered version {message[1]!r}, never sent to it (newest sent: {self._posted})"
            )
        return message

    def _handle_hello(self, message: tuple) -> None:
        _, _model_id, pid, signature, devices, *rest = message
        try:
            layout = Manifest.from_signature(signature)
            pid = int(pid)
            devices = tuple(str(d) for d in devices)
            reach = tuple(str(d) for d in rest[0]) if rest else devices
        except Exception as exc:
            raise self._garbled(f"it announced a model that cannot be read ({exc})") from exc
        self.worker_pid = pid
        self._told = None  # (a fresh worker knows no notice)
        self._process = started_here(pid)
        self._channel.watch(pid)
        self.devices = devices
        self.reach = reach
        self.layout = layout
        # A fresh worker runs on its own memory.
        self._staging.released(self.worker_id, 0, None)
        if self._placed is not None:
            self._placed(self.worker_id, devices, reach)

    async def connect(self) -> Manifest | None:
        while self.layout is None:
            message = await self._channel.recv()
            if message is not None and self._checked(message)[0] == "hello":
                self._handle_hello(message)
        if not self._channel.peer_alive():
            raise self._lost("its process exited")
        return self.layout

    def _update(self, packet: Packet) -> tuple[Any, ...]:
        if self._gone is not None:
            raise self._lost("")
        threads = max(1, usable_cores() // packet.fanout)
        descriptor = self._staging.descriptor(self.worker_id)
        if isinstance(descriptor, SlabRef):
            self._told_device = True
        return (
            "update",
            packet.version,
            packet.manifest.layout_id,
            descriptor,
            threads,
            self._pid,
            packet.subset,
            packet.digests,
        )

    def post(self, packet: Packet) -> bool:
        update = self._update(packet)
        told = update[:1] + update[2:]
        if self._channel.try_send_framed(self._updates.encoded(update, again=told == self._told)):
            self._told = told
            self._posted = packet.version
            self._resend = False
            return True
        return False

    def _untold(self, packet: Packet) -> bool:
        """Whether the worker has yet to be told of ``packet``: not posted,
        or posted before the worker re-initialised."""
        return self._posted != packet.version or self._resend

    async def deliver(self, packet: Packet) -> None:
        while True:
            if self._untold(packet):
                self._resend = False
                update = self._update(packet)
                self._told = None  # (if the send is cut short, the worker may not have it whole)
                await self._channel.send(update)
                self._told = update[:1] + update[2:]
                self._posted = packet.version
            message = await self._channel.recv()
            if message is not None and self._take(message, packet):
                return

    def ack_fds(self, packet: Packet) -> tuple[int, ...] | None:
        return None if self._untold(packet) else self._channel.fds()  # untold: deliver() tells it

    def try_ack(self, packet: Packet, ready: Collection[int] = ()) -> bool | None:
        if self._untold(packet):
            return None
        self._channel.seen_readable(ready)
        while (message := self._channel.poll()) is not None:
            if self._take(message, packet):
                return True
            if self._resend:
                return None  # it re-initialised: deliver() tells it again
        if not self._channel.peer_alive():
            raise self._lost("its process exited")
        return False

    def _take(self, message: tuple, packet: Packet) -> bool:
        """Act on one message from the worker; True if it acks ``packet``.

        :raises WorkerApplyError: it reports that it failed to apply ``packet``.
        :raises WorkerProtocolError: it is not a message a worker may send.
        """
        kind = self._checked(message)[0]
        if kind == "ack":
            self._staging.released(self.worker_id, message[1], message[2])
            return bool(message[1] == packet.version)
        if kind == "error" and message[1] == packet.version:
            raise worker_failed(self.worker_id, self.model_id, packet.version, str(message[2]))
        if kind == "hello":
            # The worker re-initialised: tell it about this update again.
            self._handle_hello(message)
            self._resend = True
        # Anything else is an ack or error of an older, abandoned send,
        # or a duplicate: a stale ack never completes this one.
        return False

    def why_late(self) -> str | None:
        return None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.move_on_after(0.5):
                await self._channel.send(("close",))
            if self._told_device and self._gone is None:
                await self._wait_released()
        except (WorkerLostError, WorkerProtocolError):
            pass
        self._channel.close()

    async def _wait_released(self) -> None:
        """Wait (up to _RELEASE_WAIT) until the worker let go of the
        trainer's GPU memory: it says so, or closes its end."""
        with anyio.move_on_after(_RELEASE_WAIT):
            while True:
                message = await self._channel.recv()
                if message is not None and self._checked(message)[0] == "released":
                    return


# -- the worker's end ------------------------------------------------------------


@dataclass(eq=False)
class PipeUpdate:
    """An update announced over the pipe, read through the staging reader."""

    version: int
    layout_id: str
    descriptor: Any
    threads: int
    endpoint: PipeEndpoint
    subset: Signature | None = None
    digests: tuple[int, ...] | None = None

    def is_current(self) -> bool:
        try:
            return self.endpoint.reader.is_current(self.descriptor, self.version)
        except (OSError, ValueError) as exc:
            raise self.endpoint.lost(f"its staging memory cannot be opened ({exc})") from exc

    def sources(self, manifest: Manifest) -> list[torch.Tensor]:
        try:
            return self.endpoint.reader.sources(self.descriptor, manifest)
        except (OSError, ValueError) as exc:
            raise self.endpoint.lost(f"its staging memory cannot be opened ({exc})") from exc

    @property
    def checked_on_host(self) -> bool:
        """Whether a verified update's bytes were checked by the sender for
        the whole host (the shared scheme's slots), so that this worker
        checks :meth:`check_mapping` instead of digesting them."""
        return self.endpoint.reader.checked_on_host

    def check_mapping(self, manifest: Manifest) -> str | None:
        """Why the staging this worker maps is not the one it was told
        (None: it is); see ``StagingReader.check``."""
        try:
            return self.endpoint.reader.check(self.descriptor, self.version, manifest)
        except (OSError, ValueError) as exc:
            raise self.endpoint.lost(f"its staging memory cannot be opened ({exc})") from exc

    def apply(self, model: Any, targets: list[torch.Tensor], manifest: Manifest) -> None:
        try:
            self.endpoint.reader.apply(self.descriptor, model, targets, manifest, self.threads)
        except (OSError, ValueError) as exc:
            raise self.endpoint.lost(f"its staging memory cannot be opened ({exc})") from exc


class PipeEndpoint:
    """A worker's end of its pipe; updates are read through ``reader``."""

    pushes = False

    def __init__(self, pipe: Connection, model_id: str | None, reader: StagingReader) -> None:
        self.model_id = model_id
        self.reader = reader
        self._channel = PipeChannel(pipe, self.lost, self.lost)
        self._closed = False
        # The last full notice read, but for its version: an "again" is it
        # with another version (see EncodedUpdates).
        self._told: tuple[Any, ...] | None = None
        # Acks, framed once and patched with each version.
        self._acks = VersionedFrames()

    def lost(self, reason: str) -> SenderLostError:
        return SenderLostError(
            f"the sender of model {self.model_id!r} is gone: {reason}", model_id=self.model_id
        )

    async def announce(self, manifest: Manifest, devices: tuple[str, ...]) -> None:
        hello = ("hello", self.model_id, os.getpid(), manifest.signature, devices, reachable(devices))
        await self._channel.send(hello)

    def _handle(self, message: tuple, latest: PipeUpdate | None) -> PipeUpdate | None:
        kind = message[0]
        if kind == "again":
            told = self._told
            if told is None:
                # (Sent before the sender read this endpoint's hello: it
                # tells this worker again, in full, once it has.)
                return latest
            return PipeUpdate(message[1], *told)
        if kind == "update":
            if len(message) != 8:
                raise self.lost(f"it sent {message!r:.80}, which is not a message")
            _, version, layout_id, descriptor, threads, sender_pid, subset, digests = message
            self._channel.watch(sender_pid)
            self._told = (layout_id, descriptor, threads, self, subset, digests)
            return PipeUpdate(version, *self._told)
        if kind == "close":
            # A slot on the trainer's GPU lives only as long as its process:
            # the model keeps running on copies of its own, and the worker
            # lets go of that memory before the trainer frees it.
            self.reader.keep_own()
            with contextlib.suppress(SenderLostError):
                self._channel.try_send(("released",))
            raise SenderClosedError(
                f"the sender of model {self.model_id!r} shut down", model_id=self.model_id
            )
        return latest

    def _drain(self, latest: PipeUpdate | None) -> PipeUpdate | None:
        # Only the newest update can still be read: skip the older ones. (A
        # partial update is never skipped so: the sender moves on from one
        # only once this worker acked it, or no longer sends partial
        # updates to it.)
        for message in self._channel.poll_all():
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

    def take_ready(self) -> PipeUpdate | None:
        return self._drain(None)

    def _reply(self, version: int, error: str | None) -> tuple[Any, ...]:
        if error is None:
            return ("ack", version, self.reader.holding())
        return ("error", version, error)

    async def reply(self, version: int, error: str | None = None) -> None:
        await self._channel.send(self._reply(version, error))

    def try_reply(self, version: int, error: str | None = None) -> bool:
        reply = self._reply(version, error)
        if error is not None:
            return self._channel.try_send(reply)
        return self._channel.try_send_framed(self._acks.encoded(reply))

    def wait_ready(self, timeout: float) -> bool:
        return self._channel.wait_ready(timeout)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.reader.close()
        self._channel.close()
