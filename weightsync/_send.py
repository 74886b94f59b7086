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

from ._exceptions import (
    AckTimeoutError,
    WeightMismatchError,
    WeightSyncStateError,
    WorkerApplyError,
    WorkerError,
    combine_worker_errors,
)
from ._memory._placement import Placement, caller_stream, route
from ._packet import ChainReport, Packet
from ._packing import Keys, Packer
from ._targets import Workers

__all__ = [
    "STAGED",
    "refuse_options",
    "still_waiting",
    "Action",
    "Announce",
    "ChainReport",
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
    #: The public call that made the send, as its errors name it.
    call: str = "send()"
    #: The version to send as (None: the next one): a sender group's ranks
    #: send each version under one number, whatever any rank skipped.
    version: int | None = None


#: The options of a send that gives none.
DEFAULTS = SendOptions()

# What a scheme takes when it is made, not per send.
_SCHEME_OPTIONS = {
    "delta": "delta sends are chosen when the scheme is made, for the cross-host schemes: "
    "DistributedWeightSyncScheme(delta=True) or RayWeightSyncScheme(delta=True)",
    "wire_dtype": "the wire dtype is chosen when the scheme is made: e.g. "
    "MultiProcessWeightSyncScheme(wire_dtype=torch.bfloat16)",
}


def refuse_options(unknown: Mapping[str, Any], call: str) -> None:
    """A ``TypeError`` for keyword arguments a send does not take, naming
    those it takes (and, for a scheme's option, where it goes).

    :raises TypeError: ``unknown`` is not empty.
    """
    if not unknown:
        return
    name = next(iter(unknown))
    taken = "weights, worker_ids, timeout, keys, partial, verify"
    where = _SCHEME_OPTIONS.get(name)
    message = f"{call} got an unexpected keyword argument {name!r}; it takes {taken}"
    raise TypeError(message + (f". {where}" if where else ""))


def still_waiting(version: int | None, model_id: str | None, timeout: float) -> TimeoutError:
    """The error of a wait for a staged send's acks that gave up at its own
    ``timeout`` while the send goes on: one text from either sender's handle."""
    return TimeoutError(
        f"version {version} of model {model_id!r} is still waiting for acks after {timeout:g} s; "
        "the send goes on (wait again)"
    )


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
    #: The bytes each worker was sent (the staged bytes it reads; with
    #: per-worker weights, its own), by worker id.
    worker_bytes: Mapping[int, int] = field(default_factory=dict)
    #: How the chains carried the send (the cross-host schemes; None
    #: where a send has no chain, or no worker needed one).
    chain: ChainReport | None = None


# -- the actions a driver performs ---------------------------------------------------
#
# Each names what the driver does and what it feeds back. Only Announce,
# Deliver and HandOver need an event loop (their steps are coroutines of a
# transport); the blocking driver runs the others on the calling thread.


class Announce(NamedTuple):
    """Wait (up to ``timeout`` seconds: what is left of the send's deadline)
    until one of ``targets`` has announced itself or failed, or the
    deadline passed. Feed back {worker: its WorkerError} for those that
    died, or, at the deadline, did not announce themselves; ``limit``
    names the timeout that applied, and ``advice`` what to do, for the
    log and the error."""

    targets: list[int]
    timeout: float
    version: int
    limit: str
    advice: str
    #: Return once one target announced itself (or failed), not all.
    first: bool = True
    #: Name those that did not announce themselves by the deadline (False:
    #: only take the announcements that came).
    name: bool = True


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

    __slots__ = ("_acked", "_machine", "deadline", "packet", "worker_ids")

    def __init__(self, machine: SendMachine, packet: Packet, worker_ids: list[int], deadline: float) -> None:
        self._machine: SendMachine | None = machine
        self._acked: frozenset[int] = frozenset()
        self.packet = packet
        self.worker_ids = worker_ids
        self.deadline = deadline

    def ack(self, worker_id: int) -> None:
        """Worker ``worker_id`` acked this send's version (ignored once the send is over)."""
        if self._machine is not None:
            self._machine._answered(worker_id, True)

    def fail(self, worker_id: int, error: WorkerError) -> None:
        """Worker ``worker_id`` failed (died, or could not apply it); ignored
        once the send is over."""
        if self._machine is not None:
            self._machine._answered(worker_id, error)

    @property
    def acked(self) -> frozenset[int]:
        """The workers that acked this send so far (or in all, once it is over)."""
        if self._machine is None:
            return self._acked
        return frozenset(w for w in self.worker_ids if w in self._machine.acked)

    def carried(self, chain: ChainReport) -> None:
        """How the handler's chains carried this send (for its report; the
        last word counts; ignored once the send is over)."""
        if self._machine is not None:
            self._machine.chain = chain

    def over(self) -> None:
        """The send is over: keep who acked, and let go of the machine (and
        with it the caller's weights), which a staging may hold this past
        the send."""
        if self._machine is not None:
            self._acked = self.acked
            self._machine = None


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
        self._each = None if weights is None else workers.per_worker(weights, worker_ids)
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
        #: The bytes each worker was sent, and how the chains carried the
        #: send (told by the handler, :meth:`_Outgoing.carried`).
        self.worker_bytes: dict[int, int] = {}
        self.chain: ChainReport | None = None
        self.staged_seconds = 0.0
        self.announce_seconds = 0.0
        self._steps = self._run()

    @property
    def model_id(self) -> str | None:
        return self._workers.model_id

    # -- the driver's side ------------------------------------------------------
    def start(self) -> Action:
        """The first action (raises as :meth:`feed`)."""
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
        """Send ``weights`` to ``targets``: read, announce, stage, tell, gather.

        Every worker's layout must be known before it is sent anything, so
        a mismatch is refused with no worker touched. The leg goes on with
        the targets that announced themselves; if none has, it waits for
        the first. Those still starting join it as they announce
        themselves, within the send's one deadline, from the bytes already
        staged: one that never does is named at the deadline, and holds no
        other back."""
        sends, workers = self._sends, self._workers
        transports = workers.transports
        started = time.perf_counter()
        # The weights are read first: weights that cannot be sent are
        # refused at once, not once the workers are there.
        options = self.options
        packet = sends.packer.packet(
            sends.version + 1 if options.version is None else max(options.version, sends.version + 1),
            weights,
            fanout=len(targets),
            keys=options.keys,
            partial=options.partial,
            stream=self._stream,
        )
        late: list[int] = []
        waited = 0.0
        if None in [transports[w].layout for w in targets]:
            announcing = time.perf_counter()
            late = yield from self._await_starting(targets)
            waited = time.perf_counter() - announcing
            self.announce_seconds += waited
        self.version = packet.version
        there = (
            [w for w in targets if w not in self.failures and w not in late]
            if self.failures or late
            else targets
        )
        reachable = workers.check_layouts(packet, there)
        # How each one is reached: decided here, once, for the staging and the report.
        placements = {w: self._route(packet, w) for w in reachable}
        if reachable:
            packet = yield Write(packet, self.verify, placements)
            sends.version = packet.version  # bytes moved: the version is used
            self.nbytes += packet.manifest.nbytes
        if last:
            # (Reading and staging the weights, not the wait for workers.)
            self.staged_seconds = time.perf_counter() - started - (waited if self._each is None else 0.0)
            yield STAGED
        if reachable:
            yield from self._carry(packet, reachable, placements)
        # Those still starting: each joins as it announces itself.
        while late:
            late = yield from self._join(packet, late, placements)

    def _await_starting(self, targets: list[int]) -> Generator[Action, Any, list[int]]:
        """Before the staging, where some of ``targets`` have not announced
        themselves: take the announcements that came already (each worker
        known before the staging is checked before anything moves); if none
        of them is there, wait for the first. Returns those still starting
        (to join the send later), the ones that failed meanwhile left out."""
        transports = self._workers.transports

        def starting() -> list[int]:
            return [w for w in targets if w not in self.failures and transports[w].layout is None]

        yield from self._announced(starting(), share=0.0)
        while (waiting := starting()) and len(waiting) == sum(w not in self.failures for w in targets):
            yield from self._announced(waiting)
        if starting() and self._sends.handler:
            # A chain carries a send once: wait for the rest too, but for
            # half what is left at most, so those there are still updated.
            yield from self._announced(starting(), share=0.5)
        return starting()

    def _announced(self, waiting: list[int], share: float | None = None) -> Generator[Action, Any, None]:
        """Wait until one of ``waiting`` has announced itself (or failed),
        or, at the deadline, name each that did not. ``share``: wait for
        all of them, for that share of what is left of the deadline (0:
        only take the announcements that came; none is named)."""
        left = max(self.deadline - self._clock(), 0.0)
        call = self.options.call
        limit = f"{call}'s timeout of {self.timeout:g} s"
        if share is not None:
            left *= share
            limit = f"{left:.3g} s, the share of {limit} left to wait for workers still starting"
        advice = (
            "call scheme.wait_for_workers() once the workers are started, before the first send"
            if call == "send()"
            else ""
        )
        action = Announce(
            waiting, left, self._sends.version + 1, limit, advice, first=share is None, name=share != 0.0
        )
        self.failures.update((yield action))

    def _route(self, packet: Packet, worker_id: int) -> Placement:
        transport = self._workers.transports[worker_id]
        return route(
            packet.devices,
            transport.devices,
            transport.reach,
            device_staging=self._sends.on_device and not self.verify,
        )

    def _carry(
        self, packet: Packet, reachable: list[int], placements: Mapping[int, Placement]
    ) -> Generator[Action, Any, None]:
        """Carry the staged ``packet`` to ``reachable`` and record who acked."""
        # (How each is reached and what it is sent is known already: noted
        # before the wait for acks, not after it, on the way back to the caller.)
        self.placements.update({w: placements[w]._value_ for w in reachable})  # (the value, not the property)
        self.worker_bytes.update(dict.fromkeys(reachable, packet.manifest.nbytes))
        yield from (self._hand_over if self._sends.handler else self._gather)(packet, reachable)
        self._late(packet, reachable)
        self._workers.record(packet, reachable, [w for w in reachable if w in self.failures])

    def _join(
        self, packet: Packet, late: list[int], placements: dict[int, Placement]
    ) -> Generator[Action, Any, list[int]]:
        """Wait for one of ``late`` to announce itself and send it ``packet``
        as staged; those still awaited. A chain carries one send once: there,
        a worker that announced itself once the chain had left gets the next
        send, and is named now."""
        yield from self._announced(late)
        transports = self._workers.transports
        joined = [w for w in late if w not in self.failures and transports[w].layout is not None]
        written = set(placements.values())
        fits: list[int] = []
        for wid in joined:
            why = None
            try:
                self._workers.check_layouts(packet, [wid])
            except (WeightMismatchError, WeightSyncStateError) as exc:
                why = str(exc)
            else:
                placement = self._route(packet, wid)
                if self._sends.handler:
                    why = "it announced itself once the send's chain had left; it gets the next send"
                elif placement not in written:
                    why = (
                        f"it announced itself once the weights were staged for other workers, and is "
                        f"reached another way ({placement.value}); it gets the next send"
                    )
                else:
                    placements[wid] = placement
                    fits.append(wid)
            if why is not None:
                self.failures[wid] = WorkerApplyError(
                    f"worker {wid} (model {self.model_id!r}) was not sent version {packet.version}: {why}",
                    worker_id=wid,
                    model_id=self.model_id,
                    version=packet.version,
                    worker_message=why,
                )
        if fits:
            yield from self._carry(packet, fits, placements)
        return [w for w in late if w not in self.failures and w not in placements]

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
        outgoing = _Outgoing(self, packet, awaited, self.deadline)
        try:
            yield HandOver(outgoing, self.deadline)
        finally:
            outgoing.over()

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
                    f"within {self.options.call}'s timeout of {self.timeout:g} s"
                    + (f": {why}" if why else ""),
                    worker_id=wid,
                    model_id=self.model_id,
                    version=packet.version,
                )

    def _report(self) -> SendReport:
        """The report of the send.

        :raises WorkerError: a worker failed (see ``AsyncWeightSender.send``).
        """
        report = SendReport(
            self.version,
            self.worker_ids if not self.failures else tuple(w for w in self.worker_ids if w in self.acked),
            self.nbytes,
            time.perf_counter() - self._started,
            self.staged_seconds,
            self.announce_seconds,
            self.placements,
            self.worker_bytes,
            self.chain,
        )
        if self.failures:
            error = combine_worker_errors(self.failures, model_id=self.model_id, version=self.version)
            error.report = report
            raise error
        return report
