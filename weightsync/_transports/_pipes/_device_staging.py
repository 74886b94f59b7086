"""Staging by placement: GPU memory for workers on GPUs, host memory for
the others.

A trainer on a GPU stages each send once on its GPU (one device-to-device
copy, enqueued on the trainer's stream) for the workers whose models are on
GPUs, and into the scheme's host staging (page-locked, one device-to-host
copy) only where a worker's model is in host memory; a host staging that no
worker reads is not written. Its GPU memory (``_device_slots``) is one slab
that each worker on a GPU copies out of into its own tensors (device to
device, or GPU to GPU), which keep their device and ``data_ptr()``; or,
under the shared scheme, versioned slots: a worker whose parameters are on
the slots' GPU runs on a slot (its parameters re-pointed to it, no byte
copied), the others copy.

A verified send (digests) and a trainer in host memory go through the host
staging alone: digests are taken of host bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ..._exceptions import out_of_resources
from ..._memory._placement import Placement, current_stream
from ..._memory._slab import AttachedSlabs, DeviceSlab, SlabRef, copy_on_stream
from ..._packet import Manifest, Packet
from .._base import Staging, StagingReader
from ._device_slots import DeviceSlots, OneSlab

__all__ = ["DeviceReader", "PlacedReader", "PlacedStaging"]


class PlacedStaging:
    """A scheme's host staging (segment or slots), and GPU memory for the
    workers on GPUs of a trainer on a GPU: one slab, or with
    ``device_slots`` versioned slots that workers on their GPU run on."""

    def __init__(self, host: Staging, *, device_slots: bool = False) -> None:
        self.host = host
        self.device: OneSlab | DeviceSlots = DeviceSlots() if device_slots else OneSlab()
        # The workers told the GPU memory for the send staged last.
        self._via_slab: frozenset[int] = frozenset()

    @property
    def slab(self) -> DeviceSlab | None:
        """The slab or slot the last send to workers on GPUs was staged in."""
        return self.device.current

    def placed(self, worker_id: int, devices: tuple[str, ...] | None, reach: tuple[str, ...] = ()) -> None:
        """Worker ``worker_id`` (a new process) announced its model on
        ``devices``: what the GPU memory held for its predecessor is let go."""
        self.device.forget(worker_id)

    def write(
        self, packet: Packet, digest: bool, placements: Mapping[int, Placement]
    ) -> tuple[int, ...] | None:
        """Stage on the trainer's GPU for the workers that read it there
        (their placement is on the device), and in the host staging only
        where a worker of the send reads host memory."""
        via = frozenset(w for w, p in placements.items() if p.on_device)
        sums = self.host.write(packet, digest, placements) if len(via) < len(placements) else None
        if via:
            self.device.write(packet)
        self._via_slab = via
        return sums

    def descriptor(self, worker_id: int) -> Any:
        if worker_id in self._via_slab:
            return self.device.descriptor(worker_id)
        return self.host.descriptor(worker_id)

    def released(self, worker_id: int, version: int, holding: Any) -> None:
        # (``holding`` names host slots and device slots alike, by token:
        # each side looks for its own.)
        self.host.released(worker_id, version, holding)
        self.device.released(worker_id, version, holding)

    async def aclose(self) -> None:
        self._via_slab = frozenset()
        self.device.close()
        await self.host.aclose()


class DeviceReader:
    """A worker's side of the sender's GPU memory. From a slab, or a slot
    on another GPU, it copies into its model's tensors on their GPUs, on
    the worker's current stream, and waits for the copy before the version
    is checked again (and before the ack). On a slot of its parameters' own
    GPU, it re-points them to the slot (``tensor.data = view``), then waits
    for its current stream, so that whatever it enqueued on the slot it
    leaves is done before its ack lets the sender rewrite that slot."""

    checked_on_host = False

    def __init__(self) -> None:
        self._slabs = AttachedSlabs()
        # The tensors re-pointed to a slot: id -> (the tensor, the slot's token).
        self._on: dict[int, tuple[weakref.ref[torch.Tensor], bytes]] = {}

    def is_current(self, descriptor: SlabRef, version: int) -> bool:
        return self._slabs.published(descriptor) == version

    def sources(self, descriptor: SlabRef, manifest: Manifest) -> list[torch.Tensor]:
        return self._slabs.views(descriptor, manifest)

    def check(self, descriptor: SlabRef, version: int, manifest: Manifest) -> str | None:
        return None

    def apply(
        self, descriptor: SlabRef, model: Any, targets: list[torch.Tensor], manifest: Manifest, threads: int
    ) -> None:
        if descriptor.live is not None:
            self._slabs.retain(descriptor.live)
        sources = self._slabs.views(descriptor, manifest)
        slab_device = sources[0].device if sources else None
        share = [
            descriptor.live is not None
            and t.device == slab_device
            and (isinstance(t, torch.nn.Parameter) or not isinstance(model, torch.nn.Module))
            for t in targets
        ]
        # A module's buffers are copied into the worker's own memory: worker
        # code writes into them (BatchNorm statistics), and a slot is shared
        # by every worker on its GPU.
        copies = [(t, s) for t, s, shared in zip(targets, sources, share, strict=True) if not shared]
        if copies:
            self.own([t for t, _ in copies])
            # The worker's stream on its model's GPU: the copy waits for the
            # work the worker enqueued before (a forward pass reading these
            # weights), and the update is whole once it returns.
            # (A worker told the GPU memory has its model on a GPU.)
            stream = current_stream(copies[0][0].device.index)
            copy_on_stream([t for t, _ in copies], [s for _, s in copies], stream)
        if any(share):
            assert slab_device is not None
            for target, source, shared in zip(targets, sources, share, strict=True):
                if shared:
                    target.data = source
                    self._on[id(target)] = (weakref.ref(target), descriptor.token)
            # What the worker enqueued before on the slot it leaves is done
            # before the ack frees that slot.
            current_stream(slab_device.index).synchronize()

    def own(self, targets: list[torch.Tensor]) -> None:
        """Give each of ``targets`` that runs on a slot memory of its own,
        holding what it holds now, so that a copy into it never writes a
        slot other workers run on. Every copy is made before any tensor
        changes, so a worker out of GPU memory keeps its model as it was.

        :raises ResourceExhaustedError: no GPU memory for the copies.
        """
        if not self._on:
            return  # (the common case: nothing runs on a slot)
        moving = [t for t in targets if id(t) in self._on]
        if not moving:
            return
        with out_of_resources("give the worker's tensors on its GPU memory of their own"):
            fresh = [t.detach().clone() for t in moving]  # (on the current stream)
        for target, mine in zip(moving, fresh, strict=True):
            target.data = mine
            del self._on[id(target)]

    def keep_own(self) -> None:
        """Copy every tensor that runs on a slot into the worker's own
        memory and let go of the sender's GPU memory: the sender is going,
        and its memory lives only as long as the trainer's process does
        (CUDA IPC), which frees it once every worker let go. Waits for the
        copies."""
        on, self._on = self._on, {}
        devices: set[torch.device] = set()
        for ref, _token in on.values():
            target = ref()
            if target is not None:
                with torch.cuda.device(target.device):
                    target.data = target.data.clone()  # (on the current stream)
                devices.add(target.device)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        self._slabs.close()

    def holding(self) -> frozenset[bytes] | None:
        """The slots this worker's tensors run on (None: none)."""
        if not self._on:
            return None  # (the common case: nothing runs on a slot)
        return frozenset(token for ref, token in self._on.values() if ref() is not None) or None

    def close(self) -> None:
        self.keep_own()


class PlacedReader:
    """A worker's reader for a :class:`PlacedStaging`: the slab's reader for
    an update staged on a GPU, the host staging's otherwise."""

    def __init__(self, host: StagingReader) -> None:
        self.host = host
        self.device = DeviceReader()
        # (A verified send is staged in host memory only: see PlacedStaging.)
        self.checked_on_host = host.checked_on_host

    def _of(self, descriptor: Any) -> StagingReader:
        return self.device if isinstance(descriptor, SlabRef) else self.host

    def is_current(self, descriptor: Any, version: int) -> bool:
        return self._of(descriptor).is_current(descriptor, version)

    def sources(self, descriptor: Any, manifest: Manifest) -> list[torch.Tensor]:
        return self._of(descriptor).sources(descriptor, manifest)

    def check(self, descriptor: Any, version: int, manifest: Manifest) -> str | None:
        return self._of(descriptor).check(descriptor, version, manifest)

    def apply(
        self, descriptor: Any, model: Any, targets: list[torch.Tensor], manifest: Manifest, threads: int
    ) -> None:
        reader = self._of(descriptor)
        if reader is self.host:
            # The host staging's reader copies into tensors on GPUs: those
            # running on a device slot get memory of their own first.
            self.device.own(targets)
        reader.apply(descriptor, model, targets, manifest, threads)

    def holding(self) -> Any:
        # Host slots and device slots, by token (see PlacedStaging.released).
        host, device = self.host.holding(), self.device.holding()
        if host is None or device is None:
            return host if device is None else device
        return frozenset(host) | device

    def keep_own(self) -> None:
        self.device.keep_own()
        self.host.keep_own()

    def close(self) -> None:
        self.device.close()
        self.host.close()
