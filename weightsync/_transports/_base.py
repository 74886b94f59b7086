"""The transport interface.

Sender side, per scheme: one :class:`Staging` (where a send's bytes wait for
the workers; written once per send, however many workers there are) and one
:class:`SenderTransport` per worker (the control channel to it). A send is
carried either by the channels, each to its worker (:class:`ChannelTransport`:
pipes), or by the staging, to all the send's workers at once
(:class:`SendHandler`: a chain), which gets the whole send
(:class:`Outgoing`) and reports an outcome per worker. Worker side:
one :class:`WorkerEndpoint`, which yields :class:`Incoming` updates.

A pull endpoint (pipes) holds updates until the worker's ``receive()`` asks
for them; a push endpoint (Ray) is built with the receiver (an
:class:`Applier`) and applies each update as it arrives. Either way the model
is written by ``Incoming.apply``, so what is specific to a transport (copy
into the model, or re-point the model to shared memory) lives with it.

All methods that may wait are coroutines; none blocks the event loop, but for
``WorkerEndpoint.wait_ready``, which is for a thread outside any loop.
Deadlines are the caller's cancel scopes: a transport only has to be
cancellable.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .._copy import copy_tensors
from .._exceptions import WorkerApplyError, WorkerError, WorkerLostError
from .._memory._placement import Placement
from .._packet import ChainReport, Manifest, Packet, Signature

__all__ = [
    "EVERY_VERSION",
    "Applier",
    "ChannelTransport",
    "DeviceAwareStaging",
    "Incoming",
    "Outgoing",
    "SendHandler",
    "SenderTransport",
    "Staging",
    "StagingReader",
    "WorkerEndpoint",
    "worker_failed",
    "worker_lost",
]


#: Past any version a sender will ever use: ``Staging.released(worker, EVERY_VERSION, None)``
#: frees all that was held for a worker (one that died or was removed).
EVERY_VERSION = 2**63 - 1


def worker_lost(
    worker_id: int,
    model_id: str | None,
    reason: str,
    *,
    exit_code: int | None = None,
    exit_signal: int | None = None,
) -> WorkerLostError:
    """The error of a sender transport whose worker died or whose channel closed."""
    return WorkerLostError(
        f"worker {worker_id} (model {model_id!r}) is gone: {reason}",
        worker_id=worker_id,
        model_id=model_id,
        exit_code=exit_code,
        exit_signal=exit_signal,
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


# -- sender side -------------------------------------------------------------


@runtime_checkable
class Staging(Protocol):
    """Where a send's bytes wait for the workers."""

    def write(
        self, packet: Packet, digest: bool, placements: Mapping[int, Placement]
    ) -> tuple[int, ...] | None:
        """Make ``packet``'s bytes available to the workers of the send,
        reached as ``placements`` says (by worker id: the send decided it,
        ``_placement.route``); with ``digest``, return the digests of its
        tensors (see ``_digest``), taken as they were staged, else None.

        Blocks the calling thread for the copy (the send's driver runs it
        inline, or on a worker thread); never enters an event loop. After
        it returns the caller may change its weights again.
        """

    def descriptor(self, worker_id: int) -> Any:
        """What worker ``worker_id`` needs to find the staged bytes (small,
        picklable). The staging counts those bytes as in use by that worker
        until :meth:`released` says otherwise."""

    def released(self, worker_id: int, version: int, holding: Any) -> None:
        """Worker ``worker_id`` is past every update up to ``version`` and
        now runs on ``holding`` (what its ack named; None: its own memory)."""

    async def aclose(self) -> None:
        """Release what was staged. Idempotent."""


@runtime_checkable
class DeviceAwareStaging(Staging, Protocol):
    """A :class:`Staging` that stages by where each worker's model is (the
    pipe schemes' device slab for workers on GPUs): told the devices of
    each worker as it announces itself."""

    def placed(self, worker_id: int, devices: tuple[str, ...] | None, reach: tuple[str, ...] = ()) -> None:
        """Worker ``worker_id`` announced its model on ``devices``
        (``_placement.devices_of``), into which it can copy device to
        device from the GPUs of ``reach`` (``_placement.reachable``)."""


@runtime_checkable
class SenderTransport(Protocol):
    """The sender's channel to one worker: its announcement, why it is late,
    its close. How a send reaches the worker is the channel's own where it
    is a :class:`ChannelTransport` (pipes: a channel per worker), else the
    staging's, for every worker of the send at once (a :class:`SendHandler`:
    a chain)."""

    worker_id: int
    #: The worker's model layout once it announced itself (None before, or
    #: when the transport cannot tell).
    layout: Manifest | None
    #: The devices its model is on, as it announced them (``_placement``:
    #: ``"cpu"``, ``"cuda:<uuid>"``); None before, or when it cannot tell.
    devices: tuple[str, ...] | None
    #: The GPUs it can copy from device to device (``_placement.reachable``;
    #: empty: none, or the transport cannot tell).
    reach: tuple[str, ...]

    async def connect(self) -> Manifest | None:
        """Wait until the worker is known, and return its model's layout
        (None when the transport cannot tell).

        :raises WorkerLostError: the worker died or its channel closed.
        """

    def why_late(self) -> str | None:
        """What the transport knows of why the worker has not acked the
        current send (a chain that broke before it, say), for the error
        raised at the deadline; None when it knows nothing. Never blocks."""

    async def aclose(self) -> None:
        """Close the channel; the worker's next receive reports the sender
        gone. Idempotent."""


@runtime_checkable
class ChannelTransport(SenderTransport, Protocol):
    """A channel that carries each send to its worker itself: the sender
    posts to every worker, then gathers the acks (by descriptor where
    :meth:`ack_fds` gives some, else through :meth:`deliver`)."""

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

    def ack_fds(self, packet: Packet) -> tuple[int, ...] | None:
        """Descriptors of which one turns readable when the worker may have
        acked ``packet`` (already posted), failed or died: the sender then
        waits on every worker's at once and calls :meth:`try_ack` for news.
        None where only :meth:`deliver` can go on (the transport is not
        watched this way, or the update could not be posted). Never blocks."""

    def try_ack(self, packet: Packet, ready: Collection[int] = ()) -> bool | None:
        """Take what the worker sent, without waiting: True once it acked
        ``packet``'s version, False while it has not, None where only
        :meth:`deliver` can go on (the worker restarted and must be told
        again). ``ready``: those of its :meth:`ack_fds` the caller saw
        readable just now (not asked again). Never blocks.

        :raises: as :meth:`deliver`.
        """


class Outgoing(Protocol):
    """One send, as a :class:`SendHandler` takes it: the staged packet, the
    workers to tell, and where each one's answer goes. The send keeps the
    policy (the deadline's scope, the errors of the late, versions, who
    acked what); the handler only reports what each worker answered."""

    packet: Packet
    #: The workers to tell (each announced, none failed yet).
    worker_ids: list[int]
    #: When the sender stops waiting (``time.monotonic()``); the handler
    #: runs inside a cancel scope that ends then.
    deadline: float

    def ack(self, worker_id: int) -> None:
        """Worker ``worker_id`` acked ``packet``'s version."""

    def fail(self, worker_id: int, error: WorkerError) -> None:
        """Worker ``worker_id`` failed: died, or could not apply it."""

    @property
    def acked(self) -> frozenset[int]:
        """The workers that acked so far (all of them, once the send is over)."""

    def carried(self, chain: ChainReport) -> None:
        """How the handler's chains carried the send, for its report."""


@runtime_checkable
class SendHandler(Staging, Protocol):
    """A :class:`Staging` that also carries whole sends to their workers
    (a chain: torch.distributed, Ray's relay), like httpx's
    ``handle_async_request``: one call per send, with its targets."""

    async def handle_send(self, send: Outgoing, channels: Mapping[int, SenderTransport]) -> None:
        """Tell every worker of ``send`` (``channels``: the sender's, by
        worker id) and report each one's answer (``send.ack`` or
        ``send.fail``), until every one answered or the caller's cancel
        scope ends (the send's deadline: a worker with no answer by then is
        the sender's to report). Raises nothing for a worker's failure."""


# -- worker side ---------------------------------------------------------------


class Incoming(Protocol):
    """One update that reached a worker and is not applied yet."""

    version: int
    layout_id: str
    #: A partial update's layout (names, dtypes, shapes of the tensors it
    #: writes); None for the whole model.
    subset: Signature | None
    #: The sender's digest of each tensor (manifest order), or None.
    digests: tuple[int, ...] | None
    #: Threads this worker may use for the update's copies and digests.
    threads: int

    @property
    def checked_on_host(self) -> bool:
        """Whether a verified update's bytes were checked by the sender for
        the whole host, in memory nothing can write any more: the worker
        then checks :meth:`check_mapping` instead of digesting them."""

    def check_mapping(self, manifest: Manifest) -> str | None:
        """Where :attr:`checked_on_host`: why the memory this worker maps is
        not the one it was told (None: it is)."""

    def is_current(self) -> bool:
        """Whether the bytes behind this update still hold its version (the
        sender has not begun overwriting them)."""

    def sources(self, manifest: Manifest) -> list[torch.Tensor]:
        """The update's bytes as tensors of ``manifest`` (read-only views of
        what :meth:`apply` writes from), for checking ``digests``."""

    def apply(self, model: Any, targets: list[torch.Tensor], manifest: Manifest) -> None:
        """Write the update into ``targets`` (the model's tensors in
        ``manifest`` order, already checked against the update's layout).
        Blocks until done."""


@dataclass(eq=False)
class BufferUpdate:
    """An :class:`Incoming` whose bytes are one flat buffer of the worker's
    own (a chain's receive buffer, an RPC call's tensor), which nothing
    writes while the receiver holds it: the worker copies out of it."""

    version: int
    layout_id: str
    subset: Signature | None
    digests: tuple[int, ...] | None
    threads: int
    buffer: torch.Tensor

    #: Each worker digests a verified update's bytes itself.
    checked_on_host = False

    def check_mapping(self, manifest: Manifest) -> str | None:
        return None

    def is_current(self) -> bool:
        # Its buffer is never rewritten while the receiver holds it.
        return True

    def sources(self, manifest: Manifest) -> list[torch.Tensor]:
        return manifest.views(self.buffer)

    def apply(self, model: Any, targets: list[torch.Tensor], manifest: Manifest) -> None:
        copy_tensors(targets, manifest.views(self.buffer), threads=self.threads)


class Applier(Protocol):
    """What a push endpoint calls on its receiver."""

    def manifest(self) -> Manifest:
        """The layout of the worker's model as it is now."""

    def devices(self) -> tuple[str, ...]:
        """The devices the worker's model is on (``_placement.devices_of``)."""

    def apply(self, incoming: Incoming) -> int:
        """Apply ``incoming`` now, on the calling thread; its version.

        :raises WeightMismatchError: it does not fit the model (nothing written).
        """


@runtime_checkable
class WorkerEndpoint(Protocol):
    """A worker's end of the control channel."""

    #: True for a push endpoint, which applies updates as they arrive
    #: (through the receiver it was built with); False for a pull endpoint,
    #: whose updates wait for ``next_update``.
    pushes: bool

    async def announce(self, manifest: Manifest, devices: tuple[str, ...]) -> None:
        """Tell the sender this worker exists, what its model looks like,
        and the devices it is on (``_placement.devices_of``)."""

    async def next_update(self, timeout: float) -> Incoming | None:
        """The newest pending update, or None if none came within ``timeout``
        seconds (0: do not wait). A push endpoint has none: it returns None
        at once.

        :raises SenderLostError: the sender died or shut down.
        """

    async def reply(self, version: int, error: str | None = None) -> None:
        """Report ``version`` applied, or (``error``) not applied and why."""

    def take_ready(self) -> Incoming | None:
        """The newest pending update if it can be had on the calling thread
        without an event loop (None: none is pending, or this endpoint
        cannot tell without its loop; ``next_update`` will). Never blocks.

        :raises SenderLostError: the sender died or shut down.
        """

    def try_reply(self, version: int, error: str | None = None) -> bool:
        """Send what :meth:`reply` sends, if that can be done now without
        waiting; False if it was not sent (``reply`` will). Never blocks.

        :raises SenderLostError: the sender is gone.
        """

    def wait_ready(self, timeout: float) -> bool:
        """Block the calling thread (not an event loop) up to ``timeout``
        seconds until an update may be pending or the sender may be gone.
        True means "look now" (``next_update(0)`` will tell)."""

    async def aclose(self) -> None:
        """Close the endpoint. Idempotent."""


class StagingReader(Protocol):
    """The worker's half of a :class:`Staging`: reads what the sender staged,
    given the descriptor that came with an update."""

    def is_current(self, descriptor: Any, version: int) -> bool:
        """Whether the staged bytes still hold ``version``.

        :raises OSError: the staging cannot be opened (the sender is gone).
        """

    def apply(
        self, descriptor: Any, model: Any, targets: list[torch.Tensor], manifest: Manifest, threads: int
    ) -> None:
        """Write the staged update into ``targets`` (copy, or re-point)."""

    #: Whether a verified update is checked once for the host by the sender
    #: (the worker then checks :meth:`check`, not the bytes).
    checked_on_host: bool

    def sources(self, descriptor: Any, manifest: Manifest) -> list[torch.Tensor]:
        """Read-only views of the staged tensors of ``manifest``."""

    def check(self, descriptor: Any, version: int, manifest: Manifest) -> str | None:
        """Where :attr:`checked_on_host`: why the staging mapped is not the
        one named by ``descriptor`` for ``version`` (None: it is)."""

    def holding(self) -> Any:
        """What the worker runs on now, for its ack (None: its own memory)."""

    def keep_own(self) -> None:
        """The sender shut down: make whatever the worker's tensors run on
        that lives only as long as the sender's process its own (a copy);
        a no-op for host memory, which outlives the sender."""

    def close(self) -> None:
        """Let go of every mapping. Idempotent."""
