"""The synchronous facade: blocking calls over the async core.

Two ways in, one coroutine core:

- A blocking call (``send()``, ``receive()``) runs the coroutine to the end on
  a private asyncio loop of the calling thread, created once per thread. The
  caller is blocked anyway, so no other thread needs to be woken: on this
  2-core machine a hop into a loop thread through a ``BlockingPortal`` costs
  about 130 us a call, ``run_until_complete`` on a kept loop about 20 us
  (asyncio's loop; uvloop's re-arms its signal handling on every run and
  costs about 80 us there). A blocking ``receive()`` first waits on the
  calling thread itself (``select`` on the pipe and the sender's pidfd), so a
  poll that finds nothing never enters a loop at all.
- A call that must go on in the background (``send_async()``), or a blocking
  call from a thread that already runs an event loop (a notebook, an async
  app), goes through the process-wide loop thread, entered with an anyio
  ``BlockingPortal``; the calling thread blocks while it waits. That loop runs
  on uvloop when uvloop is installed, unless ``WEIGHTSYNC_LOOP=asyncio``.

A blocking call from the loop thread itself raises instead of deadlocking.
The loop thread starts on first use and, like the private loops, is closed
when the last sender or receiver is shut down, so an idle process holds no
weightsync thread. After ``fork`` the child forgets the parent's loops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ._exceptions import WeightSyncStateError
from ._receiver import AsyncWeightReceiver
from ._sender import AsyncWeightSender, SendReport
from ._transports._base import caller_is_blocked

__all__ = ["WeightReceiver", "WeightSender", "loop_thread_name"]

T = TypeVar("T")
loop_thread_name = "weightsync-loop"


def _backend_options() -> dict[str, Any]:
    choice = os.environ.get("WEIGHTSYNC_LOOP", "auto")
    if choice == "asyncio":
        return {}
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise
        return {}
    return {"use_uvloop": True}


def _thread_runs_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class _Runtime:
    """The process-wide loop thread and the per-thread private loops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._portal: BlockingPortal | None = None
        self._thread: threading.Thread | None = None
        self._users = 0
        self._local = threading.local()
        self._private: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

    # -- the loop thread ---------------------------------------------------
    def _start(self) -> BlockingPortal:
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()

        async def main() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(main, backend="asyncio", backend_options=_backend_options())
            except BaseException as exc:  # surfaced to the thread that waits on ready
                if not ready.done():
                    ready.set_exception(exc)

        thread = threading.Thread(target=run, name=loop_thread_name, daemon=True)
        thread.start()
        self._thread = thread
        return ready.result()

    def _check_not_loop_thread(self) -> None:
        if self._thread is not None and threading.current_thread() is self._thread:
            raise WeightSyncStateError(
                "a blocking weightsync call was made from weightsync's own event-loop thread; "
                "await the async API (get_async_sender / get_async_receiver) there instead"
            )

    def portal(self) -> BlockingPortal:
        """The loop thread's portal, started on first use."""
        self._check_not_loop_thread()
        with self._lock:
            if self._portal is None:
                self._portal = self._start()
            return self._portal

    def start(self, func: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``func(*args)`` in the background on the loop thread."""
        return self.portal().start_task_soon(func, *args)

    # -- blocking calls ----------------------------------------------------
    def call(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``func(*args)`` to the end and return its result, blocking."""
        self._check_not_loop_thread()
        if _thread_runs_a_loop():
            return self.portal().call(func, *args)
        loop = getattr(self._local, "loop", None)
        if loop is None or loop.is_closed():
            loop = asyncio.new_event_loop()
            self._local.loop = loop
            with self._lock:
                self._private.add(loop)
        token = caller_is_blocked.set(True)
        try:
            task: asyncio.Task[T] = loop.create_task(func(*args))  # type: ignore[arg-type]
            try:
                return loop.run_until_complete(task)
            except BaseException:
                # Interrupted (Ctrl-C): cancel the coroutine so its cancel
                # scopes and channels end cleanly before the error goes on.
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        loop.run_until_complete(task)
                raise
        finally:
            caller_is_blocked.reset(token)

    # -- lifetime ------------------------------------------------------------
    def acquire(self) -> None:
        with self._lock:
            self._users += 1

    def release(self) -> None:
        """Drop one user; the last one closes the private loops and stops the
        loop thread."""
        with self._lock:
            self._users = max(self._users - 1, 0)
            if self._users:
                return
            private = [loop for loop in self._private if not loop.is_running()]
            for loop in private:
                self._private.discard(loop)
            portal, thread = self._portal, self._thread
            if thread is not None and threading.current_thread() is thread:
                portal = thread = None  # cannot stop from inside; the next release will
            else:
                self._portal = self._thread = None
        for loop in private:
            loop.close()
        if portal is not None and thread is not None:
            portal.call(portal.stop)
            thread.join(timeout=10)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._portal = None
        self._thread = None
        self._users = 0
        self._local = threading.local()
        self._private = weakref.WeakSet()


LOOP = _Runtime()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=LOOP._after_fork)


class WeightSender:
    """Blocking front of an :class:`AsyncWeightSender`.

    Get it from ``scheme.get_sender()`` after ``scheme.init_on_sender(...)``.
    Calls may come from any thread, including one that runs its own event
    loop (it is blocked while it waits); not from weightsync's loop thread.
    """

    def __init__(self, sender: AsyncWeightSender) -> None:
        self._sender = sender
        self._pending: concurrent.futures.Future[SendReport] | None = None
        self._closed = False
        LOOP.acquire()

    @property
    def async_sender(self) -> AsyncWeightSender:
        return self._sender

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

    def connect(self, worker_ids: int | Iterable[int] | None = None, *, timeout: float | None = None) -> None:
        """Block until the workers (default: all) announced themselves.

        :raises WorkerError: naming every worker that died or did not show up in time.
        """
        self._check("connect()")
        LOOP.call(lambda: self._sender.connect(worker_ids, timeout=timeout))

    def send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
    ) -> SendReport:
        """Send and block until every targeted worker applied and acked.

        Arguments and errors as :meth:`AsyncWeightSender.send`.

        :raises RuntimeError: a ``send_async()`` is pending.
        """
        self._check("send()")
        return LOOP.call(lambda: self._sender.send(weights, worker_ids, timeout=timeout))

    def send_async(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Start a send and return at once; :meth:`wait_async` finishes it.

        The weights are read before the acks come in, but not necessarily
        before this returns: do not change them until ``wait_async()`` returns.

        :raises RuntimeError: a previous ``send_async()`` is still pending.
        """
        self._check("send_async()")
        self._pending = LOOP.start(lambda: self._sender.send(weights, worker_ids, timeout=timeout))

    def wait_async(self, timeout: float | None = None) -> SendReport:
        """Block until the pending ``send_async()`` is done; re-raise its error.

        With ``timeout=None`` it waits as long as the send's own deadline.

        :raises RuntimeError: no ``send_async()`` is pending.
        :raises TimeoutError: ``timeout`` passed first (the send stays pending).
        """
        if self._pending is None:
            raise WeightSyncStateError(
                "wait_async() with no send_async() pending", model_id=self._sender.model_id
            )
        future = self._pending
        try:
            return future.result(timeout)
        finally:
            # Only a wait that timed out leaves the send pending; a send that
            # failed (even with a TimeoutError of its own) is over.
            if future.done():
                self._pending = None

    def update_weights(self, weights: Any) -> SendReport:
        """Legacy name of ``send(weights)`` to all workers."""
        return self.send(weights)

    def shutdown(self) -> None:
        """Finish a pending send (errors ignored), close the channels. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pending is not None:
            with contextlib.suppress(BaseException):
                self._pending.result()
            self._pending = None
        try:
            LOOP.call(self._sender.aclose)
        finally:
            LOOP.release()


class WeightReceiver:
    """Blocking front of an :class:`AsyncWeightReceiver`.

    Get it from ``scheme.get_receiver()`` after ``scheme.init_on_receiver(...)``.
    """

    def __init__(self, receiver: AsyncWeightReceiver) -> None:
        self._receiver = receiver
        self._closed = False
        LOOP.acquire()

    @property
    def async_receiver(self) -> AsyncWeightReceiver:
        return self._receiver

    def announce(self) -> None:
        LOOP.call(self._receiver.announce)

    def receive(self, timeout: float | None = None) -> int | None:
        """Apply the newest pending update, if any; see :meth:`AsyncWeightReceiver.receive`.

        Blocks at most ``timeout`` seconds (None: does not wait). On a Ray
        actor, where updates are applied as they arrive, it never blocks and
        returns the newest version applied since the previous call, or None.
        """
        if self._closed:
            raise WeightSyncStateError(
                f"the receiver of model {self._receiver.model_id!r} is shut down",
                model_id=self._receiver.model_id,
            )
        transport = self._receiver.transport
        if transport.applies_on_arrival:
            # Updates were applied as they came (Ray actors): only report.
            return self._receiver.take_applied()
        # Wait on this thread, outside any event loop, until something may be
        # pending: a poll that finds nothing never enters the loop, and one
        # that does runs the coroutine without it ever suspending.
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            if transport.wait_ready(max(deadline - time.monotonic(), 0.0)):
                version = LOOP.call(self._receiver.receive, 0.0)
                if version is not None:
                    return version
            if time.monotonic() >= deadline:
                return None

    def shutdown(self) -> None:
        """Close the endpoint. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            LOOP.call(self._receiver.aclose)
        finally:
            LOOP.release()
