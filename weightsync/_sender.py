"""The async sender: the coroutine API over a send's machine and its drivers.

A send is one :class:`~._send.SendMachine` (``_send``): made on the
caller's thread, it takes the sender (one send at a time) and decides
everything; :func:`~._drive.drive` performs its actions in the running
loop. The blocking facade (``_facade``) drives the same machine on the
calling thread instead (:func:`~._drive.drive_blocking`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import anyio
import torch

from ._announce import Announcements
from ._copy import WireCast
from ._drive import SendIO, drive, resume
from ._exceptions import WeightSyncStateError
from ._exit import close_at_exit
from ._exit import closed as exit_closed
from ._loops import require_asyncio, thread_runs_a_loop
from ._packet import DEFAULT_TIMEOUT
from ._packing import Keys, Packer
from ._send import (
    STAGED,
    Action,
    ChainReport,
    SendMachine,
    SendOptions,
    SendReport,
    Sends,
    refuse_options,
    still_waiting,
)
from ._strategy import WeightStrategy
from ._targets import Workers
from ._transports._base import EVERY_VERSION, DeviceAwareStaging, SenderTransport, SendHandler, Staging

# DEFAULT_TIMEOUT: from _packet
__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncWeightSender",
    "ChainReport",
    "Keys",
    "PendingSend",
    "SendOptions",
    "SendReport",
]


class PendingSend:
    """A send whose weights are staged, its acks still to come; returned by
    :meth:`AsyncWeightSender.send_async`.

    The caller's weights are no longer read: change them at will. Wait for
    it with ``await pending`` (or ``await pending.wait(timeout)``, or the
    sender's ``await wait_async()``); until it is over, the sender runs no
    other send. Once over, waiting again returns its report (or raises its
    error) again.
    """

    def __init__(self, owner: AsyncWeightSender, machine: SendMachine, io: SendIO, action: Action) -> None:
        self._owner = owner
        self.machine, self._io = machine, io
        # Where the send goes on from (the action after its staging), until
        # a wait starts gathering the acks in a task of its loop.
        self._action: Action | None = action
        self._task: asyncio.Task[SendReport | None] | None = None

    @property
    def version(self) -> int:
        """The version this send carries."""
        return self.machine.version

    @property
    def worker_ids(self) -> tuple[int, ...]:
        """The workers targeted."""
        return self.machine.worker_ids

    def done(self) -> bool:
        """Whether the send is over. Never blocks. Called in a running loop,
        it starts gathering the acks there if no wait has yet (a loop that
        only polls ``done()`` sees the send end, as with the blocking
        sender's handle); outside one, it only tells."""
        if self._task is None and self._action is not None and thread_runs_a_loop():
            self._gathering()
        return self._task is not None and self._task.done()

    def _gathering(self) -> asyncio.Task[SendReport | None]:
        """The task gathering the acks, started in the running loop on the
        first wait (a wait that times out leaves it running)."""
        if self._task is None:
            action, self._action = self._action, None
            assert action is not None
            self._task = asyncio.get_running_loop().create_task(resume(self.machine, self._io, action))
        return self._task

    async def wait(self, timeout: float | None = None) -> SendReport:
        """Return once every targeted worker acked this version, or raise
        once the send failed or its deadline passed.

        ``timeout`` (None: as long as the send's own deadline): give up
        waiting after that many seconds, the send going on (wait again).
        A cancellation of this wait cancels the send: its work stops first.

        :raises WorkerLostError: a worker died; the others still got the update.
        :raises AckTimeoutError: a worker did not ack in time (also a TimeoutError).
        :raises WorkerApplyError: a worker failed to apply; carries its message.
        :raises TimeoutError: ``timeout`` passed first; the send goes on.
        """
        require_asyncio(self.machine.model_id)
        task = self._gathering()
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except BaseException:
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})
            self._over()
            raise
        if not done:
            assert timeout is not None
            raise still_waiting(self.version, self.machine.model_id, timeout)
        self._over()
        report = task.result()
        assert report is not None
        return report

    def __await__(self) -> Generator[Any, None, SendReport]:
        return self.wait().__await__()

    async def finish(self) -> None:
        """End the send, its errors ignored (the sender is closing): one
        never waited for is abandoned before any ack is gathered."""
        if self._task is None:
            self._action = None
            self.machine.close()
        elif self._task.get_loop() is not asyncio.get_running_loop():
            # Gathered on another loop (closed from another thread): stop it
            # there, unless that loop has ended (the interpreter exiting).
            with contextlib.suppress(RuntimeError):
                self._task.get_loop().call_soon_threadsafe(self._task.cancel)
        else:
            self._task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({self._task})
            if not self._task.cancelled():
                self._task.exception()  # retrieved: not reported as never retrieved
        self._over()

    def _over(self) -> None:
        if self._owner._pending is self:
            self._owner._pending = None

    def __repr__(self) -> str:
        # (Not done(): a repr starts nothing.)
        state = "done" if self._task is not None and self._task.done() else "pending"
        return f"<PendingSend version={self.version} workers={list(self.worker_ids)} {state}>"


class AsyncWeightSender:
    """Sends the weights of one model to its workers, as coroutines.

    Created by a scheme's ``init_on_sender``; get it with
    ``scheme.get_async_sender()``. One send runs at a time per sender.
    """

    def __init__(
        self,
        *,
        model_id: str | None,
        strategy: WeightStrategy,
        transports: Mapping[int, SenderTransport],
        staging: Staging | None = None,
        context: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = False,
        per_worker_weights: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self.model_id = model_id
        #: float32 weights travel (and workers hold them) cast to this dtype;
        #: None: as they are.
        self.wire_dtype = wire_dtype
        self.strategy = strategy
        self.workers = Workers(transports, model_id, per_worker_weights)
        self.staging = staging
        self._packer = Packer(model_id, context, None if wire_dtype is None else WireCast(wire_dtype))
        self._announcements = Announcements(self.workers.transports, model_id)
        self.io = SendIO(self.workers.transports, staging, self._packer, self._announcements)
        self.sends = Sends(
            self.workers,
            self._packer,
            timeout=timeout,
            verify=verify,
            handler=isinstance(staging, SendHandler),
            on_device=isinstance(staging, DeviceAwareStaging),
        )
        if not self.sends.handler:
            odd = [w for w, t in self.workers.transports.items() if not hasattr(t, "post")]
            if odd:
                raise TypeError(
                    f"the transports of worker(s) {odd} carry no send (no post/deliver), and the "
                    "staging carries none either (no handle_send)"
                )
        self._closed = False
        # The send_async() not waited for yet; it clears itself once over.
        self._pending: PendingSend | None = None
        # Closed at the interpreter's exit if still open (see _exit).
        close_at_exit(self)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` ran."""
        return self._closed

    @property
    def verify(self) -> bool:
        """Whether sends carry digests that each worker checks (the default
        of ``send(verify=None)``)."""
        return self.sends.verify

    @property
    def timeout(self) -> float:
        """The default deadline of a send, and of a wait for workers to
        announce themselves, in seconds."""
        return self.sends.timeout

    @property
    def version(self) -> int:
        """The last version staged (0: none yet); a send refused before
        anything moved uses none."""
        return self.sends.version

    @property
    def context(self) -> Any:
        """Where ``send(None)`` reads the model from (a module, a collector)."""
        return self._packer.context

    @context.setter
    def context(self, context: Any) -> None:
        self._packer.context = context

    @property
    def per_worker_weights(self) -> bool:
        """Whether a send may give each worker weights of its own
        (``send({worker_id: weights, ...})``)."""
        return self.workers.per_worker_weights

    @property
    def transports(self) -> dict[int, SenderTransport]:
        """Worker id -> the sender's channel to it."""
        return self.workers.transports

    @property
    def worker_ids(self) -> list[int]:
        return list(self.workers.transports)

    @property
    def worker_devices(self) -> dict[int, tuple[str, ...] | None]:
        """The devices each worker's model is on, as it announced them
        (``"cpu"``, or ``"cuda:"`` and the GPU's UUID; None: not yet), by
        worker id."""
        return self.workers.devices

    @property
    def worker_versions(self) -> dict[int, int | None]:
        """The last version each worker acked (None: none yet), by worker id."""
        return self.workers.versions

    async def wait_for_workers(
        self, worker_ids: int | Iterable[int] | None = None, *, timeout: float | None = None
    ) -> dict[int, float]:
        """Wait until the targeted workers (default: all) have announced
        themselves: started, called ``init_on_worker``, and told their model's
        layout. Returns, per worker id, the seconds from this call until it
        had (0.0 for one that already had).

        Call it once the workers are started, before the first send: a send
        to workers that have not announced themselves waits for them first
        (up to the scheme's timeout, not counted in the send's ``timeout``),
        which makes the first send look slow. While it waits, it logs to the
        ``weightsync`` logger (INFO) every few seconds which workers have
        announced themselves and which it still waits for.

        Waits at most ``timeout`` seconds (default: the scheme's timeout).

        :raises WorkerLostError: a worker died before it announced itself.
        :raises AckTimeoutError: a worker did not announce itself in time
            (also a TimeoutError); every worker that failed is named.
        :raises UnknownWorkerError: a worker id is unknown.
        :raises WeightSyncStateError: the sender is shut down.
        """
        require_asyncio(self.model_id)
        self._check_open()
        targets = self.workers.targets(worker_ids)
        return await self._announcements.announced(targets, self.timeout if timeout is None else timeout)

    async def connect(
        self, worker_ids: int | Iterable[int] | None = None, *, timeout: float | None = None
    ) -> None:
        """:meth:`wait_for_workers`, returning nothing (the name torchrl's
        sender uses)."""
        await self.wait_for_workers(worker_ids, timeout=timeout)

    async def send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
        keys: Keys | None = None,
        partial: bool = False,
        verify: bool | None = None,
        **unknown: Any,
    ) -> SendReport:
        """Send weights and return once every targeted worker applied and acked them.

        ``weights``: None (the context's model), an ``nn.Module``, a
        ``TensorDict`` or a dict of tensors; with ``per_worker_weights``, also
        ``{worker_id: weights}``, each worker its own (one send per worker,
        one after the other, each its own version; the report names them
        all and carries the last version). ``worker_ids``: None (all), one id,
        or a list. ``timeout``: seconds for the whole send (default: the
        scheme's timeout). The weights may be changed again once this returns
        (already once they are staged: see :meth:`send_async`).

        A partial update (``partial=True``: ``weights`` holds some of the
        model's tensors; or ``keys``: names, or a test on names, picking
        tensors of ``weights``) writes exactly those tensors on every
        targeted worker, at once, and leaves the others as they are; only
        their bytes move. Each must be in every worker's model, with its
        dtype and shape (checked before anything moves).

        ``verify`` (default: the scheme's): the sender digests every tensor
        it sends, and each worker checks the bytes it is about to apply
        against them; one that differs refuses the update (a
        :class:`WorkerApplyError` naming the worker and the tensors) and its
        model is left as it was.

        :raises ValueError: ``worker_ids`` is empty, or weights keyed by
            worker id without ``per_worker_weights`` (nothing was sent).
        :raises UnknownWorkerError: a worker id is unknown (nothing was sent).
        :raises WeightMismatchError: the weights do not match a worker's model
            (nothing was sent to any worker).
        :raises InvalidWeightsError: the weights hold something unsendable.
        :raises WorkerLostError: a worker died; the others still got the update.
        :raises AckTimeoutError: a worker did not ack in time (also a TimeoutError).
        :raises WorkerApplyError: a worker failed to apply; carries its message.
        :raises ResourceExhaustedError: out of open files or memory for the
            staging (nothing was sent).
        :raises WeightSyncStateError: another send is running, or the sender is closed, or this
            coroutine runs under another async library than asyncio (nothing was sent),
            or a partial update targets a worker that has not
            applied a whole one (or missed a send since; nothing was sent).
        """
        refuse_options(unknown, "send()")
        require_asyncio(self.model_id)
        self._refuse_while_pending("send()")
        machine = self.machine(weights, worker_ids, SendOptions(timeout, keys, partial, verify))
        report = await drive(machine, self.io)
        assert report is not None
        return report

    async def send_async(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
        keys: Keys | None = None,
        partial: bool = False,
        verify: bool | None = None,
        **unknown: Any,
    ) -> PendingSend:
        """Start a send and return once the weights are staged: copied out
        of ``weights`` into the staging (a shared segment or slot, Ray's
        object store), so the caller may change them at once. Every
        targeted worker has been told; ``await wait_async()`` (or ``await``
        the :class:`PendingSend` returned) gathers the acks. Until then,
        this sender runs no other send.

        Arguments as :meth:`send`; the deadline (``timeout``) runs from this
        call. Raises here what is found before anything moves (the
        ``ValueError``, ``UnknownWorkerError``, ``WeightMismatchError``,
        ``InvalidWeightsError``, ``ResourceExhaustedError`` and
        ``WeightSyncStateError`` of :meth:`send`); the workers' errors
        (``WorkerLostError``, ``AckTimeoutError``, ``WorkerApplyError``)
        come from the wait.

        :raises WeightSyncStateError: a send_async() is pending (nothing was staged).
        """
        refuse_options(unknown, "send_async()")
        require_asyncio(self.model_id)
        self._refuse_while_pending("send_async()")
        machine = self.machine(
            weights, worker_ids, SendOptions(timeout, keys, partial, verify, "send_async()")
        )
        await drive(machine, self.io, until_staged=True)
        self._pending = PendingSend(self, machine, self.io, STAGED)
        return self._pending

    #: The name this coroutine had before; the same call.
    start_send = send_async

    async def wait_async(self, timeout: float | None = None) -> SendReport:
        """Return once the pending :meth:`send_async` is over: its report;
        raise its error. ``timeout`` as :meth:`PendingSend.wait`.

        :raises WeightSyncStateError: no send_async() is pending.
        :raises TimeoutError: ``timeout`` passed first (the send stays pending).
        """
        require_asyncio(self.model_id)
        pending = self._pending
        if pending is None:
            raise WeightSyncStateError("wait_async() with no send_async() pending", model_id=self.model_id)
        return await pending.wait(timeout)

    @property
    def pending(self) -> PendingSend | None:
        """The :meth:`send_async` not waited for yet (None: none)."""
        return self._pending

    def _refuse_while_pending(self, what: str) -> None:
        if self._pending is not None:
            raise WeightSyncStateError(
                f"{what} while a send_async() of model {self.model_id!r} (version "
                f"{self._pending.version}) is pending; await wait_async() first",
                model_id=self.model_id,
            )

    def machine(
        self, weights: Any, worker_ids: int | Iterable[int] | None, options: SendOptions
    ) -> SendMachine:
        """The machine of a send of ``weights`` to ``worker_ids``, holding
        the sender (see ``_send.SendMachine``): drive it, or close it.
        Never blocks; touches no worker.

        :raises WeightSyncStateError: another send is running, or the sender is closed.
        :raises ValueError, UnknownWorkerError: as :meth:`send`.
        """
        self._check_open()
        return SendMachine(self.sends, weights, worker_ids, options)

    # -- membership and lifetime --------------------------------------------
    async def add_worker(self, worker_id: int, transport: SenderTransport) -> None:
        """Send to ``transport`` as worker ``worker_id`` from now on. An
        existing worker of that id (one that died and was restarted) is
        replaced: its channel is closed and what was staged for it freed.

        :raises WeightSyncStateError: a send is running, or the sender is closed.
        """
        with self._membership_change("add_worker()"):
            old = self.workers.put(worker_id, transport)
        if old is not None:
            await self._let_go(worker_id, old)

    async def remove_worker(self, worker_id: int) -> None:
        """Stop sending to worker ``worker_id``: close its channel (the worker
        hears a clean shutdown) and free what was staged for it. Sends to the
        others go on.

        :raises UnknownWorkerError: no such worker.
        :raises WeightSyncStateError: a send is running, or the sender is closed.
        """
        with self._membership_change("remove_worker()"):
            transport = self.workers.pop(worker_id)
        await self._let_go(worker_id, transport)

    async def _let_go(self, worker_id: int, transport: SenderTransport) -> None:
        with anyio.CancelScope(shield=True):
            if self.staging is not None:
                self.staging.released(worker_id, EVERY_VERSION, None)
            await transport.aclose()

    @contextlib.contextmanager
    def _membership_change(self, what: str) -> Iterator[None]:
        """Holds the sender (no send starts meanwhile) while the workers change.

        :raises WeightSyncStateError: a send is running, or the sender is closed.
        """
        require_asyncio(self.model_id)
        self._check_open()
        if not self.sends.busy.acquire(blocking=False):
            raise WeightSyncStateError(
                f"{what} while a send of model {self.model_id!r} is running", model_id=self.model_id
            )
        try:
            yield
        finally:
            self.sends.busy.release()

    def _check_open(self) -> None:
        if self._closed:
            raise WeightSyncStateError(
                f"the sender of model {self.model_id!r} is shut down", model_id=self.model_id
            )

    async def __aenter__(self) -> AsyncWeightSender:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every channel and release the staging memory: the workers'
        next ``receive()`` raises :class:`SenderClosedError`. Idempotent.

        This is how an async trainer ends its side, inside its event loop
        (or ``async with scheme.get_async_sender() as sender:``); a later
        ``scheme.shutdown()`` then has nothing left to do. Sync code calls
        ``scheme.shutdown()``, which closes the sender the same way.
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._pending is not None:
                await self._pending.finish()
            # At once: each may wait for its worker to let go of GPU memory.
            async with anyio.create_task_group() as group:
                for transport in self.workers.transports.values():
                    group.start_soon(transport.aclose)
            if self.staging is not None:
                await self.staging.aclose()
            self.io.close()
        exit_closed(self)

    def _close_at_exit(self) -> None:
        """As the interpreter exits with this sender open and nothing else
        to close it (its scheme is gone): :meth:`aclose` on a loop of its
        own. Never raises."""
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self.aclose())
        except BaseException:
            pass  # (exit goes on)
        finally:
            loop.close()
