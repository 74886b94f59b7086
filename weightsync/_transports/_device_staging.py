"""Staging by placement: a device slab for workers on GPUs, host memory for
the others.

A trainer on a GPU stages each send once into a slab on its GPU
(``_slab.DeviceSlab``: one device-to-device copy, enqueued on the trainer's
stream) for the workers whose models are on GPUs, and into the scheme's host
staging (page-locked, one device-to-host copy) only where a worker's model
is in host memory; a host staging that no worker reads is not written. Each
worker on a GPU copies from the slab into its own tensors (device to device,
or GPU to GPU), so its parameters keep their device and ``data_ptr()``.

A verified send (digests) and a trainer in host memory go through the host
staging alone: digests are taken of host bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from .._offload import run_blocking
from .._packet import Manifest, Packet
from .._placement import Placement, choose, gpu_stream
from .._slab import AttachedSlabs, DeviceSlab, SlabRef, copy_on_stream, local_index
from ._base import EVERY_VERSION, LoopFreeStaging, StagingReader

__all__ = ["DeviceReader", "PlacedReader", "PlacedStaging"]

_ON_DEVICE = (Placement.SAME_DEVICE, Placement.PEER)


class PlacedStaging:
    """A scheme's host staging (segment or slots), and a device slab for the
    workers on GPUs of a trainer on a GPU."""

    def __init__(self, host: LoopFreeStaging) -> None:
        self.host = host
        self.slab: DeviceSlab | None = None
        self._views: tuple[str, list[torch.Tensor]] | None = None
        # The devices each worker announced (None: it did not say).
        self._devices: dict[int, tuple[str, ...] | None] = {}
        # The workers told the slab for the send staged last.
        self._via_slab: frozenset[int] = frozenset()

    def placed(self, worker_id: int, devices: tuple[str, ...] | None) -> None:
        """Worker ``worker_id`` (a new process) announced its model on ``devices``."""
        self._devices[worker_id] = devices
        if self.slab is not None:
            self.slab.forget(worker_id)

    def _split(self, packet: Packet, digest: bool) -> tuple[frozenset[int], bool]:
        """The workers this packet reaches through the slab, and whether any
        other worker needs the host staging."""
        if digest or len(packet.devices) != 1 or not packet.devices[0].startswith("cuda:"):
            return frozenset(), True
        via = frozenset(w for w, d in self._devices.items() if choose(packet.devices, d) in _ON_DEVICE)
        return via, len(via) < len(self._devices) or not self._devices

    def _slab_for(self, packet: Packet) -> tuple[DeviceSlab, list[torch.Tensor]]:
        manifest = packet.manifest
        device = packet.tensors[0].device
        if self.slab is None or self.slab.nbytes < manifest.nbytes or self.slab.device != device:
            self._views = None
            if self.slab is not None:
                self.slab.close()
                self.slab = None
            self.slab = DeviceSlab(manifest.nbytes, device)
        if self._views is None or self._views[0] != manifest.layout_id:
            assert self.slab.data is not None
            self._views = (manifest.layout_id, manifest.views(self.slab.data))
        return self.slab, self._views[1]

    def _write_slab(self, packet: Packet) -> None:
        slab, views = self._slab_for(packet)
        slab.write(views, packet.tensors, packet.version, gpu_stream(packet, slab.device))

    async def stage(self, packet: Packet, digest: bool = False) -> tuple[int, ...] | None:
        via, host = self._split(packet, digest)
        sums = await self.host.stage(packet, digest) if host else None
        if via:
            await run_blocking(packet.nbytes, self._write_slab, packet)
        self._via_slab = via
        return sums

    def stage_now(self, packet: Packet) -> None:
        """:meth:`stage` with no digests, on the calling thread (it blocks for the copies)."""
        via, host = self._split(packet, False)
        if host:
            self.host.stage_now(packet)
        if via:
            self._write_slab(packet)
        self._via_slab = via

    def descriptor(self, worker_id: int) -> Any:
        if worker_id in self._via_slab:
            assert self.slab is not None
            return self.slab.ref(worker_id)
        return self.host.descriptor(worker_id)

    def released(self, worker_id: int, version: int, holding: Any) -> None:
        self.host.released(worker_id, version, holding)
        if version == EVERY_VERSION:
            self._devices.pop(worker_id, None)  # gone: it needs no staging any more
            if self.slab is not None:
                self.slab.forget(worker_id)

    async def aclose(self) -> None:
        self._views = None
        self._via_slab = frozenset()
        if self.slab is not None:
            self.slab.close()
            self.slab = None
        await self.host.aclose()


class DeviceReader:
    """A worker's side of a device slab: copies out of it into its model's
    tensors on GPUs, on the worker's current stream, and waits for the
    copy before the version is checked again (and before the ack)."""

    checked_on_host = False

    def __init__(self) -> None:
        self._slabs = AttachedSlabs()

    def is_current(self, descriptor: SlabRef, version: int) -> bool:
        return self._slabs.published(descriptor) == version

    def sources(self, descriptor: SlabRef, manifest: Manifest) -> list[torch.Tensor]:
        return self._slabs.views(descriptor, manifest)

    def check(self, descriptor: SlabRef, version: int, manifest: Manifest) -> str | None:
        return None

    def apply(
        self, descriptor: SlabRef, model: Any, targets: list[torch.Tensor], manifest: Manifest, threads: int
    ) -> None:
        sources = self._slabs.views(descriptor, manifest)
        # The worker's stream on its model's GPU: the copy waits for the
        # work the worker enqueued before (a forward pass reading these
        # weights), and the update is whole once it returns.
        device = next((t.device for t in targets if t.is_cuda), None)
        index = (
            device.index
            if device is not None and device.index is not None
            else local_index(descriptor.device)
        )
        copy_on_stream(targets, sources, torch.cuda.current_stream(index))

    def holding(self) -> None:
        return None

    def close(self) -> None:
        self._slabs.close()


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
        self._of(descriptor).apply(descriptor, model, targets, manifest, threads)

    def holding(self) -> Any:
        return self.host.holding()

    def close(self) -> None:
        self.device.close()
        self.host.close()
