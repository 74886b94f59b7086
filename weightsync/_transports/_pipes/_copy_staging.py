"""Staging in one shared segment that workers copy out of.

Per send the sender writes the packet's bytes once into one shared staging
segment, whatever the number of workers, and tells each worker where it is.
A worker copies the bytes into its own model (every tensor keeps its identity
and ``data_ptr()``) when it applies the update. The segment's header says
which version it holds; the worker checks it before and after its copy, so a
copy that raced with the next send (only possible for a worker that missed a
deadline) is detected and redone from the newer version, never kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..._copy import PlanCache
from ..._memory._pinned import pins
from ..._memory._placement import Placement, devices_of
from ..._memory._segment import AttachedSegments, Segment, SegmentRef
from ..._memory._views import LayoutViews
from ..._packet import Manifest, Packet

__all__ = ["CopyReader", "SegmentStaging"]


class SegmentStaging:
    """The sender's one staging segment, grown as layouts need."""

    def __init__(self) -> None:
        self.segment: Segment | None = None
        self._views = LayoutViews()
        # The devices of the last packet asked whether the segment is pinned for them.
        self._pin_asked: tuple[str, ...] | None = None

    def _ensure(self, packet: Packet) -> tuple[Segment, list[torch.Tensor]]:
        manifest = packet.manifest
        if self.segment is None or self.segment.nbytes < manifest.nbytes:
            self._views.forget()
            if self.segment is not None:
                self.segment.close()
            self.segment = Segment.create(manifest.nbytes)
            self._pin_asked = None
        if packet.devices != self._pin_asked:
            if pins(packet.devices):
                self.segment.pin()  # the device-to-host copy at the bus's speed (once per segment)
            self._pin_asked = packet.devices
        assert self.segment.data is not None
        return self.segment, self._views.of(self.segment.token, manifest, self.segment.data)

    def write(
        self, packet: Packet, digest: bool, placements: Mapping[int, Placement]
    ) -> tuple[int, ...] | None:
        segment, views = self._ensure(packet)
        return segment.write(views, packet, digest)

    def descriptor(self, worker_id: int) -> SegmentRef:
        assert self.segment is not None, "write() comes first"
        return self.segment.ref()

    def released(self, worker_id: int, version: int, holding: Any) -> None:
        """Nothing to do: workers copy out, and a copy that races the next
        send is caught by the version check."""

    async def aclose(self) -> None:
        self._views.forget()
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class CopyReader:
    """A worker's side: copies out of the sender's segment into its model."""

    #: A verified update's bytes are digested by each worker before it
    #: copies them (the segment is rewritten by the next send).
    checked_on_host = False

    def __init__(self) -> None:
        self._segments = AttachedSegments(keep=1)
        # The copy plan of the current (model tensors, source views) pair: made
        # again for new sources, or a tensor of the model re-pointed
        # (``param.data = ...``) to memory of the same shape.
        self._plans = PlanCache()
        # The last plan looked at for a copy to a GPU (see apply).
        self._looked_at: object = None

    def is_current(self, descriptor: SegmentRef, version: int) -> bool:
        return self._segments.holds(descriptor, version)

    def sources(self, descriptor: SegmentRef, manifest: Manifest) -> list[torch.Tensor]:
        return self._segments.views(descriptor, manifest)

    def check(self, descriptor: SegmentRef, version: int, manifest: Manifest) -> str | None:
        return None  # (the bytes themselves are checked)

    def apply(
        self,
        descriptor: SegmentRef,
        model: Any,
        targets: list[torch.Tensor],
        manifest: Manifest,
        threads: int,
    ) -> None:
        plan = self._plans.plan(targets, self._segments.views(descriptor, manifest))
        if plan is not self._looked_at:
            # A new plan (made once per layout and mapping): if it copies to
            # a GPU, page-lock the mapping, for the bus's speed.
            self._looked_at = plan
            if plan.slow_dst and pins(devices_of(plan.slow_dst)):
                self._segments.segment(descriptor).pin()
        plan.run(threads)

    def holding(self) -> None:
        return None

    def keep_own(self) -> None:
        return None  # host memory outlives the sender

    def close(self) -> None:
        self._plans.clear()
        self._looked_at = None
        self._segments.close()
