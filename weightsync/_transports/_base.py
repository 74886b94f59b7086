"""The transport interface every scheme implements.

Sender side, per scheme: one :class:`SharedTransport` (what is written once per
send, however many workers there are) and one :class:`SenderTransport` per
worker. Worker side: one :class:`ReceiverTransport`. All methods that may wait
are coroutines; none blocks the event loop. Deadlines are the caller's cancel
scopes: a transport only has to be cancellable.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .._exceptions import WorkerApplyError, WorkerLostError
from .._packet import Manifest, Packet

__all__ = [
    "ReceiverTransport",
    "SenderTransport",
    "SharedTransport",
    "Update",
    "caller_is_blocked",
    "worker_failed",
    "worker_lost",
]

#: True while the coroutine runs on a private loop whose caller is blocked
#: waiting for it: a transport may then do long copies inline instead of in a
#: worker thread, since nothing else runs on that loop.
caller_is_blocked: ContextVar[bool] = ContextVar("weightsync_caller_is_blocked", default=False)


def worker_lost(worker_id: int, model_id: str | None, reason: str) -> WorkerLostError:
    """The error of a sender transport whose worker died or whose channel closed."""
    return WorkerLostError(
        f"worker {worker_id} (model {model_id!r}) is gone: {reason}", worker_id=worker_id, model_id=model_id
    )


def worker_failed(worker_id: int, model_id: str | None, version: int, message: str) -> WorkerApplyError:
    """The error of a sender transport whose worker reported ``message``
    instead of applying ``version``."""
    return WorkerApplyError(
        f"worker {worker_id} (model {model_id!r}) failed to apply version {version}: {message}",
        worker_id=worker_id,
        model_id=model_id,
        version=version,
        worker_message=message,
    )


@dataclass(frozen=True)
class Update:
    """A worker's view of one pending update."""

    version: int
    layout_id: str
    #: Threads the worker may use for its copy (the sender spreads the host's
    #: cores over the workers of one send).
    copy_threads: int = 1


@runtime_checkable
class SharedTransport(Protocol):
    """The part of a send written once for all workers."""

    async def stage(self, packet: Packet) -> None:
        """Make ``packet``'s bytes available to the workers.

        After it returns the caller may change its weights again.
        """

    async def aclose(self) -> None:
        """Release what was staged. Idempotent."""


@runtime_checkable
class SenderTransport(Protocol):
    """The sender's channel to one worker."""

    worker_id: int
    #: The worker's model layout once it announced itself (None before, or
    #: when the transport cannot tell).
    layout: Manifest | None

    async def connect(self) -> Manifest | None:
        """Wait until the worker is known, and return its model's layout
        (None when the transport cannot tell).

        :raises WorkerLostError: the worker died or its channel closed.
        """

    def post(self, packet: Packet) -> bool:
        """Start delivering ``packet`` (already staged) if that can be done
        without waiting; True if it was started. Never blocks.

        The sender posts to every worker before it starts gathering acks, so
        no worker waits for the fan-out's own bookkeeping.

        :raises WorkerLostError: the worker's channel is closed.
        """

    async def deliver(self, packet: Packet) -> None:
        """Finish delivering ``packet`` (already staged; posted or not) and
        return when the worker acked exactly that version.

        :raises WorkerLostError: the worker died or its channel closed.
        :raises WorkerApplyError: the worker reported a failure.
        """

    async def aclose(self) -> None:
        """Close the channel; the worker's next receive reports the sender
        gone. Idempotent."""


@runtime_checkable
class ReceiverTransport(Protocol):
    """A worker's endpoint."""

    #: True when an update is applied by re-pointing the model's tensors to
    #: the transport's memory instead of copying into them.
    zero_copy: bool
    #: True when updates are applied as they arrive, by the sender calling
    #: into the worker (Ray actors), instead of in ``receive()``: ``receive()``
    #: then only reports the newest version applied since its last call.
    applies_on_arrival: bool

    async def announce(self, manifest: Manifest) -> None:
        """Tell the sender this worker exists and what its model looks like."""

    def wait_ready(self, timeout: float) -> bool:
        """Block the calling thread (not an event loop) up to ``timeout``
        seconds until an update may be pending or the sender may be gone.

        True means "look now" (``next_update(0)`` will tell); False means
        nothing came.
        """

    async def next_update(self, timeout: float) -> Update | None:
        """The newest pending update, or None if none came within ``timeout``
        seconds (0: do not wait).

        :raises SenderLostError: the sender died or shut down.
        """

    def sources(self, update: Update, manifest: Manifest) -> list[torch.Tensor]:
        """Read-only tensors holding the update's data, in manifest order."""

    def is_current(self, update: Update) -> bool:
        """Whether the data behind ``update`` is still that version (the
        sender has not started overwriting it)."""

    async def ack(self, version: int) -> None:
        """Report ``version`` applied."""

    async def reject(self, version: int, message: str) -> None:
        """Report that ``version`` could not be applied, and why."""

    async def aclose(self) -> None:
        """Close the endpoint. Idempotent."""
