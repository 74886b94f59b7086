"""One send, as an I/O-free state machine, and what it reports.

A :class:`SendMachine` owns everything one send decides and learns: its
targets and each one's weights, its options, the version, the deadline,
how each worker is reached (its placement), who acked, who failed, and the
report. It performs no I/O and never waits. It yields *actions* (write the
staging, post to these channels, wait on these descriptors until then,
deliver to these, hand the whole send to its handler) and a driver
(``_drive``: a coroutine, or the calling thread with no event loop)
performs each and feeds the result back, until the machine returns its
:class:`Done`. The machine is fed results, never reaches into a transport to
change it, and is the only writer of a send's state: a handler that carries
a whole send (a chain) reports each worker's answer through the
:class:`~._transports._base.Outgoing` the machine hands it.

The sender keeps what outlives one send (:class:`Sends`): the version
counter, its defaults, and the lock that lets one send run at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._exceptions import AckTimeoutError, WeightSyncStateError, WorkerError, combine_worker_errors
from ._memory._placement import Placement, caller_stream, route
from ._packet import Packet
from ._packing import Keys, Packer
from ._targets import Workers

__all__ = [
    "STAGED",
    "Action",
    "Announce",
    "Deliver",
    "Done",
    "HandOver",
    "Keys",
    "Listen",
    "Post",
    "SendMachine",
    "SendOptions",
    "SendReport",
    "Sends",
    "Staged",
    "Write",
]


@dataclass(frozen=True)
class SendOptions:
    """A send's own parameters, as the caller gave them (see
    ``AsyncWeightSender.send``, whose names they keep): None takes the
    scheme's default."""

    timeout: float | None = None
    keys: Keys | None = None
    partial: bool = False
    verify: bool | None = None


#: The options of a send that gives none.
DEFAULTS = SendOptions()


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
    #: ``AsyncWeightSender.wait_for_workers``). Part of ``seconds``, and of
    #: the send's ``timeout``.
    announce_seconds: float = 0.0
    #: How the weights reached each worker (``_placement.Placement``):
    #: ``"host"`` (both in host memory), ``"device-to-host"`` (trainer on a
    #: GPU, worker on the CPU), ``"host-to-device"``, ``"same-device"`` (one
    #: GPU, device to device), ``"peer"`` (two GPUs, device to device),
    #: ``"through-host"`` (both on GPUs, through host memory: a verified
    #: send, a worker that cannot reach the trainer's GPU, or a scheme that
    #: stages in host memory), ``"mixed"`` (a side over several devices), by
    #: worker id.
    placements: Mapping[int, str] = field(default_factory=dict)


# -- the actions a driver performs ---------------------------------------------------
#
# Each names what the driver does and what it feeds back. Only Announce,
# Deliver and HandOver need an event loop (their steps are coroutines of a
# transport); the blocking driver runs the others on the calling thread.


class Announce(NamedTuple):
    """Wait (up to ``timeout`` seconds: what is left of the send's deadline)
    until every one of ``targets`` has announced itself. Feed back {worker:
    its WorkerError} for those that died or were late (empty: all did);
    ``limit`` names the timeout that applied, for the error."""

    targets: list[int]
    timeout: float
    version: int
    limit: str


class Write(NamedTuple):
    """Cast, stage and (``verify``) digest ``packet``: one blocking write,
    run inline or on a worker thread. ``placements`` says how each worker
    of the send reads it. Feed back the packet as staged
    (``Packer.stage``)."""

    packet: Packet
    verify: bool
    placements: Mapping[int, Placement]


class Staged(NamedTuple):
    """The weights are staged and no longer read: a driver asked to stop
    here (``send_async()``) returns. Feed back None."""


#: The one :class:`Staged` action.
STAGED = Staged()


class Post(NamedTuple):
    """Tell each of ``worker_ids`` (channels) of ``packet`` without waiting.
    Feed back, per worker, what to wait on for its ack: its descriptors,
    None (only a :class:`Deliver` reaches it: its pipe was full, or it is
    not watched by descriptor), or the WorkerError it failed with."""

    packet: Packet
    worker_ids: list[int]


class Listen(NamedTuple):
    """Wait until one of ``watched``'s descriptors is readable or
    ``deadline`` (``time.monotonic()``) passes, then take, without waiting,
    what each worker whose descriptors are ready sent. Feed back, per worker
    heard from: True (acked ``packet``), False (not yet), None (it needs a
    :class:`Deliver`: restarted mid-send) or its WorkerError; empty when
    nothing came before the deadline."""

    packet: Packet
    watched: Mapping[int, tuple[int, ...]]
    deadline: float


class Deliver(NamedTuple):
    """Deliver ``packet`` to each of ``worker_ids`` (a channel's own
    coroutine), all at once, until ``deadline``. Feed back {worker: None
    (acked) or its WorkerError}; a worker missing had not answered by the
    deadline."""

    packet: Packet
    worker_ids: list[int]
    deadline: float


class HandOver(NamedTuple):
    """Have the staging's handler carry ``send`` (a chain), until
    ``deadline``; the handler reports through ``send``. Feed back None."""

    send: _Outgoing
    deadline: float


class Done(NamedTuple):
    """The send is over; its report."""

    report: SendReport


Action = Announce | Write | Staged | Post | Listen | Deliver | HandOver | Done


class Sends:
    """What a sender keeps from send to send: its workers, its packer, its
    defaults, the version counter (a version is used once bytes moved) and
    the lock that one running send holds."""

    def __init__(
        self,
        workers: Workers,
        packer: Packer,
        *,
        timeout: float,
        verify: bool,
        handler: bool,
        on_device: bool,
    ) -> None:
        self.workers, self.packer = workers, packer
        self.timeout, self.verify = timeout, verify
        #: Whether the staging carries whole sends (a chain) rather than
        #: each worker's channel its own.
        self.handler = handler
        #: Whether the staging can stage on the trainer's GPU for workers
        #: that read it device to device.
        self.on_device = on_device
        #: The last version staged (0: none yet).
        self.version = 0
        #: Held by the send that runs (and by a membership change).
        self.busy = threading.Lock()


class _Outgoing:
    """A send as its handler (a chain) sees it: the staged packet, the
    workers to tell, the deadline, and where each answer goes. Implements
    ``_transports._base.Outgoing``; only the machine's own state changes."""

    __slots__ = ("_machine", "deadline", "packet", "worker_ids")

    def __init__(self, machine: SendMachine, packet: Packet, worker_ids: list[int], deadline: float) -> None:
        self._machine = machine
        self.packet = packet
        self.worker_ids = worker_ids
        self.deadline = deadline

    def ack(self, worker_id: int) -> None:
        """Worker ``worker_id`` acked this send's version."""
        self._machine._answered(worker_id, True)

    def fail(self, worker_id: int, error: WorkerError) -> None:
        """Worker ``worker_id`` failed (died, or could not apply it)."""
        self._machine._answered(worker_id, error)

    @property
    def acked(self) -> frozenset[int]:
        """The workers that acked this send so far (or in all, once it is over)."""
        return frozenset(w for w in self.worker_ids if w in self._machine.acked)


class SendMachine:
    """One send of ``weights`` to ``worker_ids``: an I/O-free state machine
    (see the module's docstring). Made on the caller's thread, it takes the
    sender (one send at a time) and raises at once, having taken nothing,
    for what is wrong before any weight is read.

    Drive it with :meth:`start`, then :meth:`feed` each action's result,
    until a :class:`Done`. Errors of the send (weights that do not fit,
    workers that failed) are raised by :meth:`feed` (or :meth:`start`);
    :meth:`close` abandons it. Either way the sender is given back once,
    when the machine ends.

    :raises WeightSyncStateError: another send is running.
    :raises ValueError, UnknownWorkerError: bad ``worker_ids`` or per-worker weights.
    """

    def __init__(
        self,
        sends: Sends,
        weights: Any,
        worker_ids: int | Iterable[int] | None,
        options: SendOptions = DEFAULTS,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        workers = sends.workers
        self._sends, self._workers, self._clock = sends, workers, clock
        self._each = workers.per_worker(weights, worker_ids)
        self.worker_ids: tuple[int, ...] = tuple(
            self._each if self._each is not None else workers.targets(worker_ids)
        )
        self._weights, self.options = weights, options
        self.verify = sends.verify if options.verify is None else options.verify
        self.timeout = sends.timeout if options.timeout is None else options.timeout
        # The caller's CUDA stream, taken on its thread: copies out of the
        # trainer's tensors follow the work it enqueued before the send.
        self._stream = caller_stream()
        if not sends.busy.acquire(blocking=False):
            raise WeightSyncStateError(
                f"a send of model {workers.model_id!r} is already in progress", model_id=workers.model_id
            )
        self._busy: threading.Lock | None = sends.busy
        self._started = time.perf_counter()
        #: The version of the last packet read (0 before).
        self.version = 0
        #: Workers that acked, and workers that failed, with their errors.
        self.acked: set[int] = set()
        self.failures: dict[int, WorkerError] = {}
        #: How each worker was reached (``Placement`` values), by worker id.
        self.placements: dict[int, str] = {}
        #: When the send stops waiting (``clock()``): one deadline for all of
        #: it, workers still announcing themselves included.
        self.deadline: float = clock() + self.timeout
        self.nbytes = 0
        self.staged_seconds = 0.0
        self.announce_seconds = 0.0
        self._steps = self._run()

    @property
    def model_id(self) -> str | None:
        return self._workers.model_id

    # -- the driver's side ------------------------------------------------------
    def start(self) -> Action:
        """The first action."""
        return self._next(None)

    def feed(self, result: Any) -> Action:
        """The result of the last action; the next one.

        :raises: the send's errors (see ``AsyncWeightSender.send``); the
            machine is then over.
        """
        return self._next(result)

    def _next(self, result: Any) -> Action:
        try:
            return self._steps.send(result)
        except StopIteration as stop:
            return Done(stop.value)

    def close(self) -> None:
        """Abandon the send where it is (the driver was interrupted or
        cancelled): nothing more is done for it, and the sender is given
        back. Idempotent; a no-op once the machine is over."""
        self._steps.close()
        self._release()

    def _release(self) -> None:
        busy, self._busy = self._busy, None
        if busy is not None:
            busy.release()

    # -- the send -------------------------------------------------------------------
    def _run(self) -> Generator[Action, Any, SendReport]:
        try:
            if self._each is None:
                yield from self._leg(self._weights, list(self.worker_ids), last=True)
            else:
                # One leg per worker, each with its own weights and version,
                # one after the other: every staging is written once per
                # send, so a leg waits for the acks of the one before (a
                # worker never copies another's weights).
                *first, (final, weights) = self._each.items()
                for wid, own in first:
                    yield from self._leg(own, [wid], last=False)
                yield from self._leg(weights, [final], last=True)
            return self._report()
        finally:
            self._release()

    def _leg(self, weights: Any, targets: list[int], *, last: bool) -> Generator[Action, Any, None]:
        """Send ``weights`` to ``targets``: announce, read, stage, tell, gather."""
        sends, workers = self._sends, self._workers
        transports = workers.transports
        started = time.perf_counter()
        # Every target's layout must be known before anything is staged, so a
        # mismatch is refused with no worker touched. Workers still starting
        # are waited for first, within the send's one deadline.
        for wid in targets:
            if transports[wid].layout is None:
                left = max(self.deadline - self._clock(), 0.0)
                limit = f"the send's timeout of {self.timeout:g} s"
                self.failures.update((yield Announce(targets, left, sends.version + 1, limit)))
                self.announce_seconds += time.perf_counter() - started
                break
        staging_started = time.perf_counter()
        options = self.options
        packet = sends.packer.packet(
            sends.version + 1,
            weights,
            fanout=len(targets),
            keys=options.keys,
            partial=options.partial,
            stream=self._stream,
        )
        self.version = packet.version
        reachable = workers.check_layouts(packet, [w for w in targets if w not in self.failures])
        # How each one is reached: decided here, once, for the staging and the report.
        placements = {
            w: route(
                packet.devices,
                transports[w].devices,
                transports[w].reach,
                device_staging=sends.on_device and not self.verify,
            )
            for w in reachable
        }
        if reachable:
            packet = yield Write(packet, self.verify, placements)
            sends.version = packet.version  # bytes moved: the version is used
            self.nbytes += packet.nbytes
        if last:
            self.staged_seconds = time.perf_counter() - (staging_started if self._each is None else started)
            yield STAGED
        if not reachable:
            return
        yield from (self._hand_over if sends.handler else self._gather)(packet, reachable)
        self._late(packet, reachable)
        workers.record(packet, reachable, [w for w in reachable if w in self.failures])
        self.placements.update((w, p.value) for w, p in placements.items())

    def _gather(self, packet: Packet, reachable: list[int]) -> Generator[Action, Any, None]:
        """Tell every reachable worker, then gather their acks: by
        descriptor, one wakeup for any number of them, and through each
        channel's own delivery where that is all that reaches it."""
        deadline = self.deadline
        told = yield Post(packet, [w for w in reachable if w not in self.failures])
        watched: dict[int, tuple[int, ...]] = {}
        deliver: list[int] = []
        for wid, got in told.items():
            if isinstance(got, WorkerError):
                self.failures[wid] = got
            elif got is None:
                deliver.append(wid)
            else:
                watched[wid] = got
        while watched:
            heard = yield Listen(packet, watched, deadline)
            for wid, got in heard.items():
                if got is False:
                    continue
                del watched[wid]
                if got is None:
                    deliver.append(wid)
                else:
                    self._answered(wid, got)
            if not heard and self._clock() >= deadline:
                break
        if deliver and self._clock() < deadline:
            for wid, got in (yield Deliver(packet, deliver, deadline)).items():
                self._answered(wid, True if got is None else got)

    def _hand_over(self, packet: Packet, reachable: list[int]) -> Generator[Action, Any, None]:
        """The staging carries the send to all its workers at once (a chain)."""
        awaited = [w for w in reachable if w not in self.failures]
        yield HandOver(_Outgoing(self, packet, awaited, self.deadline), self.deadline)

    def _answered(self, worker_id: int, got: bool | WorkerError) -> None:
        """Worker ``worker_id`` acked (True) or failed; its first answer counts."""
        if worker_id in self.acked or worker_id in self.failures:
            return
        if isinstance(got, WorkerError):
            self.failures[worker_id] = got
        elif got:
            self.acked.add(worker_id)

    def _late(self, packet: Packet, reachable: list[int]) -> None:
        """An AckTimeoutError for each worker that neither acked nor failed
        by the deadline, with what its channel knows of why."""
        for wid in reachable:
            if wid not in self.acked and wid not in self.failures:
                why = self._workers.transports[wid].why_late()
                self.failures[wid] = AckTimeoutError(
                    f"worker {wid} (model {self.model_id!r}) did not ack version {packet.version} "
                    f"within the send's timeout of {self.timeout:g} s" + (f": {why}" if why else ""),
                    worker_id=wid,
                    model_id=self.model_id,
                    version=packet.version,
                )

    def _report(self) -> SendReport:
        """The report of the send.

        :raises WorkerError: a worker failed (see ``AsyncWeightSender.send``).
        """
        if self.failures:
            raise combine_worker_errors(self.failures, model_id=self.model_id, version=self.version)
        return SendReport(
            self.version,
            self.worker_ids,
            self.nbytes,
            time.perf_counter() - self._started,
            self.staged_seconds,
            self.announce_seconds,
            self.placements,
        )
