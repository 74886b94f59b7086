"""The async sender: one send's steps, written once, and two drivers.

A send resolves its targets, reads the model into a packet, casts and
stages it, tells (posts to) the workers, takes their acks, records who
acked, and reports. :meth:`AsyncWeightSender.start_send` and
:meth:`PendingSend.wait` drive those steps as coroutines;
:meth:`AsyncWeightSender.start_send_now` and
:meth:`AsyncWeightSender.finish_now` drive the same steps on the calling
thread with no event loop, where the staging can (a blocking ``send()`` over
pipes). The targets live in ``_targets``, the reading in ``_packing``, the
gathering of answers in ``_acks``.

One send runs at a time per sender: a lock, taken without blocking when a
send starts (a second one is refused) and given back when its
:class:`PendingSend` is over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from ._acks import AckGather
from ._copy import WireCast
from ._exceptions import WeightSyncStateError, WorkerError, combine_worker_errors
from ._offload import NEEDS_LOOP, NeedsLoop, require_asyncio
from ._packet import DEFAULT_TIMEOUT, Packet
from ._packing import Keys, Packer
from ._strategy import WeightStrategy
from ._targets import Workers
from ._transports._base import EVERY_VERSION, LoopFreeStaging, SenderTransport, Staging

# DEFAULT_TIMEOUT: from _packet
__all__ = ["DEFAULT_TIMEOUT", "AsyncWeightSender", "Keys", "PendingSend", "SendReport"]


@dataclass(frozen=True)
class SendReport:
    """What a successful send did: the version and the workers that applied it."""

    version: int
    worker_ids: tuple[int, ...]
    nbytes: int
    #: From the call until every targeted worker acked.
    seconds: float
    #: Reading and staging the weights: from the moment every targeted
    #: worker had announced itself until the weights were staged (a
    #: ``send_async()`` returns then).
    staged_seconds: float = 0.0
    #: Waiting for targeted workers to announce themselves (a send to workers
    #: that are still starting; 0 once they all have, see
    #: :meth:`AsyncWeightSender.wait_for_workers`). Not part of the send's
    #: ``timeout``, which starts once they have.
    announce_seconds: float = 0.0


class PendingSend:
    """A send whose weights are staged, its acks still to come; made by
    :meth:`AsyncWeightSender.start_send`.

    The caller's weights are no longer read: change them at will. Await
    :meth:`wait` once (the sender runs no other send until it returned).
    Only its own methods change its state: staged, then told (posted),
    then over (gathered, failed or abandoned).
    """

    def __init__(
        self,
        sender: AsyncWeightSender,
        packet: Packet,
        worker_ids: list[int],
        reachable: list[int],
        failures: dict[int, WorkerError],
        deadline: float,
        started: float,
        staged_seconds: float,
        announce_seconds: float = 0.0,
        *,
        holds_the_sender: bool = True,
    ) -> None:
        self._sender = sender
        self.packet = packet
        #: The workers targeted.
        self.worker_ids: tuple[int, ...] = tuple(worker_ids)
        #: Those that announced themselves in time, and that are told.
        self.reachable = reachable
        self.failures = failures
        self.deadline = deadline
        self.started = started
        #: Reading and staging the weights (see :class:`SendReport`).
        self.staged_seconds = staged_seconds
        #: Waiting for the targets to announce themselves.
        self.announce_seconds = announce_seconds
        # The sends of a per-worker update that went before this one.
        self.earlier: tuple[SendReport, ...] = ()
        #: The workers that acked it so far.
        self.done: set[int] = set()
        # Whether this send gives the sender back when it is over (a
        # per-worker update's inner sends do not: the outer one does).
        self._holds = holds_the_sender
        self._posted = False
        self._waited = False
        self._over = False

    @property
    def version(self) -> int:
        """The version this send carries."""
        return self.packet.version

    @property
    def posted(self) -> bool:
        """Whether the reachable workers were told of it."""
        return self._posted

    def after(
        self,
        earlier: tuple[SendReport, ...],
        failures: dict[int, WorkerError],
        worker_ids: tuple[int, ...],
        started: float,
    ) -> None:
        """Make this the last send of a per-worker update to ``worker_ids``:
        it reports the ``earlier`` sends' bytes and ``failures`` with its
        own, and its times from ``started``."""
        self.earlier = earlier
        self.failures.update(failures)
        self.worker_ids = worker_ids
        self.started = started
        self.staged_seconds = time.perf_counter() - started

    def post(self) -> None:
        """Tell every reachable worker, without waiting; one whose pipe is
        full is told by ``deliver`` when the acks are gathered."""
        transports = self._sender.workers.transports
        for wid in self.reachable:
            try:
                transports[wid].post(self.packet)
            except WorkerError as exc:
                self.failures[wid] = exc
        self._posted = True

    def claim_wait(self) -> None:
        """Mark this send as waited for (its acks are being gathered).

        :raises WeightSyncStateError: it was already.
        """
        if self._waited:
            raise WeightSyncStateError(
                f"version {self.version} of model {self._sender.model_id!r} was already waited for",
                model_id=self._sender.model_id,
            )
        self._waited = True

    @property
    def waited(self) -> bool:
        """Whether its acks are (being) gathered, or it was abandoned."""
        return self._waited

    def settle(self) -> None:
        """Waited for and over: gathered without :meth:`wait` (the
        sender's loop-free driver), or given up."""
        self._waited = True
        self.end()

    def end(self) -> None:
        """The send is over: the sender may run the next one. Idempotent."""
        if not self._over:
            self._over = True
            if self._holds:
                self._sender._release()

    def abandon(self) -> None:
        """Give up a send that no worker was told of (before :meth:`wait`):
        the sender may run the next one."""
        assert not self._posted and not self._waited, "only a send not yet told or waited for"
        self.settle()

    def report(self) -> SendReport:
        """The report of this gathered send.

        :raises WorkerError: a worker failed (see :meth:`AsyncWeightSender.send`).
        """
        packet = self.packet
        if self.failures:
            raise combine_worker_errors(self.failures, model_id=self._sender.model_id, version=packet.version)
        return SendReport(
            packet.version,
            self.worker_ids,
            packet.nbytes + sum(r.nbytes for r in self.earlier),
            time.perf_counter() - self.started,
            self.staged_seconds,
            self.announce_seconds,
        )

    async def wait(self) -> SendReport:
        """Block until every targeted worker acked this version, or the
        send's deadline passed; its report.

        :raises WorkerLostError: a worker died; the others still got the update.
        :raises AckTimeoutError: a worker did not ack in time (also a TimeoutError).
        :raises WorkerApplyError: a worker failed to apply; carries its message.
        :raises WeightSyncStateError: awaited a second time.
        """
        self.claim_wait()
        return await self._sender._gather(self)


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
        self._wire = None if wire_dtype is None else WireCast(wire_dtype)
        #: Whether a send may give each worker weights of its own
        #: (``send({worker_id: weights, ...})``).
        self.per_worker_weights = per_worker_weights
        #: Whether sends carry digests that each worker checks (the default
        #: of ``send(verify=None)``).
        self.verify = verify
        self.strategy = strategy
        self.workers = Workers(transports, model_id, per_worker_weights)
        self.staging = staging
        # The staging's loop-free way to stage, where it has one.
        self._stage_now = staging.stage_now if isinstance(staging, LoopFreeStaging) else None
        self.context = context
        self.timeout = timeout
        self.version = 0
        self._packer = Packer(model_id, context, self._wire)
        self._acks = AckGather(self.workers.transports, model_id)
        # Held from a send's start until its PendingSend is over.
        self._busy = threading.Lock()
        self._closed = False

    @property
    def transports(self) -> dict[int, SenderTransport]:
        """Worker id -> the sender's channel to it."""
        return self.workers.transports

    @property
    def worker_ids(self) -> list[int]:
        return list(self.workers.transports)

    @property
    def worker_versions(self) -> dict[int, int | None]:
        """The last version each worker acked (None: none yet), by worker id."""
        return self.workers.versions

    def prepare(
        self, weights: Any = None, *, fanout: int = 1, keys: Keys | None = None, partial: bool = False
    ) -> Packet:
        """Extract ``weights`` (None: the context's model) into the next
        packet: all of them, or (``keys``) those named. The version is taken
        only once the packet is staged: a send rejected before anything
        moved does not use one up.

        :raises InvalidWeightsError: the weights hold something unsendable.
        :raises WeightMismatchError: ``keys`` names something the weights lack.
        :raises ValueError: ``keys`` selects nothing.
        """
        return self._packer.packet(self.version + 1, weights, fanout=fanout, keys=keys, partial=partial)

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
        self._check_open()
        targets = self.workers.targets(worker_ids)
        return await self._acks.announced(targets, self.timeout if timeout is None else timeout)

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
    ) -> SendReport:
        """Send weights and return once every targeted worker applied and acked them.

        ``weights``: None (the context's model), an ``nn.Module``, a
        ``TensorDict`` or a dict of tensors; with ``per_worker_weights``, also
        ``{worker_id: weights}``, each worker its own (one send per worker,
        one after the other, each its own version; the report names them
        all and carries the last version). ``worker_ids``: None (all), one id,
        or a list. ``timeout``: seconds for the whole send (default: the
        scheme's timeout). The weights may be changed again once this returns
        (already once they are staged: see :meth:`start_send`).

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
        pending = await self.start_send(
            weights, worker_ids, timeout=timeout, keys=keys, partial=partial, verify=verify
        )
        return await pending.wait()

    async def start_send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
        keys: Keys | None = None,
        partial: bool = False,
        verify: bool | None = None,
    ) -> PendingSend:
        """Start a send and return once the weights are staged: copied out
        of ``weights`` into the staging (a shared segment or slot, Ray's
        object store), so the caller may change them at once. Every
        targeted worker has been told; ``await pending.wait()`` gathers the
        acks. Until that returns, this sender runs no other send.

        Arguments as :meth:`send`; the deadline (``timeout``) runs from this
        call. Raises here what is found before anything moves (the
        ``ValueError``, ``UnknownWorkerError``, ``WeightMismatchError``,
        ``InvalidWeightsError``, ``ResourceExhaustedError`` and
        ``WeightSyncStateError`` of :meth:`send`); the workers' errors
        (``WorkerLostError``, ``AckTimeoutError``, ``WorkerApplyError``)
        come from :meth:`PendingSend.wait`.
        """
        self._check_open()
        self._claim()
        try:
            each = self.workers.per_worker(weights, worker_ids)
            if each is not None:
                return await self._stage_each(each, timeout, keys, partial, verify)
            return await self._stage(weights, worker_ids, timeout, keys, partial, verify)
        except BaseException:
            self._release()
            raise

    def _claim(self) -> None:
        """Take the sender for one send.

        :raises WeightSyncStateError: another send holds it.
        """
        if not self._busy.acquire(blocking=False):
            raise WeightSyncStateError(
                f"a send of model {self.model_id!r} is already in progress", model_id=self.model_id
            )

    def _release(self) -> None:
        self._busy.release()

    async def _stage_each(
        self,
        each: dict[int, Any],
        timeout: float | None,
        keys: Keys | None,
        partial: bool,
        verify: bool | None,
    ) -> PendingSend:
        """One send per worker, each with its own weights and version, one
        after the other: every staging is written once per send, so the
        next one waits for the acks of the last (a worker never copies
        another's weights). Returns once the last one is staged."""
        started = time.perf_counter()
        deadline = anyio.current_time() + (self.timeout if timeout is None else timeout)
        earlier: list[SendReport] = []
        failures: dict[int, WorkerError] = {}
        *first, last = each.items()
        for wid, weights in first:
            pending = await self._stage(
                weights, wid, deadline - anyio.current_time(), keys, partial, verify, holds=False
            )
            pending.claim_wait()
            try:
                earlier.append(await self._gather(pending))
            except WorkerError as exc:
                failures.update(exc.failures)
        pending = await self._stage(last[1], last[0], deadline - anyio.current_time(), keys, partial, verify)
        pending.after(tuple(earlier), failures, tuple(each), started)
        return pending

    async def _stage(
        self,
        weights: Any,
        worker_ids: int | Iterable[int] | None,
        timeout: float | None,
        keys: Keys | None = None,
        partial: bool = False,
        verify: bool | None = None,
        *,
        holds: bool = True,
    ) -> PendingSend:
        started = time.perf_counter()
        timeout = self.timeout if timeout is None else timeout
        targets = self.workers.targets(worker_ids)
        failures: dict[int, WorkerError] = {}
        # Every target's layout must be known before anything is staged, so a
        # mismatch is rejected with no worker touched. Workers still starting
        # are waited for first, up to the scheme's timeout, and the send's
        # deadline starts after that: a slow start is not taken for a slow
        # send.
        announce_seconds = 0.0
        if any(self.workers.transports[w].layout is None for w in targets):
            try:
                await self._acks.announced(targets, self.timeout, self.version + 1)
            except WorkerError as exc:
                failures.update(exc.failures)
            announce_seconds = time.perf_counter() - started
        staging_started = time.perf_counter()
        deadline = anyio.current_time() + timeout
        packet, reachable = self._read(weights, targets, failures, keys, partial)
        if reachable:
            verifying = self.verify if verify is None else verify
            packet = self._staged(await self._packer.stage(packet, self.staging, verifying))
        staged = time.perf_counter() - staging_started
        return PendingSend(
            self,
            packet,
            targets,
            reachable,
            failures,
            deadline,
            started,
            staged,
            announce_seconds,
            holds_the_sender=holds,
        )

    def _read(
        self,
        weights: Any,
        targets: list[int],
        failures: dict[int, WorkerError],
        keys: Keys | None,
        partial: bool,
    ) -> tuple[Packet, list[int]]:
        """The next packet of ``weights``, and the targets (but those that
        ``failures`` names) it goes to, once it fits every one of them.

        :raises WeightMismatchError: it does not fit one (nothing was sent).
        :raises: what :meth:`prepare` and ``Workers.check_layouts`` raise.
        """
        packet = self.prepare(weights, fanout=len(targets), keys=keys, partial=partial)
        return packet, self.workers.check_layouts(packet, [w for w in targets if w not in failures])

    def _staged(self, packet: Packet) -> Packet:
        """``packet``, staged: its version is used (bytes moved), and it lets
        go of the caller's tensors (each worker reads the staging now)."""
        self.version = packet.version
        return dataclasses.replace(packet, tensors=())

    def start_send_now(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
        keys: Keys | None = None,
        partial: bool = False,
        verify: bool | None = None,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> PendingSend | NeedsLoop:
        """:meth:`start_send` on the calling thread with no event loop, where
        no step needs one: the staging stages on the calling thread (a
        :class:`LoopFreeStaging`), every target has announced its layout,
        the weights are the same for every target, with no wire dtype and no
        digests. Returns :data:`NEEDS_LOOP`, having changed nothing, where
        one of these does not hold (run :meth:`start_send` instead).

        Blocks for the copy. Where ``interrupted()`` is true once the copy is
        done, the send is abandoned before any worker is told, and
        KeyboardInterrupt raised. Raises what :meth:`start_send` raises.
        """
        stage_now = self._stage_now
        verifying = self.verify if verify is None else verify
        if self._closed or stage_now is None or self._wire is not None or verifying:
            return NEEDS_LOOP
        if self.workers.per_worker(weights, worker_ids) is not None:
            return NEEDS_LOOP
        targets = self.workers.targets(worker_ids)
        if any(self.workers.transports[w].layout is None for w in targets):
            return NEEDS_LOOP  # (announcing waits)
        self._claim()
        try:
            started = time.perf_counter()
            # (The loop's clock is this one: a send finished in a loop keeps its deadline.)
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            packet, reachable = self._read(weights, targets, {}, keys, partial)
            if reachable:
                stage_now(packet)
                packet = self._staged(packet)
            if interrupted():
                raise KeyboardInterrupt  # (nobody would wait for the send)
        except BaseException:
            self._release()
            raise
        staged = time.perf_counter() - started
        return PendingSend(self, packet, targets, reachable, {}, deadline, started, staged)

    def finish_now(
        self, pending: PendingSend, *, interrupted: Callable[[], bool] = lambda: False
    ) -> SendReport | PendingSend | NeedsLoop:
        """``await pending.wait()`` on the calling thread with no event loop:
        tells the workers and waits for their acks in one poll, for a caller
        that blocks on it anyway. Returns the report once every target
        acked; :data:`NEEDS_LOOP`, having changed nothing, where the
        sender's staging is not one that stages on the calling thread (run
        ``pending.wait()`` instead); or ``pending`` itself, its workers
        told, where an ack needs the loop after all (a worker without a
        pidfd, or restarted mid-send, a full pipe): finish it with
        ``await pending.wait()``.

        Blocks until the acks are in or the deadline passes. Looks at
        ``interrupted()`` at least every 50 ms; once it is true, the send is
        abandoned as a cancelled one is, and KeyboardInterrupt raised.
        Raises what :meth:`PendingSend.wait` raises.
        """
        if self._stage_now is None or pending.posted or pending.waited:
            return NEEDS_LOOP
        packet = pending.packet
        try:
            pending.post()
            rest = [w for w in pending.reachable if w not in pending.failures]
            watched = self._acks.watchable(rest, packet)
            if len(watched) >= len(rest):
                spilled = self._acks.await_acks_now(
                    watched, packet, pending.failures, pending.done, pending.deadline, interrupted
                )
                if not spilled:
                    self._acks.late(
                        rest, pending.done, pending.failures, f"ack version {packet.version}", packet.version
                    )
                    self._record(pending)
                    pending.settle()
                    return pending.report()
        except BaseException:
            pending.settle()
            raise
        # An ack needs the loop after all: the loop tells those workers again
        # and gathers the rest (what came in already stays taken).
        return pending

    def _record(self, pending: PendingSend) -> None:
        """Remember which workers acked ``pending``'s version."""
        self.workers.record(pending.packet, pending.reachable, pending.failures)

    async def _gather(self, pending: PendingSend) -> SendReport:
        """Tell the workers of ``pending`` (if not yet) and gather their acks
        (those not in yet); its report. The send is over once this returns."""
        packet, failures, reachable = pending.packet, pending.failures, pending.reachable
        try:
            if reachable:
                # Notify every worker first, so none waits for the task
                # group's bookkeeping; the tasks then only gather the acks.
                # (Not before the caller got its weights back: on a machine
                # with few cores, the workers this wakes would hold the
                # caller up.)
                if not pending.posted:
                    pending.post()
                await self._acks.fan_out(
                    [w for w in reachable if w not in failures and w not in pending.done],
                    lambda t: t.deliver(packet),
                    pending.deadline,
                    failures,
                    f"ack version {packet.version}",
                    packet.version,
                    acks_of=packet,
                )
                self._record(pending)
        finally:
            pending.end()
        return pending.report()

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
        self._check_open()
        if not self._busy.acquire(blocking=False):
            raise WeightSyncStateError(
                f"{what} while a send of model {self.model_id!r} is running", model_id=self.model_id
            )
        try:
            yield
        finally:
            self._busy.release()

    def _check_open(self) -> None:
        require_asyncio(self.model_id)
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
            for transport in self.workers.transports.values():
                await transport.aclose()
            if self.staging is not None:
                await self.staging.aclose()
            self._acks.close()
