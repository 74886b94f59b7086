"""One send: its options, its plan, its state once staged, and its report.

A send is planned once (:class:`SendPlan`: the targets, whose weights, which
steps it needs), staged by one of the sender's two drivers, and then is a
:class:`PendingSend` until its acks are gathered, again by one of two
drivers over the same steps: the coroutine :meth:`PendingSend.wait`, or
:meth:`PendingSend.wait_now` on the calling thread with no event loop
(pipes only). Nothing outside a :class:`PendingSend` changes its state.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import anyio

from ._acks import AckGather
from ._exceptions import WeightSyncStateError, WorkerError, combine_worker_errors
from ._packet import Packet
from ._packing import Keys, Packer
from ._placement import caller_stream
from ._targets import Workers
from ._transports._base import ChannelTransport, LoopFreeStaging, Outgoing, SendHandler, Staging

__all__ = ["Claim", "Keys", "PendingSend", "SendOptions", "SendPlan", "SendReport", "Stager"]


@dataclass(frozen=True)
class SendOptions:
    """A send's own parameters, as the caller gave them (see
    ``AsyncWeightSender.send``): None takes the scheme's default."""

    timeout: float | None = None
    keys: Keys | None = None
    partial: bool = False
    verify: bool | None = None


class Claim:
    """A sender held for one send: taken when the send is planned, given
    back by the first call (later ones do nothing), from whichever step
    ends the send."""

    def __init__(self, busy: threading.Lock) -> None:
        self._busy: threading.Lock | None = busy

    def __call__(self) -> None:
        busy, self._busy = self._busy, None
        if busy is not None:
            busy.release()


@dataclass(frozen=True)
class SendPlan:
    """What one send will do, decided before anything moves: made by
    ``AsyncWeightSender.plan`` and run by either of its drivers, so no step
    is decided twice."""

    #: The workers targeted, each once, in order.
    targets: list[int]
    #: The weights (None: the context's model); unused where ``each`` is set.
    weights: Any
    #: {worker id: its own weights} for a per-worker update, else None.
    each: dict[int, Any] | None
    options: SendOptions
    #: The send's deadline, in seconds from when its targets have announced themselves.
    timeout: float
    #: Whether tensors are digested and checked by the workers.
    verify: bool
    #: Whether a target has not announced its layout yet (the send waits for it first).
    announce: bool
    #: Whether every step can run on the calling thread with no event loop:
    #: the staging stages there, the same weights go to every target, all
    #: announced, no cast and no digests.
    loop_free: bool
    #: Gives the sender back (idempotent): the send is over, or failed
    #: before it was staged.
    release: Claim
    #: The caller's CUDA stream (``_placement.caller_stream``): copies out
    #: of tensors on a GPU follow the work enqueued on it before the send.
    stream: Any = None


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
    #: ``AsyncWeightSender.wait_for_workers``). Not part of the send's
    #: ``timeout``, which starts once they have.
    announce_seconds: float = 0.0
    #: How the weights reached each worker, from where the trainer's tensors
    #: and that worker's model are: ``"host"`` (both in host memory),
    #: ``"device-to-host"`` (trainer on a GPU, worker on the CPU),
    #: ``"host-to-device"``, ``"same-device"`` (one GPU), ``"peer"`` (two
    #: GPUs), ``"mixed"`` (a side over several devices), by worker id.
    placements: Mapping[int, str] = field(default_factory=dict)


class PendingSend:
    """A send whose weights are staged, its acks still to come; made by
    ``AsyncWeightSender.start_send``.

    The caller's weights are no longer read: change them at will. Await
    :meth:`wait` once (the sender runs no other send until it returned).
    Only its own methods change its state: staged, then told (posted),
    then over (gathered, failed or abandoned).
    """

    def __init__(
        self,
        workers: Workers,
        acks: AckGather,
        release: Callable[[], None] | None,
        packet: Packet,
        targets: list[int],
        loop_free: bool,
        handler: SendHandler | None,
        reachable: list[int],
        failures: dict[int, WorkerError],
        deadline: float,
        started: float,
        staged_seconds: float,
        announce_seconds: float = 0.0,
    ) -> None:
        self._workers, self._acks = workers, acks
        # Gives the sender back once this send is over (None: a per-worker
        # update's inner send, whose outer one does).
        self._release = release
        self.packet = packet
        #: The workers targeted.
        self.worker_ids: tuple[int, ...] = tuple(targets)
        self._loop_free = loop_free
        # The staging that carries the send to its workers, if it does (a chain).
        self._handler = handler
        #: Those that announced themselves in time, and that are told.
        self.reachable = reachable
        self.failures = failures
        #: The loop's clock (``time.monotonic()``, which anyio's asyncio backend uses).
        self.deadline = deadline
        self.started = started
        #: Reading and staging the weights (see :class:`SendReport`).
        self.staged_seconds = staged_seconds
        #: Waiting for the targets to announce themselves.
        self.announce_seconds = announce_seconds
        # The sends of a per-worker update that went before this one.
        self._earlier: tuple[SendReport, ...] = ()
        #: The workers that acked it so far.
        self.done: set[int] = set()
        self._posted = False
        self._waited = False
        self._over = False

    @property
    def version(self) -> int:
        """The version this send carries."""
        return self.packet.version

    @property
    def _model_id(self) -> str | None:
        return self._workers.model_id

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
        self._earlier = earlier
        self.failures.update(failures)
        self.worker_ids = worker_ids
        self.started = started
        self.staged_seconds = time.perf_counter() - started

    def abandon(self) -> None:
        """Give up a send that no worker was told of (before :meth:`wait`):
        the sender may run the next one."""
        assert not self._posted and not self._waited, "only a send not yet told or waited for"
        self._waited = True
        self._end()

    def _end(self) -> None:
        """The send is over: the sender may run the next one. Idempotent."""
        if not self._over:
            self._over = True
            if self._release is not None:
                self._release()

    def _claim_wait(self) -> None:
        if self._waited:
            raise WeightSyncStateError(
                f"version {self.version} of model {self._model_id!r} was already waited for",
                model_id=self._model_id,
            )
        self._waited = True

    def _post(self) -> None:
        """Tell every reachable worker, without waiting; one whose pipe is
        full is told by ``deliver`` when the acks are gathered."""
        transports = self._acks.channels
        for wid in self.reachable:
            try:
                transports[wid].post(self.packet)
            except WorkerError as exc:
                self.failures[wid] = exc
        self._posted = True

    def _report(self) -> SendReport:
        """Record who acked; the report of this gathered send.

        :raises WorkerError: a worker failed (see ``AsyncWeightSender.send``).
        """
        packet = self.packet
        if self.reachable:
            self._workers.record(packet, self.reachable, self.failures)
        if self.failures:
            raise combine_worker_errors(self.failures, model_id=self._model_id, version=packet.version)
        placements = {w: p for r in self._earlier for w, p in r.placements.items()}
        placements.update(self._workers.placements(packet, self.reachable))
        return SendReport(
            packet.version,
            self.worker_ids,
            packet.nbytes + sum(r.nbytes for r in self._earlier),
            time.perf_counter() - self.started,
            self.staged_seconds,
            self.announce_seconds,
            placements,
        )

    def _awaited(self) -> list[int]:
        """The reachable workers whose answer is still to come."""
        return [w for w in self.reachable if w not in self.failures and w not in self.done]

    async def wait(self) -> SendReport:
        """Block until every targeted worker acked this version, or the
        send's deadline passed; its report.

        :raises WorkerLostError: a worker died; the others still got the update.
        :raises AckTimeoutError: a worker did not ack in time (also a TimeoutError).
        :raises WorkerApplyError: a worker failed to apply; carries its message.
        :raises WeightSyncStateError: awaited a second time.
        """
        self._claim_wait()
        packet = self.packet
        what = f"ack version {packet.version}"
        try:
            if self.reachable and self._handler is not None:
                # The staging carries the send to all its workers at once (a chain).
                send = Outgoing(packet, self._awaited(), self.deadline, self.done, self.failures)
                await self._acks.handed_over(self._handler, send, what)
            elif self.reachable:
                # Notify every worker first, so none waits for the task
                # group's bookkeeping; the tasks then only gather the acks.
                # (Not before the caller got its weights back: on a machine
                # with few cores, the workers this wakes would hold the
                # caller up.)
                if not self._posted:
                    self._post()
                await self._acks.fan_out(
                    self._awaited(),
                    lambda t: cast(ChannelTransport, t).deliver(packet),
                    self.deadline,
                    self.failures,
                    what,
                    packet.version,
                    acks_of=packet,
                )
            return self._report()
        finally:
            self._end()

    def wait_now(self, interrupted: Callable[[], bool] = lambda: False) -> SendReport | None:
        """:meth:`wait` on the calling thread with no event loop, for a
        caller that blocks on it anyway: tells the workers and waits for
        their acks in one poll. Returns the report once every target acked,
        or None where an ack needs the loop (the send was not staged for a
        loop-free send, or a worker has no pidfd, was restarted mid-send,
        its pipe is full): finish it then with ``await wait()``, which takes
        up where this left off.

        Blocks until the acks are in or the deadline passes. Looks at
        ``interrupted()`` at least every 50 ms; once it is true, the send is
        abandoned as a cancelled one is, and KeyboardInterrupt raised.
        Raises what :meth:`wait` raises.
        """
        if not self._loop_free or self._posted or self._waited:
            return None
        packet = self.packet
        try:
            self._post()
            rest = self._awaited()
            watched = self._acks.watchable(rest, packet)
            if len(watched) < len(rest):
                return None
            spilled = self._acks.await_acks_now(
                watched, packet, self.failures, self.done, self.deadline, interrupted
            )
            if spilled:
                return None
            self._acks.late(rest, self.done, self.failures, f"ack version {packet.version}", packet.version)
            self._waited = True
            try:
                return self._report()
            finally:
                self._end()
        except BaseException:
            self._waited = True
            self._end()
            raise


class Stager:
    """Plans a sender's sends and stages them: the one decision, and its
    two drivers (a coroutine, and the calling thread with no event loop),
    over steps written once. Keeps the version counter: a version is used
    once bytes moved."""

    def __init__(
        self,
        workers: Workers,
        acks: AckGather,
        packer: Packer,
        staging: Staging | None,
        *,
        timeout: float,
        verify: bool,
        cast: bool,
    ) -> None:
        self.workers, self._acks, self._packer, self.staging = workers, acks, packer, staging
        # The staging's loop-free way to stage, where it has one.
        self._stage_now = staging.stage_now if isinstance(staging, LoopFreeStaging) else None
        # The staging that carries whole sends, where it does (a chain); else
        # each worker's channel carries its own.
        self._handler = staging if isinstance(staging, SendHandler) else None
        if self._handler is None:
            odd = [w for w, t in workers.transports.items() if not isinstance(t, ChannelTransport)]
            if odd:
                raise TypeError(
                    f"the transports of worker(s) {odd} carry no send (no post/deliver), and the "
                    "staging carries none either (no handle_send)"
                )
        self.timeout = timeout
        self.verify = verify
        self._cast = cast
        #: The last version staged (0: none yet).
        self.version = 0
        #: Held from a send's plan until it is over.
        self.busy = threading.Lock()

    # -- the decision --------------------------------------------------------
    def plan(self, weights: Any, worker_ids: int | Iterable[int] | None, options: SendOptions) -> SendPlan:
        """Decide what a send of ``weights`` to ``worker_ids`` does, and take
        the sender for it: the plan must then go to :meth:`stage` or
        :meth:`stage_now` (or its ``release``), which give the sender back
        once the send is over or failed. Never blocks; touches no worker.

        :raises WeightSyncStateError: another send is running.
        :raises ValueError, UnknownWorkerError: as ``AsyncWeightSender.send``
            (the sender is not taken).
        """
        each = self.workers.per_worker(weights, worker_ids)
        targets = list(each) if each is not None else self.workers.targets(worker_ids)
        verifying = self.verify if options.verify is None else options.verify
        announce = any(self.workers.transports[w].layout is None for w in targets)
        loop_free = (
            self._stage_now is not None and each is None and not announce and not self._cast and not verifying
        )
        if not self.busy.acquire(blocking=False):
            raise WeightSyncStateError(
                f"a send of model {self.workers.model_id!r} is already in progress",
                model_id=self.workers.model_id,
            )
        timeout = self.timeout if options.timeout is None else options.timeout
        return SendPlan(
            targets,
            weights,
            each,
            options,
            timeout,
            verifying,
            announce,
            loop_free,
            Claim(self.busy),
            caller_stream(),
        )

    # -- the two drivers -----------------------------------------------------
    async def stage(self, plan: SendPlan) -> PendingSend:
        """Stage the send ``plan`` decided, in the running loop: wait for
        targets still starting, read, cast, stage and digest the weights.
        Returns once they are staged; on an error the
        sender is given back.

        :raises: what ``AsyncWeightSender.start_send`` raises.
        """
        try:
            if plan.each is not None:
                return await self._stage_each(plan)
            return await self._stage_one(plan, plan.weights, plan.targets, plan.timeout, plan.release)
        except BaseException:
            plan.release()
            raise

    def stage_now(self, plan: SendPlan, *, interrupted: Callable[[], bool] = lambda: False) -> PendingSend:
        """:meth:`stage` on the calling thread with no event loop, for a
        ``plan`` that is ``loop_free``. Blocks for the copy. Where
        ``interrupted()`` is true once the copy is done, the send is
        abandoned before any worker is told, and KeyboardInterrupt raised.

        :raises: what ``AsyncWeightSender.start_send`` raises.
        """
        assert plan.loop_free and self._stage_now is not None, "a loop-free plan only"
        try:
            started = time.perf_counter()
            # (The loop's clock is this one: a send finished in a loop keeps its deadline.)
            deadline = time.monotonic() + plan.timeout
            packet, reachable = self._read(plan, plan.weights, plan.targets, {})
            if reachable:
                self._stage_now(packet)
                packet = self._staged(packet)
            if interrupted():
                raise KeyboardInterrupt  # (nobody would wait for the send)
        except BaseException:
            plan.release()
            raise
        return self._pending(plan, packet, reachable, {}, deadline, started, time.perf_counter() - started)

    # -- the steps, written once --------------------------------------------
    async def _stage_each(self, plan: SendPlan) -> PendingSend:
        """One send per worker, each with its own weights and version, one
        after the other: every staging is written once per send, so the
        next one waits for the acks of the last (a worker never copies
        another's weights). Returns once the last one is staged."""
        assert plan.each is not None
        started = time.perf_counter()
        deadline = anyio.current_time() + plan.timeout
        earlier: list[SendReport] = []
        failures: dict[int, WorkerError] = {}
        *first, (last, weights) = plan.each.items()
        for wid, own in first:
            pending = await self._stage_one(plan, own, [wid], deadline - anyio.current_time(), None)
            try:
                earlier.append(await pending.wait())
            except WorkerError as exc:
                failures.update(exc.failures)
        pending = await self._stage_one(plan, weights, [last], deadline - anyio.current_time(), plan.release)
        pending.after(tuple(earlier), failures, tuple(plan.each), started)
        return pending

    async def _stage_one(
        self,
        plan: SendPlan,
        weights: Any,
        targets: list[int],
        timeout: float,
        release: Callable[[], None] | None,
    ) -> PendingSend:
        started = time.perf_counter()
        failures: dict[int, WorkerError] = {}
        # Every target's layout must be known before anything is staged, so a
        # mismatch is rejected with no worker touched. Workers still starting
        # are waited for first, up to the scheme's timeout, and the send's
        # deadline starts after that: a slow start is not taken for a slow
        # send.
        announce_seconds = 0.0
        if plan.announce and any(self.workers.transports[w].layout is None for w in targets):
            try:
                await self._acks.announced(targets, self.timeout, self.version + 1)
            except WorkerError as exc:
                failures.update(exc.failures)
            announce_seconds = time.perf_counter() - started
        staging_started = time.perf_counter()
        deadline = anyio.current_time() + timeout
        packet, reachable = self._read(plan, weights, targets, failures)
        if reachable:
            packet = self._staged(await self._packer.stage(packet, self.staging, plan.verify))
        staged = time.perf_counter() - staging_started
        return self._pending(
            plan,
            packet,
            reachable,
            failures,
            deadline,
            started,
            staged,
            announce_seconds,
            release=release,
            targets=targets,
        )

    def _read(
        self, plan: SendPlan, weights: Any, targets: list[int], failures: dict[int, WorkerError]
    ) -> tuple[Packet, list[int]]:
        """The next packet of ``weights``, and the targets (but those that
        ``failures`` names) it goes to, once it fits every one of them.

        :raises WeightMismatchError: it does not fit one (nothing was sent).
        :raises: what ``Packer.packet`` and ``Workers.check_layouts`` raise.
        """
        options = plan.options
        packet = self._packer.packet(
            self.version + 1,
            weights,
            fanout=len(targets),
            keys=options.keys,
            partial=options.partial,
            stream=plan.stream,
        )
        return packet, self.workers.check_layouts(packet, [w for w in targets if w not in failures])

    def _staged(self, packet: Packet) -> Packet:
        """``packet``, staged: its version is used (bytes moved), and it lets
        go of the caller's tensors (each worker reads the staging now)."""
        self.version = packet.version
        return dataclasses.replace(packet, tensors=())

    def _pending(
        self,
        plan: SendPlan,
        packet: Packet,
        reachable: list[int],
        failures: dict[int, WorkerError],
        deadline: float,
        started: float,
        staged: float,
        announce_seconds: float = 0.0,
        *,
        release: Callable[[], None] | None = None,
        targets: list[int] | None = None,
    ) -> PendingSend:
        """The staged send; it gives the sender back with ``release`` (the
        plan's where ``targets`` are the plan's)."""
        if targets is None:
            targets, release = plan.targets, plan.release
        return PendingSend(
            self.workers,
            self._acks,
            release,
            packet,
            targets,
            plan.loop_free,
            self._handler,
            reachable,
            failures,
            deadline,
            started,
            staged,
            announce_seconds,
        )
