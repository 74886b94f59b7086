"""The synchronous facade: blocking calls over the async core.

Every call enters the event loop through the runtime (``_runtime``), which
knows how: a private loop of the calling thread for a blocking call, the
process-wide loop thread for background work. The async objects know nothing
of this.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterable
from typing import Any

from ._exceptions import WeightSyncStateError
from ._receiver import AsyncWeightReceiver
from ._runtime import RUNTIME
from ._sender import AsyncWeightSender, SendReport

__all__ = ["WeightReceiver", "WeightSender"]


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
        RUNTIME.acquire()

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
        RUNTIME.call(lambda: self._sender.connect(worker_ids, timeout=timeout))

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
        return RUNTIME.call(lambda: self._sender.send(weights, worker_ids, timeout=timeout))

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
        self._pending = RUNTIME.start(lambda: self._sender.send(weights, worker_ids, timeout=timeout))

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
            RUNTIME.call(self._sender.aclose)
        finally:
            RUNTIME.release()


class WeightReceiver:
    """Blocking front of an :class:`AsyncWeightReceiver`.

    Get it from ``scheme.get_receiver()`` after ``scheme.init_on_receiver(...)``.
    """

    def __init__(self, receiver: AsyncWeightReceiver) -> None:
        self._receiver = receiver
        self._closed = False
        RUNTIME.acquire()

    @property
    def async_receiver(self) -> AsyncWeightReceiver:
        return self._receiver

    def announce(self) -> None:
        RUNTIME.call(self._receiver.announce)

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
        # Wait on this thread, outside any event loop, until something may be
        # pending: a poll that finds nothing never enters the loop, and one
        # that does runs the coroutine without it ever suspending.
        deadline = time.monotonic() + (timeout or 0.0)
        if not self._receiver.wait_ready(timeout or 0.0):
            return None
        return RUNTIME.call(self._receiver.receive, max(deadline - time.monotonic(), 0.0))

    def shutdown(self) -> None:
        """Close the endpoint. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            RUNTIME.call(self._receiver.aclose)
        finally:
            RUNTIME.release()
