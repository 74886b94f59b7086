"""The synchronous facade: blocking calls over the async core.

Every call enters the event loop through the runtime (``_runtime``), which
knows how: a private loop of the calling thread for a blocking call, the
process-wide loop thread for background work. The async objects know nothing
of this.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

import anyio

from ._drive import drive, drive_blocking, resume
from ._exceptions import (
    SenderClosedError,
    SenderLostError,
    WaitTimeoutError,
    WeightSyncStateError,
    out_of_resources,
)
from ._loops import NEEDS_LOOP
from ._packet import DEFAULT_TIMEOUT
from ._receiver import AsyncWeightReceiver
from ._runtime import RUNTIME
from ._send import DEFAULTS, STAGED, Action, Listen, SendMachine, refuse_options, still_waiting
from ._sender import AsyncWeightSender, Keys, SendOptions, SendReport
from ._stepguard import StepGuard

__all__ = ["SendHandle", "WeightReceiver", "WeightSender"]

_log = logging.getLogger("weightsync")
# How often the applier thread looks at its stop flag while no update comes.
_APPLIER_POLL = 0.1
# At exit, how long a send still gathering its acks on the loop thread is
# given to stop once cancelled.
_ABANDON_WAIT = 2.0


class WeightSender:
    """Blocking front of an :class:`AsyncWeightSender`.

    Get it from ``scheme.get_sender()`` after ``scheme.init_on_sender(...)``.
    Calls may come from any thread, including one that runs its own event
    loop (it is blocked while it waits); not from weightsync's loop thread.
    """

    def __init__(self, sender: AsyncWeightSender) -> None:
        self._sender = sender
        # The send_async() not waited for yet; it clears itself once over.
        self._pending: SendHandle | None = None
        self._closed = False
        RUNTIME.acquire()

    @property
    def async_sender(self) -> AsyncWeightSender:
        return self._sender

    @property
    def worker_versions(self) -> dict[int, int | None]:
        """The last version each worker acked (None: none yet), by worker id."""
        return self._sender.worker_versions

    @property
    def worker_devices(self) -> dict[int, tuple[str, ...] | None]:
        """The devices each worker's model is on, as it announced them; see
        :attr:`AsyncWeightSender.worker_devices`."""
        return self._sender.worker_devices

    @property
    def pending(self) -> bool:
        """Whether a ``send_async()`` is not waited for yet (see :meth:`wait_async`)."""
        return self._pending is not None

    def _refuse_in_coroutine(self, what: str, instead: str) -> bool:
        return RUNTIME.refuse_in_coroutine(
            what, f"await scheme.get_async_sender().{instead}", model_id=self._sender.model_id
        )

    def _check(self, what: str) -> None:
        if self._closed:
            raise WeightSyncStateError(
                f"{what}: the sender of model {self._sender.model_id!r} is shut down",
                model_id=self._sender.model_id,
            )
        if self._pending is not None:
            raise WeightSyncStateError(
                f"{what} while a send_async() is pending; call wait_async() first",
                model_id=self._sender.model_id,
            )

    def wait_for_workers(
        self, worker_ids: int | Iterable[int] | None = None, *, timeout: float | None = None
    ) -> dict[int, float]:
        """Block until the workers (default: all) have announced themselves;
        the seconds each took. See :meth:`AsyncWeightSender.wait_for_workers`
        (what it logs while it waits, and what it raises).

        :raises RuntimeError: a ``send_async()`` is pending.
        :raises BlockingCallError: called inside a coroutine (await
            :meth:`AsyncWeightSender.wait_for_workers` there).
        """
        self._refuse_in_coroutine("wait_for_workers()", "wait_for_workers(...)")
        self._check("wait_for_workers()")
        return RUNTIME.call(lambda: self._sender.wait_for_workers(worker_ids, timeout=timeout))

    def connect(self, worker_ids: int | Iterable[int] | None = None, *, timeout: float | None = None) -> None:
        """:meth:`wait_for_workers`, returning nothing."""
        self._refuse_in_coroutine("connect()", "connect(...)")
        self.wait_for_workers(worker_ids, timeout=timeout)

    def send(
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
        """Send and block until every targeted worker applied and acked.

        Arguments (a partial update included) and errors as
        :meth:`AsyncWeightSender.send`.

        :raises RuntimeError: a ``send_async()`` is pending.
        :raises BlockingCallError: called inside a coroutine, before
            anything is staged (await :meth:`AsyncWeightSender.send` there).
        """
        refuse_options(unknown, "send()")
        here = self._refuse_in_coroutine("send()", "send(...)")
        self._check("send()")
        options = (
            DEFAULTS
            if timeout is None and keys is None and not partial and verify is None
            else SendOptions(timeout, keys, partial, verify)
        )
        return self._drive(self._sender.machine(weights, worker_ids, options), None, here=here)

    @staticmethod
    def send_each_as(
        version: int,
        sends: list[tuple[WeightSender, Any]],
        *,
        timeout: float | None = None,
        connect: bool = False,
    ) -> list[SendReport | Exception]:
        """A send of all of each ``(sender, weights)`` to every worker of its
        sender as ``version`` (at least the next one; a sender group's ranks
        number each version alike), all at once (one event loop, a task
        each), blocking until every one ended;
        with ``connect``, each sender first waits for its workers (up to
        ``timeout``). What each returned or raised, in order (a
        ``BaseException`` other than an ``Exception``, Ctrl-C, is raised once
        all stopped): a sender group's rank sending its part to each class
        of workers over a chain of its own."""
        for sender, _ in sends:
            sender._refuse_in_coroutine("send()", "send(...)")
            sender._check("send()")
        if not sends:
            return []  # (a sender group's rank that only writes its part into its host's buffer)
        out: list[SendReport | Exception] = [RuntimeError("not run")] * len(sends)

        async def one(i: int, sender: WeightSender, weights: Any) -> None:
            try:
                if connect:
                    await sender._sender.wait_for_workers(timeout=timeout)
                machine = sender._sender.machine(weights, None, SendOptions(timeout, version=version))
                try:
                    report = await drive(machine, sender._sender.io)
                finally:
                    machine.close()
                assert report is not None
                out[i] = report
            except Exception as exc:
                out[i] = exc

        async def every() -> None:
            async with anyio.create_task_group() as group:
                for i, (sender, weights) in enumerate(sends):
                    group.start_soon(one, i, sender, weights)

        RUNTIME.call(every)
        return out

    def _drive(
        self,
        machine: SendMachine,
        action: Action | None,
        *,
        until_staged: bool = False,
        until_waiting: bool = False,
        here: bool | None = None,
    ) -> Any:
        """Drive ``machine`` (from ``action``, or its start) blocking: on
        this thread with no event loop where it runs none (the one choice
        of driver), else through weightsync's loop thread. Returns its
        report, or None once staged (``until_staged``), or (``until_waiting``,
        on this thread only) the first action past the staging that waits
        (see ``drive_blocking``). ``here``: what ``RUNTIME.blocks_here()``
        answered already on this thread, if it was asked."""
        io = self._sender.io
        try:
            if RUNTIME.blocks_here() if here is None else here:
                # One Ctrl-C guard for the whole send: no moment between two
                # steps where an interruption would leave it half done.
                return RUNTIME.run_waiting(
                    drive_blocking,
                    machine,
                    io,
                    until_staged=until_staged,
                    until_waiting=until_waiting,
                    action=action,
                )
            if until_waiting:
                until_staged = True  # (the loop thread's driver stops there; STAGED goes on)

            async def in_loop() -> SendReport | None:
                first = machine.start() if action is None else action
                return await resume(machine, io, first, until_staged=until_staged)

            return RUNTIME.call(in_loop)
        except BaseException:
            machine.close()  # (a no-op once the machine is over)
            raise

    def send_async(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
        keys: Keys | None = None,
        partial: bool = False,
        verify: bool | None = None,
        **unknown: Any,
    ) -> SendHandle:
        """Start a send and return once the weights are staged; :meth:`wait_async`
        (or the handle returned) gathers the acks. Arguments as :meth:`send`.

        Blocks while the weights are copied out (into the shared segment or
        slot, or Ray's object store), not while the workers apply them: once
        this returns the weights may be changed, and every targeted worker
        still gets exactly the weights as they were at this call. The acks
        are gathered in the background (weightsync's loop thread), or by
        :meth:`wait_async` on its own thread when it is called before the
        loop thread got to them.

        Every error of the send, one found before anything moved (weights
        that do not fit, an unknown worker) included, is raised by
        :meth:`wait_async` (and the handle's ``wait()``, or ``await handle``).
        The handle may be ignored, as torchrl's collectors do.

        :raises RuntimeError: a previous ``send_async()`` is still pending.
        :raises BlockingCallError: called inside a coroutine, before
            anything is staged (await :meth:`AsyncWeightSender.send_async` there).
        """
        refuse_options(unknown, "send_async()")
        self._refuse_in_coroutine("send_async()", "send_async(...) (it returns once staged)")
        self._check("send_async()")
        return self._stage(weights, worker_ids, SendOptions(timeout, keys, partial, verify, "send_async()"))

    def _stage(self, weights: Any, worker_ids: Any, options: SendOptions) -> SendHandle:
        """:meth:`send_async` once checked (a sender group's rank stages its
        part of each class as the group's version, ``options.version``)."""
        try:
            machine = self._sender.machine(weights, worker_ids, options)
            # Staged, and every worker told where a notice is all it takes
            # (the pipes): what is left waits for the acks.
            waiting = self._drive(machine, None, until_waiting=True)
        except Exception as exc:
            # As torchrl's send_async: the send's errors come from wait_async().
            failed: concurrent.futures.Future[SendReport] = concurrent.futures.Future()
            failed.set_exception(exc)
            self._pending = SendHandle(self, failed, None)
            return self._pending
        if isinstance(waiting, SendReport):
            done: concurrent.futures.Future[SendReport] = concurrent.futures.Future()
            done.set_result(waiting)
            self._pending = SendHandle(self, done, None)
        elif isinstance(waiting, Listen):
            # Only the acks are left: gathered where the caller waits for
            # them (wait_async() on this thread, or ``await handle`` on
            # weightsync's loop thread), with no thread woken meanwhile.
            self._pending = SendHandle(self, concurrent.futures.Future(), machine, waiting)
        else:
            # A chain's whole send, or a worker to tell on the loop: now, in
            # the background.
            action = waiting or STAGED
            self._pending = SendHandle(self, self._gather(machine, action), machine, handed=action)
        return self._pending

    def _gather(self, machine: SendMachine, action: Action) -> concurrent.futures.Future[SendReport]:
        """Go on with ``machine`` from ``action`` on weightsync's loop thread,
        in the background: the future of its report."""
        io = self._sender.io

        async def gather() -> SendReport:
            report = await resume(machine, io, action)
            assert report is not None
            return report

        try:
            return RUNTIME.start(gather)
        except BaseException:
            # Staged: finish it here rather than leave the sender busy with
            # a send nobody waits for.
            with contextlib.suppress(Exception):
                self._drive(machine, action)
            raise

    def wait_async(self, timeout: float | None = None) -> SendReport:
        """Block until the pending ``send_async()`` is done; re-raise its error.

        With ``timeout=None`` it waits as long as the send's own deadline.

        :raises RuntimeError: no ``send_async()`` is pending.
        :raises TimeoutError: ``timeout`` passed first (the send stays pending).
        :raises BlockingCallError: called inside a coroutine (await the
            handle that ``send_async()`` returned there).
        """
        RUNTIME.refuse_in_coroutine(
            "wait_async()",
            "await the SendHandle that send_async() returned (await handle)",
            model_id=self._sender.model_id,
        )
        if self._pending is None:
            raise WeightSyncStateError(
                "wait_async() with no send_async() pending", model_id=self._sender.model_id
            )
        return self._pending.wait(timeout)

    def add_worker(
        self,
        worker_id: int,
        transport: Any,
        *,
        send: bool = False,
        weights: Any = None,
        timeout: float | None = None,
    ) -> SendReport | None:
        """See :meth:`AsyncWeightSender.add_worker` (schemes call it). With
        ``send``, the new worker alone then gets ``weights`` (None: the
        model), and this blocks until it applied them (its report). A
        worker that does not (it never announced itself, died, or cannot
        take them) is removed again before the error is raised: no member
        is left behind to hold back later sends.

        :raises WorkerError: the new worker did not apply the weights in ``timeout``.
        :raises BlockingCallError: called inside a coroutine."""
        self._refuse_in_coroutine("add_worker()", "add_worker(...)")
        self._check("add_worker()")
        RUNTIME.call(self._sender.add_worker, worker_id, transport)
        if not send:
            return None
        try:
            machine = self._sender.machine(
                weights, [worker_id], SendOptions(timeout=timeout, call="add_worker()")
            )
            report: SendReport = self._drive(machine, None)
            return report
        except BaseException:
            with contextlib.suppress(Exception):
                RUNTIME.call(self._sender.remove_worker, worker_id)
            raise

    def remove_worker(self, worker_id: int) -> None:
        """Stop sending to ``worker_id``; see :meth:`AsyncWeightSender.remove_worker`.

        :raises BlockingCallError: called inside a coroutine."""
        self._refuse_in_coroutine("remove_worker()", "remove_worker(...)")
        self._check("remove_worker()")
        RUNTIME.call(self._sender.remove_worker, worker_id)

    def update_weights(self, weights: Any) -> SendReport:
        """Legacy name of ``send(weights)`` to all workers."""
        return self.send(weights)

    def shutdown(self) -> None:
        """Finish a pending send (errors ignored), close the channels. Idempotent.

        :raises BlockingCallError: called inside a coroutine while the
            channels are open (await :meth:`AsyncWeightSender.aclose`
            there; this then has nothing left to do).
        """
        if self._closed:
            return
        if not self._sender.closed or self._pending is not None:
            self._refuse_in_coroutine("shutdown()", "aclose() (or leave its async with)")
        self._close(SendHandle.finish)

    def close_at_exit(self) -> None:
        """:meth:`shutdown` as the interpreter exits with this sender open:
        a send still gathering its acks is abandoned, not waited for (nobody
        is left to read its outcome), then the channels close, so every
        worker hears the trainer closed and its process can end before
        Python waits for it. Never raises."""
        try:
            self._close(lambda pending: pending.abandon(_ABANDON_WAIT))
        except BaseException as exc:
            _log.warning("weightsync: closing the sender of model %r at exit: %r", self._sender.model_id, exc)

    def _close(self, end: Callable[[SendHandle], None]) -> None:
        """End the pending send (``end``), close the channels, let go of the runtime."""
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                end(pending)
            if not self._sender.closed:
                RUNTIME.call(self._sender.aclose)
        finally:
            RUNTIME.release()


class SendHandle:
    """A send started by :meth:`WeightSender.send_async`: staged, its acks to come.

    Wait for it once, in whichever way fits where the caller is:

    - ``handle.wait(timeout=None)`` blocks, as :meth:`WeightSender.wait_async`
      (the same wait: either one completes the send);
    - ``await handle`` inside any asyncio loop, which keeps running
      meanwhile (the acks are gathered on weightsync's loop thread).

    Once the send is over, waiting again returns its report (or raises its
    error) again. Ignoring the handle is fine: ``wait_async()`` still
    completes the send.
    """

    def __init__(
        self,
        sender: WeightSender,
        future: concurrent.futures.Future[SendReport],
        machine: SendMachine | None,
        held: Action | None = None,
        *,
        handed: Action = STAGED,
    ) -> None:
        self._sender = sender
        # The send's outcome.
        self._future = future
        # A send whose acks are all that is left (``held``: the action that
        # waits for them), handed to no thread yet: the first wait gathers
        # them (see _hand_off).
        self._held = None if machine is None or held is None else (machine, held)
        # A send handed to the loop thread, while it may not have started
        # gathering its acks yet (see wait()); None once a waiter took it
        # over, or for a send held or refused before anything moved.
        self._unstarted = machine if held is None else None
        # Where the loop thread goes on from (a waiter that takes the send
        # over goes on from there too).
        self._handed = handed
        self._version = machine.version if machine is not None else None
        self._worker_ids = machine.worker_ids if machine is not None else ()

    def _hand_off(self) -> None:
        """A held send goes on in the background, on weightsync's loop
        thread (a wait with a timeout, ``await handle``, :meth:`done`)."""
        held, self._held = self._held, None
        if held is not None:
            # (Handed off as send_async() hands a chain's send: a blocking
            # wait may still take it over while the loop thread has not.)
            self._future = self._sender._gather(*held)
            self._unstarted, self._handed = held

    @property
    def version(self) -> int | None:
        """The version the send carries (None: it was refused before staging;
        waiting raises why)."""
        return self._version

    @property
    def worker_ids(self) -> tuple[int, ...]:
        """The workers targeted (empty: the send was refused before staging)."""
        return self._worker_ids

    def done(self) -> bool:
        """Whether the send is over (waiting returns or raises at once). Never
        blocks: a send whose acks nobody gathers yet is handed to
        weightsync's loop thread, which gathers them from then on."""
        self._hand_off()
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SendReport:
        """Block until every targeted worker acked, or the send failed; its
        report. ``timeout=None`` waits as long as the send's own deadline.

        :raises TimeoutError: ``timeout`` passed first (the send goes on;
            wait again).
        :raises BlockingCallError: called inside a coroutine (``await
            handle`` there).
        :raises WorkerError: the send's errors (see :meth:`WeightSender.send`).
        """
        RUNTIME.refuse_in_coroutine(
            "SendHandle.wait()",
            "await the handle itself (await handle)",
            model_id=self._sender.async_sender.model_id,
        )
        # The send this thread goes on with itself, where it would only
        # block otherwise: one whose acks are all that is left and nobody
        # gathers yet, or one the loop thread has not started on (the
        # caller waits at once, as when it has nothing to overlap). On a
        # machine with few cores, waking the loop thread for it costs about
        # as much as the whole send of a small model.
        held, self._held = self._held, None
        unstarted, self._unstarted = self._unstarted, None
        taken: tuple[SendMachine, Action] | None = None
        if timeout is None and held is not None:
            taken = held
        elif timeout is None and unstarted is not None and self._future.cancel():
            self._future = concurrent.futures.Future()
            taken = (unstarted, self._handed)
        elif held is not None:
            self._held = held
            self._hand_off()  # (a wait with a limit: the send goes on past it)
        if taken is not None:
            try:
                report: SendReport = self._sender._drive(*taken)
            except BaseException as exc:
                self._future.set_exception(exc)
                raise
            else:
                self._future.set_result(report)
                return report
            finally:
                self._over()
        future = self._future
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise  # (the send's own error: an AckTimeoutError is a TimeoutError too)
            # (Python 3.10's is not the built-in TimeoutError, which this raises.)
            assert timeout is not None
            raise still_waiting(self._version, self._sender.async_sender.model_id, timeout) from None
        finally:
            if future.done():
                self._over()

    def __await__(self) -> Generator[Any, None, SendReport]:
        return self._awaited().__await__()

    async def _awaited(self) -> SendReport:
        # The loop thread gathers the acks (handed the send at send_async(),
        # or now); this loop only waits for its outcome.
        self._hand_off()
        self._unstarted = None
        try:
            return await asyncio.wrap_future(self._future)
        finally:
            if self._future.done():
                self._over()

    def finish(self) -> None:
        """Let the send end, its errors ignored (the sender is shutting down)."""
        held, self._held = self._held, None
        self._unstarted = None
        with contextlib.suppress(BaseException):
            if held is not None:
                self._sender._drive(*held)
            else:
                self._future.result()
        self._over()

    def abandon(self, timeout: float) -> None:
        """Stop the send where it is, its outcome unread (the interpreter is
        exiting): the loop thread stops gathering its acks, waiting up to
        ``timeout`` seconds for that."""
        held, self._held = self._held, None
        if held is not None:
            held[0].close()  # never handed to any thread: it holds the sender
        unstarted, self._unstarted = self._unstarted, None
        RUNTIME.cancel(self._future, timeout)
        if unstarted is not None and self._future.cancelled():
            unstarted.close()  # never handed to the loop thread: it held the sender
        self._over()

    def _over(self) -> None:
        """The send is over: its sender may start the next one."""
        if self._sender._pending is self:
            self._sender._pending = None

    def __repr__(self) -> str:
        # (Not done(): a repr hands nothing to the loop thread.)
        state = "done" if self._future.done() else "pending"
        return f"<SendHandle version={self._version} workers={list(self._worker_ids)} {state}>"


class WeightReceiver:
    """Blocking front of an :class:`AsyncWeightReceiver`.

    Get it from ``scheme.get_receiver()`` after ``scheme.init_on_receiver(...)``.

    A worker takes its updates in one of two ways:

    - at its own safe point, by calling :meth:`receive`;
    - as they arrive, after :meth:`start_applier`: a thread of weightsync's
      applies each one between two steps of the model (two forward calls of
      an ``nn.Module``, or two :meth:`step` blocks), never during one.
    """

    def __init__(self, receiver: AsyncWeightReceiver) -> None:
        self._receiver = receiver
        self._closed = False
        self._guard = StepGuard()
        self._applier: threading.Thread | None = None
        self._stop = threading.Event()
        # Signalled by the applier after each update; guards the two below.
        self._arrived = threading.Condition()
        self._reported_version: int | None = None
        self._applier_error: BaseException | None = None
        RUNTIME.acquire()

    @property
    def async_receiver(self) -> AsyncWeightReceiver:
        return self._receiver

    @property
    def version(self) -> int | None:
        """The last version applied on this worker; None before the first."""
        return self._receiver.version

    @property
    def applying_in_background(self) -> bool:
        """Whether updates are applied as they arrive (:meth:`start_applier`)."""
        return self._applier is not None

    def announce(self) -> None:
        RUNTIME.call(self._receiver.announce)

    def _refuse_in_coroutine(self, what: str, instead: str) -> None:
        RUNTIME.refuse_in_coroutine(
            what, f"await scheme.get_async_receiver().{instead}", model_id=self._receiver.model_id
        )

    def _check_open(self) -> None:
        if self._closed:
            raise WeightSyncStateError(
                f"the receiver of model {self._receiver.model_id!r} is shut down",
                model_id=self._receiver.model_id,
            )

    def receive(self, timeout: float | None = None) -> int | None:
        """Apply the newest pending update, if any; see :meth:`AsyncWeightReceiver.receive`.

        Blocks at most ``timeout`` seconds (None: does not wait). Where
        updates are applied as they arrive (a Ray actor, or after
        :meth:`start_applier`) it applies nothing: it returns the newest
        version applied since the previous call, waiting up to ``timeout``
        for one, or None; after :meth:`start_applier` it raises what stopped
        the applier (e.g. :class:`SenderLostError`).

        :raises BlockingCallError: called inside a coroutine where it may
            wait or copy (await :meth:`AsyncWeightReceiver.receive` there);
            with no ``timeout`` where updates are applied as they arrive, it
            only reads the version, and is allowed.
        """
        if timeout or not (self._applier is not None or self._receiver.endpoint.pushes):
            self._refuse_in_coroutine("receive()", "receive(...)")
        self._check_open()
        if self._applier is not None:
            return self._take_background(timeout or 0.0)
        # Wait on this thread, outside any event loop, until something may be
        # pending: a poll that finds nothing never enters the loop.
        if not timeout:  # (a safe point's poll: no clock to read)
            return self._receive_now(0.0) if self._receiver.wait_ready(0.0) else None
        deadline = time.monotonic() + timeout
        if not self._receiver.wait_ready(timeout):
            return None
        return self._receive_now(max(deadline - time.monotonic(), 0.0))

    def _receive_now(self, timeout: float) -> int | None:
        """Apply what is pending, waiting up to ``timeout`` if nothing is.

        The usual case (an update pending, its ack fits in the channel) is
        done on this thread without entering an event loop: on a machine
        with as many processes as cores, a loop's machinery costs a worker
        several times its copy. Everything else (waiting, the first call,
        a copy that raced the next version) runs the coroutine."""
        receiver = self._receiver
        got = RUNTIME.run_now(receiver.receive_ready)
        if got is not NEEDS_LOOP:
            return got
        if receiver.unsent:
            return RUNTIME.call(receiver.finish_unsent)
        return RUNTIME.call(receiver.receive, timeout)

    def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Block until ``version`` or a newer one is applied; return the
        version applied. Applies pending updates while it waits (after
        :meth:`start_applier`, or on a Ray actor, it only waits).

        ``timeout``: seconds (None: the default of 60 s).

        :raises WaitTimeoutError: not applied in time; nothing else changed.
        :raises SenderLostError: the sender died or shut down first.
        :raises BlockingCallError: called inside a coroutine (await
            :meth:`AsyncWeightReceiver.wait_for_version` there).
        """
        self._refuse_in_coroutine("wait_for_version()", "wait_for_version(...)")
        self._check_open()
        if self._applier is None:
            return RUNTIME.call(self._receiver.wait_for_version, version, timeout)
        wait = DEFAULT_TIMEOUT if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._arrived:
            while True:
                applied = self._receiver.version
                if applied is not None and applied >= version:
                    return applied
                if isinstance(self._applier_error, SenderLostError):
                    raise self._applier_error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeoutError(
                        f"version {version} of model {self._receiver.model_id!r} was not applied "
                        f"within {wait:g} s (applied: {applied})",
                        model_id=self._receiver.model_id,
                    )
                self._arrived.wait(left)

    # -- applying in the background --------------------------------------------
    def step(self) -> contextlib.AbstractContextManager[None]:
        """A block during which no update is applied in the background (for
        a model that is not an ``nn.Module``, whose forward calls are
        guarded already). Nests; any number of threads may hold one."""
        return self._guard.step()

    def set_model(self, model: Any) -> None:
        """Apply the next updates to ``model`` (same layout) instead; its
        forward calls become the steps. Waits for an update being applied."""
        with self._guard.writing(self._stop) as got:
            self._receiver.set_model(model)
            if got and self._applier is not None:
                self._guard.attach(model)

    def start_applier(self) -> None:
        """Apply every update as it arrives, from now on, on a thread of
        weightsync's, between two steps of the model. Idempotent.

        Each update is acked once applied (and ``on_update`` ran), as
        :meth:`receive` would. Does not block.
        """
        self._check_open()
        if self._applier is not None:
            return
        self._guard.attach(self._receiver.model)
        self._reported_version = self._receiver.version
        thread = threading.Thread(
            target=self._apply_loop, name=f"weightsync-applier-{self._receiver.model_id}", daemon=True
        )
        with out_of_resources("start weightsync's applier thread"):
            thread.start()
        self._applier = thread

    def _apply_loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._receiver.wait_ready(_APPLIER_POLL):
                    continue
                with self._guard.writing(self._stop) as got:
                    if not got:
                        break  # stopping
                    try:
                        version = self._receive_now(0.0)
                    except SenderClosedError as exc:
                        self._applier_failed(exc)
                        break
                    except SenderLostError as exc:
                        _log.warning("weightsync: %s", exc)
                        self._applier_failed(exc)
                        break
                    except Exception as exc:
                        # The sender was told (the model is untouched, or the
                        # update applied and on_update raised); go on.
                        _log.warning("weightsync: an update was not applied: %s", exc)
                        self._applier_failed(exc)
                        continue
                if version is not None:
                    with self._arrived:
                        self._arrived.notify_all()
        finally:
            RUNTIME.close_thread_loop()
            with self._arrived:
                self._arrived.notify_all()

    def _applier_failed(self, exc: BaseException) -> None:
        with self._arrived:
            self._applier_error = exc
            self._arrived.notify_all()

    def _take_background(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                version = self._receiver.version
                if version != self._reported_version:
                    self._reported_version = version
                    return version
                error = self._applier_error
                if error is not None:
                    if not isinstance(error, SenderLostError):
                        self._applier_error = None  # reported once; the applier goes on
                    raise error
                left = deadline - time.monotonic()
                if left <= 0 or self._applier is None or not self._applier.is_alive():
                    return None
                self._arrived.wait(left)

    def _stop_applier(self) -> None:
        self._stop.set()
        self._guard.wake()
        thread, self._applier = self._applier, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._guard.detach()

    def shutdown(self) -> None:
        """Stop the applier (after the update it is applying, if any), close
        the endpoint. Idempotent.

        :raises BlockingCallError: called inside a coroutine while the
            endpoint is open (await :meth:`AsyncWeightReceiver.aclose` there;
            this then has little left to do)."""
        if self._closed:
            return
        if not self._receiver.closed:
            self._refuse_in_coroutine("shutdown()", "aclose()")
        self._closed = True
        try:
            self._stop_applier()
            if not self._receiver.closed:
                RUNTIME.call(self._receiver.aclose)
        finally:
            RUNTIME.release()
