"""Gathering what a sender's workers answer: their announcements, their acks.

A step (announce, deliver) runs for every target at once under one deadline,
and a failing worker never cancels the others: each worker's error stays its
own, and a target that neither answered nor failed by the deadline gets an
:class:`AckTimeoutError`.

Acks of workers whose transports can be watched by descriptor
(:meth:`SenderTransport.ack_fds`) are gathered by one waiter over all their
descriptors, one wakeup per ack: on a machine with few cores, a task and a
wait per worker cost more than a small model's whole send. That waiter has
two drivers over one round (:class:`_Round`): a coroutine, and a blocking
poll on the calling thread for a caller with no event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from ._exceptions import AckTimeoutError, WorkerError, combine_worker_errors
from ._offload import inline_allowed
from ._packet import Packet
from ._readiness import ReadyWatch
from ._transports._base import ChannelTransport, Outgoing, SenderTransport, SendHandler

__all__ = ["AckGather"]

# How long a blocked caller's gather waits in one poll before it lets its
# loop run (Ctrl-C and the deadline cancel it there): the most a Ctrl-C is
# held back while no ack comes.
_POLL_SLICE = 0.05

# How often a wait for workers to announce themselves logs who it waits for.
_PROGRESS_EVERY = 5.0

# Why workers are most often never heard of: ends the error of a wait for them.
_NEVER_ANNOUNCED = (
    "A worker is announced by its init_on_worker() call (init_on_receiver() in torchrl); likely causes: "
    "the worker never calls it for this model; a worker started with 'spawn' or 'forkserver' failed "
    "to import its code before it got there (its traceback is in that worker's stderr); the worker "
    "was given the trainer's end of its pipe (the trainer passes one end to init_on_sender, the "
    "worker gets the other)"
)
_log = logging.getLogger("weightsync")

#: A step of a send for one worker: given its transport, done when it is.
Step = Callable[[SenderTransport], Awaitable[Any]]


class _Round:
    """One gather of ``packet``'s acks from the ``watched`` workers: who is
    still awaited, and what each answer meant. Both drivers feed it the
    descriptors that turned ready."""

    def __init__(
        self,
        gather: AckGather,
        watch: ReadyWatch,
        watched: dict[int, tuple[int, ...]],
        packet: Packet,
        failures: dict[int, WorkerError],
        done: set[int],
    ) -> None:
        self._gather, self._watch, self._packet = gather, watch, packet
        self.failures, self.done = failures, done
        self.waiting = dict(watched)
        #: Workers that turned out to need :meth:`SenderTransport.deliver`
        #: (one restarted mid-send, say).
        self.spilled: list[int] = []
        for fds in self.waiting.values():
            watch.watch(fds)

    def take(self, ready: set[int]) -> None:
        """Read what each worker whose descriptors are in ``ready`` sent; one
        that acked goes to ``done``, one that failed to ``failures``, one that
        needs ``deliver`` to ``spilled``; either way it is no longer awaited."""
        channels = self._gather.channels
        for wid in [w for w, fds in self.waiting.items() if not ready.isdisjoint(fds)]:
            try:
                got = channels[wid].try_ack(self._packet)
            except WorkerError as exc:
                self.failures[wid] = exc
                got = True
            if got is None:
                self.spilled.append(wid)
            if got is not False:
                self._watch.forget(self.waiting.pop(wid))
                if got and wid not in self.failures:
                    self.done.add(wid)


class AckGather:
    """Runs a send's per-worker steps and gathers their answers, for one
    sender: over ``transports`` (the sender's own mapping, which membership
    changes update in place)."""

    def __init__(self, transports: Mapping[int, SenderTransport], model_id: str | None) -> None:
        self.transports = transports
        self.model_id = model_id
        # One epoll set, kept from send to send; made on first use.
        self._ready_watch: ReadyWatch | None = None

    @property
    def channels(self) -> Mapping[int, ChannelTransport]:
        """The transports, as channels that carry sends to their workers
        (the sender's staging is no :class:`SendHandler`)."""
        return self.transports  # type: ignore[return-value]

    async def handed_over(self, handler: SendHandler, send: Outgoing, what: str) -> None:
        """Have ``handler`` carry ``send`` to its workers, under its deadline;
        then an AckTimeoutError for each worker that neither acked nor
        failed (with what its channel knows of why)."""
        with anyio.move_on_after(max(send.deadline - anyio.current_time(), 0)):
            await handler.handle_send(send, self.transports)
        self.late(send.worker_ids, send.done, send.failures, what, send.packet.version)

    def _watch(self) -> ReadyWatch:
        if self._ready_watch is None:
            self._ready_watch = ReadyWatch()
        return self._ready_watch

    async def fan_out(
        self,
        targets: list[int],
        step: Step,
        deadline: float,
        failures: dict[int, WorkerError],
        what: str,
        version: int | None = None,
        *,
        acks_of: Packet | None = None,
    ) -> None:
        """Run ``step(transport)`` for every target concurrently, all under
        ``deadline`` (the loop's clock); each failure goes to ``failures``.

        With ``acks_of`` (a posted packet), ``step`` gathers its acks: the
        watchable workers are waited for together by one waiter, and
        ``step`` runs only for the others."""
        done: set[int] = set()

        async def one(wid: int) -> None:
            try:
                await step(self.transports[wid])
                done.add(wid)
            except WorkerError as exc:
                failures[wid] = exc

        watched = self.watchable(targets, acks_of) if acks_of is not None else {}
        rest = [w for w in targets if w not in watched]
        # One cancel scope for the whole fan-out: the deadline is the same for
        # every worker, and a scope per worker costs more than the send itself
        # for small models.
        with anyio.move_on_after(max(deadline - anyio.current_time(), 0)):
            if not rest:
                if acks_of is not None and watched:
                    await self.await_acks(watched, acks_of, failures, done, None)
            elif len(rest) == 1 and not watched:
                await one(rest[0])
            else:
                async with anyio.create_task_group() as group:
                    for wid in rest:
                        group.start_soon(one, wid)
                    if acks_of is not None and watched:

                        def spill(wid: int) -> None:
                            group.start_soon(one, wid)

                        group.start_soon(self.await_acks, watched, acks_of, failures, done, spill)
        self.late(targets, done, failures, what, version)

    def late(
        self,
        targets: list[int],
        done: set[int],
        failures: dict[int, WorkerError],
        what: str,
        version: int | None,
    ) -> None:
        """An AckTimeoutError for each target that neither finished nor failed."""
        for wid in targets:
            if wid not in done and wid not in failures:
                # (Only a send has a chain that may have broken before the worker.)
                why = self.transports[wid].why_late() if version is not None else None
                failures[wid] = AckTimeoutError(
                    f"worker {wid} (model {self.model_id!r}) did not {what} before the deadline"
                    + (f": {why}" if why else ""),
                    worker_id=wid,
                    model_id=self.model_id,
                    version=version,
                )

    def watchable(self, targets: list[int], packet: Packet) -> dict[int, tuple[int, ...]]:
        """{worker: descriptors} of the targets whose acks of ``packet`` one
        waiter can gather: posted, and watchable by descriptor."""
        watched = {}
        for wid in targets:
            fds = self.channels[wid].ack_fds(packet)
            if fds is not None:
                watched[wid] = fds
        return watched

    async def await_acks(
        self,
        watched: dict[int, tuple[int, ...]],
        packet: Packet,
        failures: dict[int, WorkerError],
        done: set[int],
        spill: Callable[[int], Any] | None,
    ) -> None:
        """Gather the acks of ``packet`` from the ``watched`` workers, in the
        running loop. A worker that turns out to need ``deliver`` is handed
        to ``spill``, or delivered here after the others when there is none.
        A dead worker is reported as soon as its pidfd wakes the waiter."""
        # A blocked caller's own loop has nothing else to run (no task group
        # here): the wait then blocks in the poll itself, with no loop
        # iteration per ack. It comes up for the loop every _POLL_SLICE
        # seconds, so that Ctrl-C and the deadline still cancel it.
        blocking = spill is None and inline_allowed()
        with self._watch().armed(in_loop=not blocking) as watch:
            round_ = _Round(self, watch, watched, packet, failures, done)
            # Whatever is in already (on a machine with few cores the workers
            # woken by the posts may have run before this): one look at the
            # whole set, not a read attempt per worker.
            ready = watch.poll(0)
            looked = anyio.current_time()  # when the loop last ran (blocking)
            while True:
                round_.take(ready)
                if spill is not None:
                    for wid in round_.spilled:
                        spill(wid)
                    round_.spilled.clear()
                if not round_.waiting:
                    break
                if blocking:
                    now = anyio.current_time()
                    left = anyio.current_effective_deadline() - now
                    ready = watch.poll(max(min(left, _POLL_SLICE), 0.0))
                    if not ready or now - looked >= _POLL_SLICE:
                        # (Also while messages keep coming: a worker that
                        # floods its pipe cannot hold the deadline off.)
                        await anyio.lowlevel.checkpoint()
                        looked = anyio.current_time()
                else:
                    await watch.wait()
                    ready = watch.poll(0)
        for wid in round_.spilled:  # only without a task group: rare (a restarted worker)
            try:
                await self.channels[wid].deliver(packet)
                done.add(wid)
            except WorkerError as exc:
                failures[wid] = exc

    def await_acks_now(
        self,
        watched: dict[int, tuple[int, ...]],
        packet: Packet,
        failures: dict[int, WorkerError],
        done: set[int],
        deadline: float,
        interrupted: Callable[[], bool],
    ) -> list[int]:
        """:meth:`await_acks` on the calling thread, with no event loop:
        waits in the poll itself until every watched worker acked or
        failed, ``deadline`` (``time.monotonic()``) passes, or
        ``interrupted()`` (looked at at least every _POLL_SLICE seconds, and
        after every wakeup: a flooding worker cannot hold it off). Returns
        the workers that need ``deliver`` after all.

        :raises KeyboardInterrupt: ``interrupted()`` turned true.
        """
        with self._watch().armed(in_loop=False) as watch:
            round_ = _Round(self, watch, watched, packet, failures, done)
            ready = watch.poll(0)
            while True:
                round_.take(ready)
                left = deadline - time.monotonic()
                if not round_.waiting or left <= 0:
                    return round_.spilled
                if interrupted():
                    raise KeyboardInterrupt
                ready = watch.poll(min(left, _POLL_SLICE))

    async def announced(
        self, targets: list[int], timeout: float, version: int | None = None
    ) -> dict[int, float]:
        """Wait for every target's announcement (up to ``timeout`` seconds); their times (see
        :meth:`AsyncWeightSender.wait_for_workers`), logging who is still awaited every
        _PROGRESS_EVERY seconds.

        :raises WorkerError: naming every target that died or was late.
        """
        started = time.perf_counter()
        times = {w: 0.0 for w in targets if self.transports[w].layout is not None}
        waiting = [w for w in targets if w not in times]
        if not waiting:
            return times
        failures: dict[int, WorkerError] = {}

        async def announce(transport: SenderTransport) -> None:
            await transport.connect()
            times[transport.worker_id] = time.perf_counter() - started

        deadline = anyio.current_time() + timeout
        async with anyio.create_task_group() as group:
            group.start_soon(self._log_progress, targets, times, timeout, started)
            await self.fan_out(waiting, announce, deadline, failures, "announce itself", version)
            group.cancel_scope.cancel()
        if failures:
            for err in failures.values():
                if isinstance(err, AckTimeoutError):
                    err.advice = _NEVER_ANNOUNCED
            raise combine_worker_errors(failures, model_id=self.model_id, version=version)
        return times

    async def _log_progress(
        self, targets: list[int], times: dict[int, float], timeout: float, started: float
    ) -> None:
        """Every _PROGRESS_EVERY seconds, until cancelled: which of
        ``targets`` announced themselves (``times``) and which not yet."""
        while True:
            await anyio.sleep(_PROGRESS_EVERY)
            waited = time.perf_counter() - started
            missing = [w for w in targets if w not in times]
            _log.info(
                "weightsync: model %r: %d of %d workers announced themselves after %.0f s "
                "(of at most %.0f s); still waiting for worker(s) %s",
                self.model_id,
                len(targets) - len(missing),
                len(targets),
                waited,
                timeout,
                ", ".join(map(str, missing)),
            )

    def close(self) -> None:
        if self._ready_watch is not None:
            self._ready_watch.close()
            self._ready_watch = None
