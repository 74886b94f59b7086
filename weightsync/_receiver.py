"""The async receiver: validate, apply atomically, ack."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import torch

from ._exceptions import SenderLostError, WeightMismatchError, WeightSyncStateError
from ._packet import CopyPlan, Manifest
from ._strategy import model_tensors
from ._transports._base import ReceiverTransport, Update

__all__ = ["AsyncWeightReceiver"]

# After a copy raced with the sender's next write (only a worker that missed a
# deadline can see that), the receiver waits this long for the newer version
# before giving up, so it never returns with a mix of two versions.
_RECOVERY_TIMEOUT = 60.0


class AsyncWeightReceiver:
    """Applies updates of one model on a worker, as coroutines.

    Created by a scheme's ``init_on_receiver``; get it with
    ``scheme.get_async_receiver()``.
    """

    def __init__(self, *, model_id: str | None, model: Any, transport: ReceiverTransport) -> None:
        self.model_id = model_id
        self.model = model
        self.transport = transport
        self.version = 0
        self._layout: tuple[str, Manifest, list[torch.Tensor]] | None = None
        # The copy plan for the current (model tensors, source views) pair;
        # both lists are cached objects, so identity tells when to redo it.
        self._plan: tuple[list[torch.Tensor], list[torch.Tensor], CopyPlan] | None = None
        self._closed = False
        self._announced = False
        # Updates applied so far, and how many of them receive() reported
        # (push transports only; versions restart with a new sender).
        self._applied = 0
        self._reported = 0

    def _manifest(self) -> tuple[Manifest, list[torch.Tensor]]:
        tensors = model_tensors(self.model, model_id=self.model_id)
        manifest = Manifest.of(tensors)
        return manifest, manifest.ordered(tensors)

    def manifest(self) -> Manifest:
        """The layout of the model as it is now."""
        return self._manifest()[0]

    async def announce(self) -> None:
        """Tell the sender this worker exists and what its model looks like."""
        manifest, _ = self._manifest()
        await self.transport.announce(manifest)
        self._announced = True

    def _layout_for(self, update: Update) -> tuple[str, Manifest, list[torch.Tensor]]:
        """The model's tensors in the update's layout, checked before any write.

        Looked up once per layout: replacing a parameter object of the model
        (instead of writing into it) needs a new ``init_on_receiver``.
        """
        if self._layout is not None and self._layout[0] == update.layout_id:
            return self._layout
        manifest, targets = self._manifest()
        if manifest.layout_id != update.layout_id:
            raise WeightMismatchError(
                f"version {update.version} has layout {update.layout_id}, but this worker's model "
                f"has layout {manifest.layout_id} (names, shapes or dtypes changed since init)",
                model_id=self.model_id,
            )
        for spec, tensor in zip(manifest.specs, targets, strict=True):
            if tensor.layout != torch.strided or torch._debug_has_internal_overlap(tensor) == 1:
                raise WeightMismatchError(
                    f"{spec.name!r} cannot be written in place: its elements overlap in memory "
                    "(an expanded or broadcast tensor)",
                    model_id=self.model_id,
                )
        self._layout = (manifest.layout_id, manifest, targets)
        return self._layout

    def _targets_and_sources(self, update: Update) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The model's tensors and the update's, pairwise of the same shape
        and dtype.

        :raises WeightMismatchError: the update does not fit the model.
        """
        _, manifest, targets = self._layout_for(update)
        sources = self.transport.sources(update, manifest)
        if any(t.shape != s.shape or t.dtype != s.dtype for t, s in zip(targets, sources, strict=True)):
            # A tensor of the model was re-pointed to another shape since the
            # layout was cached: look the model up again (this raises).
            self._layout = None
            _, manifest, targets = self._layout_for(update)
            sources = self.transport.sources(update, manifest)
        return targets, sources

    def _apply_for(self, update: Update) -> Callable[[int], None]:
        """How to apply ``update`` (given a number of copy threads), checked
        against the model before anything is written.

        :raises WeightMismatchError: the update does not fit the model.
        """
        targets, sources = self._targets_and_sources(update)
        if not self.transport.zero_copy:
            return self._plan_for(targets, sources).run
        # A module's buffers (BatchNorm statistics, counters) are copied into
        # the worker's own memory instead: worker code writes into them (a
        # forward pass in train mode), and the shared memory is read-only.
        # Everything else is re-pointed to the shared memory.
        if isinstance(self.model, torch.nn.Module):
            own = [not isinstance(t, torch.nn.Parameter) for t in targets]
        else:
            own = [False] * len(targets)
        plan = (
            CopyPlan(
                [t for t, o in zip(targets, own, strict=True) if o],
                [s for s, o in zip(sources, own, strict=True) if o],
            )
            if any(own)
            else None
        )
        shared = [(t, s) for t, s, o in zip(targets, sources, own, strict=True) if not o]

        def repoint(threads: int) -> None:
            # The sender leaves this memory unchanged until we ack a newer
            # version: re-pointing is the update, no byte copied.
            if plan is not None:
                plan.run(threads)
            for target, source in shared:
                target.data = source

        return repoint

    def _plan_for(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> CopyPlan:
        """The copy of ``sources`` into ``targets``, kept while both lists and
        the targets' memory stay the same (a routine update of a pipe scheme)."""
        plan = self._plan
        if plan is not None and plan[0] is targets and plan[1] is sources and plan[2].still_valid():
            return plan[2]
        # New sources, or a tensor of the model was re-pointed
        # (``param.data = ...``) to memory of the same shape: plan again.
        self._plan = (targets, sources, CopyPlan(targets, sources))
        return self._plan[2]

    def apply_update(self, update: Update) -> int:
        """Apply ``update`` now, on the calling thread, and return its version.

        For transports that apply updates as they arrive (Ray actors); the
        update's data must not change while this runs.

        :raises WeightMismatchError: the update does not fit the model
            (nothing was written).
        """
        apply = self._apply_for(update)
        apply(update.copy_threads)
        self.version = update.version
        self._applied += 1
        return update.version

    def take_applied(self) -> int | None:
        """The newest version applied since the previous call, or None (for
        transports that apply updates as they arrive). Never blocks."""
        if self._applied != self._reported:
            self._reported = self._applied
            return self.version
        return None

    async def receive(self, timeout: float | None = None) -> int | None:
        """Apply the newest pending update, if any, and ack it.

        ``timeout``: None or 0 checks without waiting; a number waits up to
        that many seconds for an update. Returns the version applied (a
        positive int), or None if no update came. The model is written only
        here, and only with one complete version; an update that does not fit
        the model is reported to the sender and leaves the model untouched.

        On a transport that applies updates as they arrive (Ray actors), this
        does not wait and applies nothing: it returns the newest version
        applied since the previous call, or None.

        :raises SenderLostError: the sender died or shut down.
        :raises WeightSyncStateError: the receiver is shut down.
        """
        if self._closed:
            raise WeightSyncStateError(
                f"the receiver of model {self.model_id!r} is shut down", model_id=self.model_id
            )
        if not self._announced:
            await self.announce()
        if self.transport.applies_on_arrival:
            await self.transport.next_update(0.0)  # raises once the endpoint is closed
            return self.take_applied()
        wait = timeout or 0.0
        torn = False
        while True:
            update = await self.transport.next_update(wait)
            if update is None:
                if torn:
                    raise SenderLostError(
                        f"the sender of model {self.model_id!r} stopped while this worker was "
                        "reading an update; the model may hold a mix of versions",
                        model_id=self.model_id,
                    )
                return None
            try:
                apply = self._apply_for(update)
            except WeightMismatchError as exc:
                await self.transport.reject(update.version, str(exc))
                return None
            if not self.transport.is_current(update):
                continue  # superseded before we began: the newer update is queued or coming
            apply(update.copy_threads)
            if not self.transport.is_current(update):
                # The sender began the next version during the copy: the model
                # holds a mix now and must be overwritten before returning.
                torn = True
                wait = _RECOVERY_TIMEOUT
                continue
            self.version = update.version
            await self.transport.ack(update.version)
            return update.version

    async def aclose(self) -> None:
        """Close the endpoint. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self.transport.aclose()
