"""The async receiver: validate, apply atomically, ack."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple

import anyio
import torch

from ._exceptions import (
    ResourceExhaustedError,
    SenderLostError,
    WaitTimeoutError,
    WeightMismatchError,
    WeightSyncError,
    WeightSyncStateError,
)
from ._loops import NEEDS_LOOP, NeedsLoop, require_asyncio
from ._model_targets import ModelTargets
from ._packet import DEFAULT_TIMEOUT, Manifest
from ._transports._base import Applier, Incoming, WorkerEndpoint

__all__ = ["AsyncWeightReceiver"]

# After a copy raced with the sender's next write (only a worker that missed a
# deadline can see that), the receiver waits this long for the newer version
# before giving up, so it never returns with a mix of two versions.
_RECOVERY_TIMEOUT = 60.0


class _Then(enum.Enum):
    DONE = "reply, then return or raise"
    SUPERSEDED = "a newer update replaced it before it was read: take the next"
    TORN = "the copy raced the next version: wait for it and apply it"


class _Step(NamedTuple):
    """What one update came to (see ``AsyncWeightReceiver._take``)."""

    then: _Then
    #: (version, error message or None for an ack) to tell the sender.
    reply: tuple[int, str | None] | None = None
    #: Raised to the caller once the sender was told.
    error: BaseException | None = None


class AsyncWeightReceiver:
    """Applies updates of one model on a worker, as coroutines.

    Created by a scheme's ``init_on_receiver``; get it with
    ``scheme.get_async_receiver()``. ``endpoint`` builds the transport's
    worker endpoint given this receiver (a push endpoint keeps it, to apply
    updates as they arrive).

    ``device``: where a model tensor on the meta device (a model built
    without storage) gets its storage, at the first update (default: CPU).
    ``on_update(version)`` runs after each update is applied, before the ack.
    """

    def __init__(
        self,
        *,
        model_id: str | None,
        model: Any,
        endpoint: Callable[[Applier], WorkerEndpoint],
        device: Any = None,
        on_update: Callable[[int], Any] | None = None,
    ) -> None:
        self.model_id = model_id
        device = torch.device("cpu") if device is None else torch.device(device)
        self._model = ModelTargets(model, model_id, device)
        self.on_update = on_update
        #: The last version applied; None before the first.
        self.version: int | None = None
        self._closed = False
        self._announced = False
        # Updates applied so far, and how many of them receive() reported.
        self._applied = 0
        self._reported = 0
        # A copy raced the sender's next version: the model holds a mix
        # until a newer version is applied; until then receive() waits
        # for it (receive_ready() leaves it to receive()).
        self._torn = False
        # What receive_ready() applied but could not reply without waiting.
        self._unsent: _Step | None = None
        self.endpoint = endpoint(self)

    def set_model(self, model: Any) -> None:
        """Apply the next updates to ``model`` (same layout) instead. Not
        while an update is being applied."""
        self._model.set_model(model)

    @property
    def model(self) -> Any:
        """The model updates are applied to."""
        return self._model.model

    def manifest(self) -> Manifest:
        """The layout of the model as it is now."""
        return self._model.manifest()

    def devices(self) -> tuple[str, ...]:
        """The devices the model is on (see ``_placement``)."""
        return self._model.devices()

    async def announce(self) -> None:
        """Tell the sender this worker exists and what its model looks like."""
        require_asyncio(self.model_id)
        await self.endpoint.announce(self._model.manifest(), self._model.devices())
        self._announced = True

    def apply(self, incoming: Incoming) -> int:
        """Apply ``incoming`` now, on the calling thread, and return its version.

        For push endpoints (Ray actors), which call it as updates arrive;
        the update's bytes must not change while this runs.

        :raises WeightMismatchError: the update does not fit the model
            (nothing was written).
        """
        targets, manifest = self._model.of(incoming)
        refused = self._model.corrupt(incoming, manifest)
        if refused is not None:
            raise WeightMismatchError(refused, model_id=self.model_id)
        incoming.apply(self.model, targets, manifest)
        self._mark_applied(incoming.version)
        return incoming.version

    def _updated(self, version: int) -> Exception | None:
        """Run ``on_update``; what it raised, if it did."""
        if self.on_update is None:
            return None
        try:
            self.on_update(version)
        except Exception as exc:
            return exc
        return None

    def _mark_applied(self, version: int) -> None:
        self.version = version
        self._applied += 1
        self._torn = False  # (every tensor holds this version now)

    def _take_applied(self) -> int | None:
        """The newest version applied since the previous call, or None."""
        if self._applied != self._reported:
            self._reported = self._applied
            return self.version
        return None

    def wait_ready(self, timeout: float) -> bool:
        """Block the calling thread (not an event loop) up to ``timeout``
        seconds until :meth:`receive` may have something to do: an update
        may be pending, one was applied as it arrived, or the sender may be
        gone. False means nothing came: ``receive(0)`` would return None."""
        if self._applied != self._reported or self._closed:
            return True
        return self.endpoint.wait_ready(timeout)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` ran."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise WeightSyncStateError(
                f"the receiver of model {self.model_id!r} is shut down", model_id=self.model_id
            )

    async def receive(self, timeout: float | None = None) -> int | None:
        """Apply the newest pending update, if any, and ack it.

        ``timeout``: None or 0 checks without waiting; a number waits up to
        that many seconds for an update. Returns the version applied (a
        positive int), or None if no update came. The model is written only
        here, and only with one complete version; an update that does not fit
        the model is reported to the sender and leaves the model untouched.

        Where updates are applied as they arrive (Ray actors), this does not
        wait and applies nothing: it returns the newest version applied since
        the previous call, or None.

        :raises SenderLostError: the sender died or shut down.
        :raises ResourceExhaustedError: out of open files or memory to map
            the update (the sender is told; the model is untouched).
        :raises WeightSyncStateError: the receiver is shut down, or this
            coroutine runs under another async library than asyncio.
        """
        require_asyncio(self.model_id)
        self._check_open()
        if not self._announced:
            await self.announce()
        while True:
            # A copy that raced the sender's next version left the model
            # torn: only a newer version may end this call.
            torn = self._torn
            incoming = await self.endpoint.next_update(_RECOVERY_TIMEOUT if torn else (timeout or 0.0))
            if incoming is None:
                if torn:
                    raise SenderLostError(
                        f"the sender of model {self.model_id!r} stopped while this worker was "
                        "reading an update; the model may hold a mix of versions",
                        model_id=self.model_id,
                    )
                return self._take_applied()
            step = self._settle(incoming)
            if step is not None:
                return await self._finish(step)

    def receive_ready(self) -> int | NeedsLoop | None:
        """What :meth:`receive` with no wait returns, done on the calling
        thread without an event loop where nothing has to wait: an update
        is pending and its ack fits in the channel. Returns
        :data:`NEEDS_LOOP`, having changed nothing, where the coroutine must
        run instead (nothing pending yet, an endpoint that cannot tell
        without its loop, the first call, which announces the worker); after
        a copy that raced the sender's next version it returns
        :data:`NEEDS_LOOP` too, and the next :meth:`receive` waits for the
        newer version before it returns (the model is torn until then).

        Never blocks but for the copy into the model. Raises as :meth:`receive`.
        """
        self._check_open()
        if not self._announced:
            return NEEDS_LOOP
        while not self._torn and (incoming := self.endpoint.take_ready()) is not None:
            step = self._settle(incoming)
            if step is None:
                continue
            if step.reply is not None and not self.endpoint.try_reply(*step.reply):
                self._unsent = step
                return NEEDS_LOOP
            if step.error is not None:
                raise step.error
            return self._take_applied()
        return NEEDS_LOOP

    async def finish_unsent(self) -> int | None:
        """Send the reply that :meth:`receive_ready` could not send without
        waiting, then return or raise what it would have."""
        step, self._unsent = self._unsent, None
        assert step is not None, "receive_ready() left nothing to finish"
        return await self._finish(step)

    @property
    def unsent(self) -> bool:
        """Whether :meth:`receive_ready` left a reply for :meth:`finish_unsent`."""
        return self._unsent is not None

    async def _finish(self, step: _Step) -> int | None:
        if step.reply is not None:
            await self.endpoint.reply(*step.reply)
        if step.error is not None:
            raise step.error
        return self._take_applied()

    def _settle(self, incoming: Incoming) -> _Step | None:
        """:meth:`_take` of ``incoming``, the one step of :meth:`receive`
        and :meth:`receive_ready`: what to reply, or None where there is
        nothing to reply yet (it was superseded: the newer update is
        pending; or its copy raced the next version, which leaves the
        model torn until a newer version is applied)."""
        step = self._take(incoming)
        if step.then is _Then.TORN:
            self._torn = True
        return step if step.then is _Then.DONE else None

    def _take(self, incoming: Incoming) -> _Step:
        """Everything :meth:`receive` does with one update but wait and reply:
        check it, apply it, and say what to tell the sender and what next.
        Never waits (but for the copy)."""
        try:
            targets, manifest = self._model.of(incoming)
        except WeightMismatchError as exc:
            return _Step(_Then.DONE, (incoming.version, str(exc)))
        except Exception as exc:
            # (e.g. out of memory giving a meta model its storage): the
            # sender hears why, then the caller.
            return _Step(_Then.DONE, (incoming.version, f"{type(exc).__name__}: {exc}"), exc)
        try:
            if not incoming.is_current():
                # Superseded before we began: the newer update is queued or coming.
                return _Step(_Then.SUPERSEDED)
            refused = self._model.corrupt(incoming, manifest)
            if refused is not None:
                if not incoming.is_current():
                    return _Step(_Then.SUPERSEDED)  # overwritten while we read it: not corrupt
                return _Step(_Then.DONE, (incoming.version, refused))
            incoming.apply(self.model, targets, manifest)
        except ResourceExhaustedError as exc:
            # Nothing was written (the staging could not even be mapped):
            # tell the sender why, then the caller.
            exc.model_id = self.model_id
            return _Step(_Then.DONE, (incoming.version, str(exc)), exc)
        except WeightSyncError:
            raise  # (the sender is gone: no one to tell)
        except Exception as exc:
            # The copy itself failed (a CUDA error on this worker's GPU): the
            # model may hold part of this version. The sender hears why and
            # names this worker; the caller gets the error itself.
            why = (
                f"writing version {incoming.version} into the model failed "
                f"({type(exc).__name__}: {exc}); the model may hold part of it"
            )
            return _Step(_Then.DONE, (incoming.version, why), exc)
        if not incoming.is_current():
            # The sender began the next version during the copy: the model
            # holds a mix now and must be overwritten before returning.
            return _Step(_Then.TORN)
        self._mark_applied(incoming.version)
        failed = self._updated(incoming.version)
        if failed is None:
            return _Step(_Then.DONE, (incoming.version, None))
        # The sender hears why; this worker's caller gets its own error.
        return _Step(
            _Then.DONE,
            (
                incoming.version,
                f"version {incoming.version} was applied, but on_update raised "
                f"{type(failed).__name__}: {failed}",
            ),
            failed,
        )

    async def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Return once ``version`` or a newer one is applied: the version
        applied. Pending updates are applied while it waits (where updates
        are applied as they arrive, it only waits).

        ``timeout``: seconds (None: the default of 60 s).

        :raises WaitTimeoutError: not applied in time.
        :raises SenderLostError: the sender died or shut down first.
        """
        require_asyncio(self.model_id)
        wait = DEFAULT_TIMEOUT if timeout is None else timeout
        deadline = anyio.current_time() + wait
        while self.version is None or self.version < version:
            left = deadline - anyio.current_time()
            if left <= 0:
                raise WaitTimeoutError(
                    f"version {version} of model {self.model_id!r} was not applied within {wait:g} s "
                    f"(applied: {self.version})",
                    model_id=self.model_id,
                )
            if self.endpoint.pushes:
                await anyio.sleep(min(left, 0.005))
            else:
                await self.receive(left)
        return self.version

    async def aclose(self) -> None:
        """Close the endpoint. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self.endpoint.aclose()
