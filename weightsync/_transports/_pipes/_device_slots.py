"""The sender's GPU memory for workers on GPUs: one slab they copy out of
(the multiprocess and in-process schemes), or versioned slots that workers
on the slab's GPU run on (the shared scheme).

Both stage a send with one device-to-device copy on the trainer's stream
(``_slab.DeviceSlab.write``) and hand each worker a ``SlabRef``. A slot is
rewritten only once no worker may be reading it, the same rule and the same
bookkeeping as the shared scheme's host slots (``_slot_ledger.SlotLedger``):
not while a worker was told about it and has not answered, nor while a
worker's ack names it as what its tensors run on. Each ref of a slot lists
the slots the sender keeps (``SlabRef.live``), so a worker lets go of the
others and the trainer's GPU memory comes back.
"""

from __future__ import annotations

import torch

from ..._memory._placement import gpu_stream
from ..._memory._slab import DeviceSlab, SlabRef
from ..._memory._views import LayoutViews
from ..._packet import Manifest, Packet
from .._base import EVERY_VERSION
from ._slot_ledger import SlotLedger

__all__ = ["DeviceSlots", "OneSlab"]


class OneSlab:
    """One slab per trainer GPU, rewritten at every send; workers copy out
    of it before they ack, so nothing else is needed."""

    def __init__(self) -> None:
        self.current: DeviceSlab | None = None
        self._views = LayoutViews()

    def write(self, packet: Packet) -> None:
        """Copy ``packet`` into the slab (made or grown first) on the
        trainer's stream and publish it; blocks for the copy."""
        manifest = packet.manifest
        device = packet.tensors[0].device
        slab = self.current
        if slab is None or slab.nbytes < manifest.nbytes or slab.device != device:
            self._views.forget()
            if slab is not None:
                slab.close()
                self.current = None
            slab = self.current = DeviceSlab(manifest.nbytes, device)
        assert slab.data is not None
        views = self._views.of(slab.token, manifest, slab.data)
        slab.write(views, packet.tensors, packet.version, gpu_stream(packet.stream, slab.device))

    def descriptor(self, worker_id: int) -> SlabRef:
        assert self.current is not None, "write() comes first"
        return self.current.ref(worker_id)

    def released(self, worker_id: int, version: int, holding: object) -> None:
        if version == EVERY_VERSION and self.current is not None:
            self.current.forget(worker_id)

    def forget(self, worker_id: int) -> None:
        """Worker ``worker_id`` is a new process: it opens the slab anew."""
        if self.current is not None:
            self.current.forget(worker_id)

    def close(self) -> None:
        self._views.forget()
        if self.current is not None:
            self.current.close()
            self.current = None


class DeviceSlots:
    """Slots on the trainer's GPU; each send is written into one that no
    worker may be reading (see the module's docstring)."""

    def __init__(self) -> None:
        self.slots: list[DeviceSlab] = []
        self.current: DeviceSlab | None = None
        self._version = 0
        self._views = LayoutViews()
        self._ledger = SlotLedger()

    def _choose(self, manifest: Manifest, device: torch.device) -> DeviceSlab:
        busy = self._ledger.busy()
        for slot in self.slots:
            if slot.token not in busy and slot.nbytes >= manifest.nbytes and slot.device == device:
                return slot
        for slot in [s for s in self.slots if s.token not in busy]:
            # Idle, and too small or on another GPU: never used again. Its
            # memory comes back once every worker that opened it let go
            # (each is told at its next update: SlabRef.live).
            self._drop(slot)
        slot = DeviceSlab(manifest.nbytes, device)
        self.slots.append(slot)
        return slot

    def _drop(self, slot: DeviceSlab) -> None:
        self.slots.remove(slot)
        self._views.forget(slot.token)
        if slot is self.current:
            self.current = None
        slot.close()

    def write(self, packet: Packet) -> None:
        """Copy ``packet`` into a free slot on the trainer's stream and
        publish it there; blocks for the copy.

        :raises ResourceExhaustedError: no slot is free and the GPU has no
            room for another.
        """
        slot = self._choose(packet.manifest, packet.tensors[0].device)
        assert slot.data is not None
        views = self._views.of(slot.token, packet.manifest, slot.data)
        slot.write(views, packet.tensors, packet.version, gpu_stream(packet.stream, slot.device))
        self.current, self._version = slot, packet.version

    def descriptor(self, worker_id: int) -> SlabRef:
        assert self.current is not None, "write() comes first"
        self._ledger.told(worker_id, self.current.token, self._version)
        return self.current.ref(worker_id)._replace(live=tuple(s.token for s in self.slots))

    def released(self, worker_id: int, version: int, holding: object) -> None:
        self._ledger.released(worker_id, version, holding)
        if version == EVERY_VERSION:
            self.forget(worker_id)

    def forget(self, worker_id: int) -> None:
        """Worker ``worker_id`` is a new process: it opens the slots anew."""
        for slot in self.slots:
            slot.forget(worker_id)

    def close(self) -> None:
        self._views.forget()
        self.current = None
        slots, self.slots = self.slots, []
        for slot in slots:
            slot.close()
