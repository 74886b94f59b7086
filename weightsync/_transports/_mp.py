"""The multiprocess transport: control over pipes, bytes through one staging segment.

Per send the sender writes the packet's bytes once into a shared staging
segment (:class:`StagingArea`), then tells each worker over its pipe which
version is there. A worker copies the bytes into its own model when it calls
``receive()`` and acks the version. The segment's header says which version it
holds; a worker checks it before and after its copy, so a copy that raced with
the next send (only possible for a worker that missed a deadline) is detected
and redone from the newer version, never kept.

Messages (pickled tuples, small):

    worker -> sender   ("hello", model_id, pid, signature)
                       ("ack", version)
                       ("error", version, message)
    sender -> worker   ("update", version, layout_id, descriptor, copy_threads)
                       ("close",)

The descriptor ``("segment", pid, fd, nbytes, token)`` names the staging
segment; it rides along only on the first update a worker gets from a segment.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

import anyio
import torch

from .._exceptions import SenderLostError, WorkerLostError
from .._packet import Manifest, Packet, copy_tensors, usable_cores
from .._segment import Segment
from ._base import Update, caller_is_blocked, worker_failed, worker_lost
from ._pipe import PipeChannel

__all__ = ["MPReceiverTransport", "MPSenderTransport", "StagingArea", "write_packet"]

# Below this size the copy into staging runs inline: a thread hop would cost
# more than the copy. Above it the copy runs in a worker thread so an event
# loop shared with other tasks stays responsive (not needed on a private loop
# whose caller is blocked anyway).
_INLINE_COPY_BYTES = 1 << 20


def _write(segment: Segment, views: list[torch.Tensor], packet: Packet) -> None:
    segment.begin_write()
    # Workers read only once this is published: all cores are ours meanwhile.
    copy_tensors(views, packet.tensors, threads=usable_cores())
    segment.publish(packet.version)


async def write_packet(segment: Segment, views: list[torch.Tensor], packet: Packet) -> None:
    """Write ``packet``'s bytes into ``views`` of ``segment`` and publish its
    version in the segment's header."""
    if packet.nbytes <= _INLINE_COPY_BYTES or caller_is_blocked.get():
        _write(segment, views, packet)
    else:
        # Not cancellable mid-copy: an abandoned copy would race the next one.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_write, segment, views, packet)


class StagingArea:
    """The sender's shared staging segment, grown as layouts need."""

    def __init__(self) -> None:
        self.segment: Segment | None = None
        self._views: tuple[str, list[torch.Tensor]] | None = None

    def _ensure(self, manifest: Manifest) -> list[torch.Tensor]:
        if self.segment is None or self.segment.nbytes < manifest.nbytes:
            self._views = None
            if self.segment is not None:
                self.segment.close()
            self.segment = Segment.create(manifest.nbytes)
        if self._views is None or self._views[0] != manifest.layout_id:
            assert self.segment.data is not None
            self._views = (manifest.layout_id, manifest.views(self.segment.data))
        return self._views[1]

    async def stage(self, packet: Packet) -> None:
        views = self._ensure(packet.manifest)
        assert self.segment is not None
        await write_packet(self.segment, views, packet)

    def descriptor(self) -> tuple[str, int, int, int, bytes]:
        assert self.segment is not None
        return ("segment", os.getpid(), self.segment.fd, self.segment.nbytes, self.segment.token)

    async def aclose(self) -> None:
        self._views = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class MPSenderTransport:
    """The sender's channel to one worker process, over the user's pipe."""

    def __init__(self, pipe: Connection, worker_id: int, staging: Any, model_id: str | None) -> None:
        self.worker_id = worker_id
        self.model_id = model_id
        self._staging = staging
        self._channel = PipeChannel(pipe, self._lost)
        self.layout: Manifest | None = None
        self.worker_pid: int | None = None
        self._segment_sent: bytes | None = None
        self._posted = 0
        self._closed = False

    def _lost(self, reason: str) -> WorkerLostError:
        return worker_lost(self.worker_id, self.model_id, reason)

    def _handle_hello(self, message: tuple) -> None:
        _, _model_id, pid, signature = message
        self.worker_pid = pid
        self._channel.watch(pid)
        self.layout = Manifest.from_signature(signature)
        self._segment_sent = None

    async def connect(self) -> Manifest | None:
        while self.layout is None:
            message = await self._channel.recv()
            if message is not None and message[0] == "hello":
                self._handle_hello(message)
        if not self._channel.peer_alive():
            raise self._lost("its process exited")
        return self.layout

    def _update_message(self, packet: Packet) -> tuple[Any, ...]:
        segment = self._staging.segment
        assert segment is not None, "stage() comes before post() and deliver()"
        # The segment's descriptor rides along only when this worker has not
        # seen that segment yet; a routine update is three small fields.
        descriptor = None if self._segment_sent == segment.token else self._staging.descriptor()
        threads = max(1, usable_cores() // packet.fanout)
        return ("update", packet.version, packet.manifest.layout_id, descriptor, threads)

    def _sent(self, packet: Packet) -> None:
        assert self._staging.segment is not None
        self._segment_sent = self._staging.segment.token
        self._posted = packet.version

    def post(self, packet: Packet) -> bool:
        if self._channel.try_send(self._update_message(packet)):
            self._sent(packet)
            return True
        return False

    def _on_ack(self, message: tuple[Any, ...]) -> None:
        """Bookkeeping on every ack, stale or not (a hook for subclasses)."""

    async def deliver(self, packet: Packet) -> None:
        if self._posted != packet.version:
            await self._channel.send(self._update_message(packet))
            self._sent(packet)
        while True:
            message = await self._channel.recv()
            if message is None:
                continue
            kind = message[0]
            if kind == "ack":
                self._on_ack(message)
                if message[1] == packet.version:
                    return
            if kind == "error" and message[1] == packet.version:
                raise worker_failed(self.worker_id, self.model_id, packet.version, message[2])
            if kind == "hello":
                # The worker re-initialised: tell it about the segment again.
                self._handle_hello(message)
                await self._channel.send(self._update_message(packet))
                self._sent(packet)
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


class MPReceiverTransport:
    """A worker's endpoint over its pipe, reading from the sender's staging segment."""

    zero_copy = False
    applies_on_arrival = False

    def __init__(self, pipe: Connection, model_id: str | None) -> None:
        self.model_id = model_id
        self._channel = PipeChannel(pipe, self._lost)
        self._descriptor: tuple[int, int, int, bytes] | None = None
        self._segment: Segment | None = None
        self._views: tuple[bytes, str, list[torch.Tensor]] | None = None
        self._closed = False

    def _lost(self, reason: str) -> SenderLostError:
        return SenderLostError(
            f"the sender of model {self.model_id!r} is gone: {reason}", model_id=self.model_id
        )

    async def announce(self, manifest: Manifest) -> None:
        await self._channel.send(("hello", self.model_id, os.getpid(), manifest.signature))

    def _handle(self, message: tuple, latest: Update | None) -> Update | None:
        kind = message[0]
        if kind == "update":
            _, version, layout_id, descriptor, threads = message
            if descriptor is not None:
                _, pid, fd, nbytes, token = descriptor
                self._descriptor = (pid, fd, nbytes, token)
                self._channel.watch(pid)
            return Update(version, layout_id, threads)
        if kind == "close":
            raise self._lost("it shut down")
        return latest

    def wait_ready(self, timeout: float) -> bool:
        return self._channel.wait_ready(timeout)

    async def next_update(self, timeout: float) -> Update | None:
        latest: Update | None = None
        # Drain what is there: only the newest update can still be read.
        while (message := self._channel.poll()) is not None:
            latest = self._handle(message, latest)
        if latest is not None:
            return latest
        if timeout <= 0:
            return None
        message = await self._channel.recv(timeout)
        if message is None:
            return None
        latest = self._handle(message, latest)

        while (message := self._channel.poll()) is not None:
            latest = self._handle(message, latest)
        return latest

    def _attach(self) -> Segment:
        if self._descriptor is None:
            raise self._lost("it sent an update before its staging segment")
        pid, fd, nbytes, token = self._descriptor
        if self._segment is None or self._segment.token != token:
            if self._segment is not None:
                self._views = None
                self._segment.close()
                self._segment = None
            try:
                self._segment = Segment.attach(pid, fd, nbytes, token)
            except (OSError, ValueError) as exc:
                raise self._lost(f"its staging segment cannot be opened ({exc})") from exc
        return self._segment

    def sources(self, update: Update, manifest: Manifest) -> list[torch.Tensor]:
        segment = self._attach()
        if self._views is None or self._views[:2] != (segment.token, manifest.layout_id):
            assert segment.data is not None
            self._views = (segment.token, manifest.layout_id, manifest.views(segment.data))
        return self._views[2]

    def is_current(self, update: Update) -> bool:
        return self._segment is not None and self._segment.published() == update.version

    async def ack(self, version: int) -> None:
        await self._channel.send(("ack", version))

    async def reject(self, version: int, message: str) -> None:
        await self._channel.send(("error", version, message))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._views = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._channel.close()
