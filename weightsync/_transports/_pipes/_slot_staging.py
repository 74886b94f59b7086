"""Staging in versioned slots that workers run on directly (zero-copy).

The sender keeps several slots (segments). Each send is written once into a
slot that no worker may be reading: not the slot any worker currently runs
on, and not one it was told about and has not yet answered for. A worker
moves to the new slot by re-pointing its tensors (``tensor.data = view``): no
byte is copied, every tensor keeps its identity, and its ``data_ptr()``
changes. Its ack names the slot it moved to, which frees the slot it left. So
nothing a worker reads between two updates ever changes under it, and at most
one slot per worker (plus one per unanswered update) is in use.

Workers map the slots read-only: a worker whose own code writes into a
re-pointed tensor faults at once instead of corrupting what the other workers
run on. Only a module's parameters are re-pointed; its buffers, which worker
code does write (BatchNorm statistics in train mode), are copied into the
worker's own memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..._copy import CopyPlan
from ..._exceptions import InvalidWeightsError
from ..._memory._pinned import pins
from ..._memory._placement import Placement, devices_of
from ..._memory._segment import AttachedSegments, Segment, SegmentRef
from ..._memory._views import LayoutViews
from ..._packet import Manifest, Packet
from ._slot_ledger import SlotLedger

__all__ = ["SlotReader", "SlotStaging"]


class SlotStaging:
    """The sender's versioned slots; each send is written into a free one."""

    def __init__(self) -> None:
        self.slots: list[Segment] = []
        self.current: Segment | None = None
        self._version = 0
        self._views = LayoutViews()
        self._ledger = SlotLedger()
        #: Testing hook: called with (tensor index, first byte) between the
        #: copy of a block and its check, when a send is verified.
        self.after_copy: Callable[[int, int], None] | None = None
        # Slots being made writable again, by token.
        self._unprotecting: dict[bytes, threading.Thread] = {}

    def _choose(self, manifest: Manifest) -> Segment:
        busy = self._ledger.busy()
        for slot in self.slots:
            if slot.token not in busy and slot.nbytes >= manifest.nbytes:
                return slot
        for slot in [s for s in self.slots if s.token not in busy]:
            # Idle but too small for this layout: it will never be used again.
            self.slots.remove(slot)
            self._views.forget(slot.token)
            self._settled(slot).close()
        slot = Segment.create(manifest.nbytes)
        self.slots.append(slot)
        return slot

    def write(
        self, packet: Packet, digest: bool, placements: Mapping[int, Placement]
    ) -> tuple[int, ...] | None:
        """Write ``packet`` into a free slot and publish it.

        With ``digest`` the bytes are checked once for the whole host, here:
        each block of the slot right after it is written, against the
        source's block; the slot is then read-only in this process too
        (mprotect), until no worker holds it any more. The workers run on
        these very bytes, which nothing can write now, so each of them only
        checks that it maps the slot it was told (:meth:`SlotReader.check`).

        :raises InvalidWeightsError: a block of the slot differs from its
            source (the slot is not published; nothing was sent).
        """
        slot, views = self._writable_slot(packet.manifest, packet.devices)
        sums: tuple[int, ...] | None = None
        if digest:
            sums, bad = slot.write_checked(views, packet, self.after_copy)
            if bad:
                names = ", ".join(packet.manifest.names[i] for i in bad)
                raise InvalidWeightsError(
                    f"version {packet.version} failed its integrity check on the trainer: the bytes "
                    f"staged for {names} differ from the weights sent; nothing was sent"
                )
            # Checked and published: nothing in this process may write it now.
            slot.protect(writable=False)
        else:
            slot.write(views, packet, False)
        self.current, self._version = slot, packet.version
        return sums

    def _writable_slot(
        self, manifest: Manifest, devices: tuple[str, ...]
    ) -> tuple[Segment, list[torch.Tensor]]:
        """A free slot for ``manifest`` (of tensors on ``devices``), writable, and its views."""
        slot = self._choose(manifest)
        if pins(devices):
            slot.pin()  # the device-to-host copy at the bus's speed (once per slot)
        assert slot.data is not None
        views = self._views.of(slot.token, manifest, slot.data)
        self._settled(slot).protect(writable=True)  # (most often made so once free: released())
        return slot, views

    def descriptor(self, worker_id: int) -> SegmentRef:
        assert self.current is not None, "write() comes first"
        self._ledger.told(worker_id, self.current.token, self._version)
        return self.current.ref()

    def released(self, worker_id: int, version: int, holding: Any) -> None:
        self._ledger.released(worker_id, version, holding)
        # A checked slot that no worker holds or was told about any more
        # will only be rewritten: it is made writable now, on a thread of
        # its own, rather than when the next send stages (mprotect takes
        # about 12 ms for 512 MiB on the project's machine).
        busy = self._ledger.busy()
        for slot in self.slots:
            if (
                slot.protected
                and slot.token not in busy
                and slot is not self.current
                and slot.token not in self._unprotecting
            ):
                thread = threading.Thread(
                    target=slot.protect, args=(True,), name="weightsync-mprotect", daemon=True
                )
                thread.start()
                self._unprotecting[slot.token] = thread

    def _settled(self, slot: Segment) -> Segment:
        """``slot``, once a change of its protection under way has ended."""
        thread = self._unprotecting.pop(slot.token, None)
        if thread is not None:
            thread.join()
        return slot

    async def aclose(self) -> None:
        self._views.forget()
        self.current = None
        for slot in self.slots:
            self._settled(slot).close()
        self.slots = []


class SlotReader:
    """A worker's side: maps the sender's slots read-only and re-points its
    model's parameters to the slot of each update."""

    #: A verified update's bytes were checked on the trainer (see
    #: :meth:`SlotStaging.stage`): a worker checks the slot it maps instead.
    checked_on_host = True

    def __init__(self) -> None:
        self._segments = AttachedSegments(keep=None)
        # The slot each re-pointed tensor runs on (by the tensor's id).
        self._on: dict[int, bytes] = {}

    def is_current(self, descriptor: SegmentRef, version: int) -> bool:
        return self._segments.holds(descriptor, version)

    def sources(self, descriptor: SegmentRef, manifest: Manifest) -> list[torch.Tensor]:
        return self._segments.views(descriptor, manifest)

    def check(self, descriptor: SegmentRef, version: int, manifest: Manifest) -> str | None:
        """Why the slot this worker maps is not the one it was told (None:
        it is): its token, the version it holds, the room for ``manifest``'s
        offsets. Reads no data byte.

        :raises OSError: the slot cannot be mapped (the sender is gone).
        """
        segment = self._segments.segment(descriptor)
        if segment.token != descriptor.token:
            return "the slot mapped is not the one the sender named"
        published = segment.published()
        if published != version:
            return f"the slot holds version {published}, not {version}"
        end = max((spec.offset + spec.nbytes for spec in manifest.specs), default=0)
        if end > segment.nbytes:
            return f"the layout needs {end} bytes, the slot has {segment.nbytes}"
        return None

    def apply(
        self,
        descriptor: SegmentRef,
        model: Any,
        targets: list[torch.Tensor],
        manifest: Manifest,
        threads: int,
    ) -> None:
        sources = self._segments.views(descriptor, manifest)
        # A module's buffers (BatchNorm statistics, counters) are copied into
        # the worker's own memory: worker code writes into them (a forward
        # pass in train mode), and the slots are read-only. So is every
        # tensor that is not in host memory (a model on a GPU): re-pointing
        # it to a slot would move it to the host, and a worker's tensors
        # never change device.
        if isinstance(model, torch.nn.Module):
            own = [not isinstance(t, torch.nn.Parameter) or not t.is_cpu for t in targets]
        else:
            own = [not t.is_cpu for t in targets]
        if any(own):
            if pins(devices_of(t for t, o in zip(targets, own, strict=True) if o)):
                # Tensors on a GPU: the host-to-device copy at the bus's speed
                # (the slot's mapping is registered once).
                self._segments.segment(descriptor).pin()
            CopyPlan(
                [t for t, o in zip(targets, own, strict=True) if o],
                [s for s, o in zip(sources, own, strict=True) if o],
            ).run(threads)
        # The sender leaves this slot unchanged until we ack a newer version:
        # re-pointing is the update, no byte copied.
        for target, source, o in zip(targets, sources, own, strict=True):
            if not o:
                target.data = source
                self._on[id(target)] = descriptor.token

    def holding(self) -> frozenset[bytes] | None:
        """The slots this worker's tensors run on (None: none yet)."""
        return frozenset(self._on.values()) or None

    def keep_own(self) -> None:
        return None  # host memory outlives the sender

    def close(self) -> None:
        # The model may still run on these views: a slot stays mapped until
        # the last tensor on it goes (see Segment.close).
        self._segments.close()
