"""The shared-memory transport: workers run on the weights in shared memory.

The sender keeps several versioned slots (segments). Each send is written
once into a slot that no worker may be reading: not the slot any worker
currently runs on, and not one it was told about and has not yet answered
for. A worker moves to the new slot at ``receive()`` by re-pointing its
tensors (``tensor.data = view``): no byte is copied, every tensor keeps its
identity, and its ``data_ptr()`` changes. Its ack names the slot it moved to,
which frees the slot it left. So nothing a worker reads between two
``receive()`` calls ever changes under it, and at most one slot per worker
(plus one per unanswered update) is in use.

Workers map the slots read-only: a worker whose own code writes into a
re-pointed tensor faults at once instead of corrupting what the other workers
run on. The receiver re-points only a module's parameters; its buffers, which
worker code does write (BatchNorm statistics in train mode), are copied into
the worker's own memory (see ``AsyncWeightReceiver._apply_for``).

Messages: as the multiprocess transport, except that every update carries its
slot's descriptor and every ack its slot's token:

    sender -> worker   ("update", version, layout_id, descriptor, 1)
    worker -> sender   ("ack", version, token)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._packet import Manifest, Packet
from .._segment import Segment
from ._base import Update
from ._mp import MPReceiverTransport, MPSenderTransport, write_packet

__all__ = ["ShmReceiverTransport", "ShmSenderTransport", "SlotStore"]


class SlotStore:
    """The sender's versioned slots; written once per send."""

    def __init__(self) -> None:
        self.slots: list[Segment] = []
        self.channels: list[ShmSenderTransport] = []
        self.current: Segment | None = None
        self._views: dict[tuple[bytes, str], list[torch.Tensor]] = {}

    def _busy(self) -> set[bytes]:
        busy: set[bytes] = set()
        for channel in self.channels:
            busy |= channel.holds()
        return busy

    def _choose(self, manifest: Manifest) -> Segment:
        busy = self._busy()
        for slot in self.slots:
            if slot.token not in busy and slot.nbytes >= manifest.nbytes:
                return slot
        for slot in [s for s in self.slots if s.token not in busy]:
            # Idle but too small for this layout: it will never be used again.
            self.slots.remove(slot)
            self._views = {k: v for k, v in self._views.items() if k[0] != slot.token}
            slot.close()
        slot = Segment.create(manifest.nbytes)
        self.slots.append(slot)
        return slot

    async def stage(self, packet: Packet) -> None:
        slot = self._choose(packet.manifest)
        key = (slot.token, packet.manifest.layout_id)
        views = self._views.get(key)
        if views is None:
            assert slot.data is not None
            views = self._views[key] = packet.manifest.views(slot.data)
        await write_packet(slot, views, packet)
        self.current = slot

    @staticmethod
    def descriptor(slot: Segment) -> tuple[str, int, int, int, bytes]:
        return ("segment", os.getpid(), slot.fd, slot.nbytes, slot.token)

    async def aclose(self) -> None:
        self._views = {}
        self.current = None
        for slot in self.slots:
            slot.close()
        self.slots = []


class ShmSenderTransport(MPSenderTransport):
    """The sender's channel to one worker: which slots it may be reading."""

    def __init__(self, pipe: Any, worker_id: int, store: SlotStore, model_id: str | None) -> None:
        super().__init__(pipe, worker_id, store, model_id)
        self._store = store
        store.channels.append(self)
        self.holding: bytes | None = None
        self._told: dict[bytes, int] = {}  # slot token -> newest version posted in it

    def holds(self) -> set[bytes]:
        """The slots this worker runs on or may move to: not to be written."""
        held = set(self._told)
        if self.holding is not None:
            held.add(self.holding)
        return held

    def _update_message(self, packet: Packet) -> tuple[Any, ...]:
        slot = self._store.current
        assert slot is not None, "stage() comes before post() and deliver()"
        return ("update", packet.version, packet.manifest.layout_id, self._store.descriptor(slot), 1)

    def _sent(self, packet: Packet) -> None:
        assert self._store.current is not None
        self._told[self._store.current.token] = packet.version
        self._posted = packet.version

    def _on_ack(self, message: tuple[Any, ...]) -> None:
        _, version, token = message
        self.holding = token
        # Updates up to this version are answered: the worker is past them.
        self._told = {t: v for t, v in self._told.items() if v > version}

    def _handle_hello(self, message: tuple) -> None:
        super()._handle_hello(message)
        self.holding = None  # a fresh worker runs on its own memory


class ShmReceiverTransport(MPReceiverTransport):
    """A worker's endpoint: maps the sender's slots read-only, one per token."""

    zero_copy = True
    applies_on_arrival = False

    def __init__(self, pipe: Any, model_id: str | None) -> None:
        super().__init__(pipe, model_id)
        self._slots: dict[bytes, Segment] = {}
        self._slot_views: dict[tuple[bytes, str], list[torch.Tensor]] = {}

    def _attach(self) -> Segment:
        if self._descriptor is None:
            raise self._lost("it sent an update without its slot")
        pid, fd, nbytes, token = self._descriptor
        slot = self._slots.get(token)
        if slot is None:
            try:
                slot = self._slots[token] = Segment.attach(pid, fd, nbytes, token)
            except (OSError, ValueError) as exc:
                raise self._lost(f"its slot cannot be opened ({exc})") from exc
        self._segment = slot
        return slot

    def sources(self, update: Update, manifest: Manifest) -> list[torch.Tensor]:
        slot = self._attach()
        key = (slot.token, manifest.layout_id)
        views = self._slot_views.get(key)
        if views is None:
            assert slot.data is not None
            views = self._slot_views[key] = manifest.views(slot.data)
        return views

    async def ack(self, version: int) -> None:
        assert self._segment is not None
        await self._channel.send(("ack", version, self._segment.token))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The model may still run on these views: a slot's mapping goes away
        # when the last tensor on it does.
        self._slot_views = {}
        self._segment = None
        for slot in self._slots.values():
            slot.close()
        self._slots = {}
        self._channel.close()
