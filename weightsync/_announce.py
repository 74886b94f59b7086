"""Waiting for a sender's workers to announce themselves.

A worker announces itself (its layout, its devices) once it has called
``init_on_worker``. The wait runs for every target at once under one
deadline, and a failing worker never cancels the others: each worker's
error stays its own, and a target that neither announced itself nor failed
by the deadline gets an :class:`AckTimeoutError`. Used by
``wait_for_workers()`` and by a send to workers still starting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from ._exceptions import AckTimeoutError, WorkerError, combine_worker_errors
from ._transports._base import SenderTransport

__all__ = ["Announcements"]

# How often a wait for workers to announce themselves logs who it waits for.
_PROGRESS_EVERY = 5.0
# A send that has waited this long for workers to announce themselves says
# so once, at WARNING: the user did not ask for the wait, and may not know
# why the send stands still.
_WARN_AFTER = 5.0

# Why workers are most often never heard of: ends the error of a wait for them.
_NEVER_ANNOUNCED = (
    "A worker is announced by its init_on_worker() call (init_on_receiver() in torchrl); likely causes: "
    "the worker never calls it for this model; a worker started with 'spawn' or 'forkserver' failed "
    "to import its code before it got there (its traceback is in that worker's stderr); the worker "
    "was given the trainer's end of its pipe (the trainer passes one end to init_on_sender, the "
    "worker gets the other)"
)
_log = logging.getLogger("weightsync")

#: A step for one worker: given its transport, done when it is.
Step = Callable[[SenderTransport], Awaitable[Any]]


class Announcements:
    """Waits for the announcements of one sender's workers: over
    ``transports`` (the sender's own mapping, which membership changes
    update in place)."""

    def __init__(self, transports: Mapping[int, SenderTransport], model_id: str | None) -> None:
        self.transports = transports
        self.model_id = model_id

    async def _each(
        self,
        targets: list[int],
        step: Step,
        deadline: float,
        failures: dict[int, WorkerError],
        version: int | None,
        limit: str,
        first: bool = False,
        name: bool = True,
    ) -> None:
        """Run ``step(transport)`` for every target concurrently, all under
        ``deadline`` (the loop's clock); each failure goes to ``failures``,
        and (``name``) an AckTimeoutError to each target that neither
        finished nor failed by then. ``first``: return as soon as one
        target finished or failed (the others' steps are cancelled, not
        failed)."""
        done: set[int] = set()

        # One cancel scope for all: the deadline is the same for every worker.
        with anyio.move_on_after(max(deadline - anyio.current_time(), 0)) as scope:

            async def one(wid: int) -> None:
                try:
                    await step(self.transports[wid])
                    done.add(wid)
                except WorkerError as exc:
                    failures[wid] = exc
                if first:
                    scope.cancel()

            if len(targets) == 1:
                await one(targets[0])
            else:
                async with anyio.create_task_group() as group:
                    for wid in targets:
                        group.start_soon(one, wid)
        if not name or (first and (done or any(w in failures for w in targets))):
            return
        for wid in targets:
            if wid not in done and wid not in failures:
                failures[wid] = AckTimeoutError(
                    f"worker {wid} (model {self.model_id!r}) did not announce itself (start, then call "
                    f"init_on_worker() for this model) within {limit}",
                    worker_id=wid,
                    model_id=self.model_id,
                    version=version,
                )

    async def announced(
        self,
        targets: list[int],
        timeout: float,
        version: int | None = None,
        *,
        limit: str | None = None,
        warn: str | None = None,
        first: bool = False,
        name: bool = True,
    ) -> dict[int, float]:
        """Wait for every target's announcement (up to ``timeout`` seconds); their times (see
        :meth:`AsyncWeightSender.wait_for_workers`), logging who is still awaited every
        _PROGRESS_EVERY seconds (``warn``: once at WARNING first, after _WARN_AFTER, ending
        with that advice).
        ``limit`` names the timeout in the error (default: wait_for_workers()'s).
        ``first``: return once one of them has announced itself or failed (a
        send goes on with those there, the others joining it as they come).
        ``name=False``: name none of those that did not announce themselves
        in time (with ``timeout=0``: take the announcements that came).

        :raises WorkerError: naming every target that died or was late.
        """
        started = time.perf_counter()
        times = {w: 0.0 for w in targets if self.transports[w].layout is not None}
        waiting = [w for w in targets if w not in times]
        if not waiting:
            return times
        failures: dict[int, WorkerError] = {}
        if limit is None:
            limit = f"wait_for_workers()'s timeout of {timeout:g} s"

        async def announce(transport: SenderTransport) -> None:
            await transport.connect()
            times[transport.worker_id] = time.perf_counter() - started

        deadline = anyio.current_time() + timeout
        async with anyio.create_task_group() as group:
            group.start_soon(self._log_progress, targets, times, limit, started, warn)
            await self._each(waiting, announce, deadline, failures, version, limit, first, name)
            group.cancel_scope.cancel()
        if failures:
            for err in failures.values():
                if isinstance(err, AckTimeoutError):
                    err.advice = _NEVER_ANNOUNCED
            raise combine_worker_errors(failures, model_id=self.model_id, version=version)
        return times

    async def _log_progress(
        self, targets: list[int], times: dict[int, float], limit: str, started: float, warn: str | None
    ) -> None:
        """Every _PROGRESS_EVERY seconds, until cancelled: which of
        ``targets`` announced themselves (``times``) and which not yet; with
        ``warn`` (advice), once at WARNING first (a send waiting for them)."""
        if warn is not None:
            await anyio.sleep(_WARN_AFTER)
            missing = [w for w in targets if w not in times]
            _log.warning(
                "weightsync: a send of model %r has waited %.0f s for worker(s) %s to announce "
                "themselves (it waits at most %s)%s",
                self.model_id,
                time.perf_counter() - started,
                ", ".join(map(str, missing)),
                limit,
                f"; {warn}" if warn else "",
            )
        while True:
            await anyio.sleep(_PROGRESS_EVERY)
            waited = time.perf_counter() - started
            missing = [w for w in targets if w not in times]
            _log.info(
                "weightsync: model %r: %d of %d workers announced themselves after %.0f s "
                "(waiting at most %s); still waiting for worker(s) %s",
                self.model_id,
                len(targets) - len(missing),
                len(targets),
                waited,
                limit,
                ", ".join(map(str, missing)),
            )
