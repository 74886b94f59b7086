"""A sharded trainer's sends: every rank of a sender group sends its own
part of each version, collectively (:class:`GroupSender`).

A rank sends its part to each class of workers with a sender of its own
(one per class, made by the scheme's plan), as the group's version
number; then every rank publishes its outcome and reads the others'
(``SenderGroup.exchange``), and every rank returns the same report or
raises the same error (``_sender_group.merge``). ``send_async()`` splits
that in two: the parts are staged (copied out of the model) before it
returns, and ``wait_async()`` gathers the acks, then the outcomes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._exceptions import InvalidWeightsError, WeightMismatchError, WeightSyncStateError, WorkerError
from .._facade import SendHandle, WeightSender
from .._packing import Keys
from .._send import SendOptions, refuse_options
from .._sender import SendReport
from .._sender_group import Outcome, combine, merge
from .._shards import local_tensors
from .._strategy import values_of

__all__ = ["GroupSender"]


@dataclass
class _Staged:
    """A ``send_async()`` of the group: its version, when the others'
    outcomes are waited for no more, and each class's send (or what ended
    it before anything was staged)."""

    seq: int
    until: float
    handles: list[SendHandle]
    early: Outcome | None


class GroupSender:
    """The sender of one rank of a sharded trainer: every call is
    collective (every rank makes it, in the same order), sends this rank's
    own part of the weights (``weights``: its state dict, DTensors as they
    are; None: the model given at init) to every worker, and returns the
    same report, or raises the same error, on every rank. A worker applies
    a version only once every rank's part of it came. Returned by
    ``scheme.get_sender()`` on each rank; the scheme's ``send()`` and
    ``connect()`` go through it.
    """

    def __init__(self, scheme: Any, group: Any) -> None:
        # (The rank's DistributedWeightSyncScheme, which owns the plan and
        # the class senders, and its SenderGroup.)
        self._scheme = scheme
        self._group = group
        self._staged: _Staged | None = None
        # Sends of a version that Ctrl-C ended on this rank before their
        # acks were gathered: the next call waits for them to end first
        # (each within its deadline), so their senders are free again.
        self._abandoned: list[SendHandle] = []

    @property
    def pending(self) -> bool:
        """Whether a ``send_async()`` waits for its :meth:`wait_async`."""
        return self._staged is not None

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
        """Send this rank's part of a new version and block until every
        rank's send ended (each within ``timeout``, the scheme's by
        default, and 2.5 s more for the others' outcomes).

        :raises SenderGroupError: a rank did not finish the send in time
            (it died, was stopped or interrupted), or raised; on every
            other rank, naming it.
        :raises WorkerError: as every send; the same on every rank.
        :raises ValueError: ``worker_ids``, ``keys``, ``partial`` or
            ``verify``: a sharded trainer sends whole versions to every
            worker, checked as the scheme says.
        :raises WeightSyncStateError: a ``send_async()`` is pending.
        """
        self._refuse("send()", unknown, worker_ids, keys, partial, verify)
        return self._send(weights, timeout, connect=False)

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
    ) -> None:
        """Stage this rank's part of a new version and return: blocks while
        the part is copied out of the model (the first send also makes the
        plan, collectively, and waits for the workers; on the ranks' one
        host, rank 0 also waits for every rank's part to be in the host's
        buffer), not while the workers take it; once this returns the
        weights may change, and every worker still gets them as they were
        at this call. Its acks are gathered in the background;
        :meth:`wait_async` (on every rank) ends it. Every error of the
        send, one found before anything was staged included, is raised by
        :meth:`wait_async`.

        :raises ValueError: as :meth:`send`.
        :raises WeightSyncStateError: a ``send_async()`` is pending.
        """
        self._refuse("send_async()", unknown, worker_ids, keys, partial, verify)
        scheme = self._scheme
        seq, wait, until, first = self._begin(timeout, connect=False)
        handles: list[SendHandle] = []
        early: Outcome | None = None
        try:
            if first:
                scheme._plan_group(time.monotonic() + wait)
            for sender, part in self._parts(weights, seq, time.monotonic() + wait):
                if first:
                    sender.wait_for_workers(timeout=wait)
                handles.append(sender._stage(part, None, SendOptions(wait, call="send_async()", version=seq)))
        except Exception as exc:
            early = self._failed(seq, exc)
        except BaseException as exc:
            self._abandoned += handles
            self._interrupted(seq, exc)
            raise
        self._staged = _Staged(seq, until, handles, early)

    def wait_async(self, timeout: float | None = None) -> SendReport:
        """Block until the pending ``send_async()`` ended on every rank;
        return its report, or raise its error, as :meth:`send` does.

        With ``timeout=None`` it waits as long as the send's own deadline
        (and 2.5 s more for the other ranks' outcomes).

        :raises WeightSyncStateError: no ``send_async()`` is pending.
        :raises TimeoutError: ``timeout`` passed before this rank's own
            sends ended (the send stays pending; call again).
        """
        staged = self._staged
        if staged is None:
            raise WeightSyncStateError(
                "wait_async() with no send_async() pending", model_id=self._scheme._model_id
            )
        ends = None if timeout is None else time.monotonic() + timeout
        results: list[SendReport | Exception] = []
        try:
            for handle in staged.handles:
                left = None if ends is None else max(ends - time.monotonic(), 0.0)
                try:
                    results.append(handle.wait(left))
                except TimeoutError:
                    raise
                except Exception as exc:
                    results.append(exc)
        except TimeoutError:
            # (Those already waited for return at once when waited again.)
            raise
        except BaseException as exc:
            self._staged = None
            self._abandoned += staged.handles
            self._interrupted(staged.seq, exc)
            raise
        self._staged = None
        outcome = staged.early if staged.early is not None else self._combined(staged.seq, results)
        return self._finish(staged.seq, outcome, staged.until)

    # -- the scheme's own calls ------------------------------------------------------
    def _send(self, weights: Any, timeout: float | None, *, connect: bool) -> SendReport:
        """One blocking collective send (see :meth:`send`); the first makes
        the plan; with ``connect``, each rank first waits for its workers
        (up to ``timeout`` more), and a rank whose workers did not all come
        says so to the others as its outcome, as a send's failure would."""
        scheme = self._scheme
        seq, wait, until, first = self._begin(timeout, connect=connect)
        try:
            if first:
                scheme._plan_group(time.monotonic() + wait)
            sends = self._parts(weights, seq, time.monotonic() + wait)
            results = WeightSender.send_each_as(seq, sends, timeout=wait, connect=connect or first)
            outcome = self._combined(seq, results)
        except Exception as exc:
            outcome = self._failed(seq, exc)
        except BaseException as exc:
            self._interrupted(seq, exc)
            raise
        return self._finish(seq, outcome, until)

    def _refuse(self, call: str, unknown: dict[str, Any], *given: Any) -> None:
        refuse_options(unknown, call)
        worker_ids, keys, partial, verify = given
        if worker_ids is not None or keys is not None or partial or verify is not None:
            raise ValueError(
                f"{type(self._scheme).__name__}: a sharded trainer's {call} sends whole versions to every "
                "worker, checked as the scheme says (verify=...): it takes no worker_ids, keys, partial or "
                "verify"
            )
        if self._staged is not None:
            raise WeightSyncStateError(
                f"{call} while a send_async() is pending; call wait_async() first",
                model_id=self._scheme._model_id,
            )
        abandoned, self._abandoned = self._abandoned, []
        for handle in abandoned:
            with contextlib.suppress(Exception):
                handle.wait()

    def _begin(self, timeout: float | None, *, connect: bool) -> tuple[int, float, float, bool]:
        """A new version of the group: its number, its deadline (s), until
        when the others' outcomes are waited for (``time.monotonic()``), and
        whether it is the first (its plan is made first)."""
        from .._transports._distributed._group import GRACE

        scheme, group = self._scheme, self._group
        group.seq += 1
        wait = scheme.timeout if timeout is None else timeout
        first = scheme._class_senders is None
        until = time.monotonic() + (2 * wait if connect or first else wait) + GRACE
        return group.seq, wait, until, first

    def _parts(self, weights: Any, seq: int, until: float) -> list[tuple[WeightSender, Any]]:
        """Each class's sender, and what it sends: this rank's part of
        ``weights`` cut to the class; or, for a class on the ranks' one
        host, rank 0's view of the host buffer, into which every rank first
        writes its part of send ``seq`` (rank 0 waits for them until
        ``until``, ``time.monotonic()``; the others have nothing to send).

        :raises SenderGroupError: (rank 0) a rank did not write its part.
        """
        scheme, group = self._scheme, self._group
        assert scheme._class_senders is not None
        tensors = values_of(scheme._model if weights is None else weights)
        buffers = scheme._host_buffers
        if buffers:
            error: BaseException | None = None
            try:
                for buffer in buffers:
                    buffer.write(tensors, group.part, seq)
            except BaseException as exc:
                error = exc
                raise
            finally:
                if group.rank != 0:
                    # (Rank 0 hears of it now, not at the deadline.)
                    group.staged(seq, error)
            if group.rank == 0:
                group.wait_staged(seq, until)
        sends = [(sender, local_tensors(tensors, group.part, sub)) for sub, sender in scheme._class_senders]
        return sends + [(b.sender, b.views) for b in buffers if b.sender is not None]

    def _combined(self, seq: int, results: list[SendReport | Exception]) -> Outcome:
        return combine(self._group.rank, seq, results)

    def _failed(self, seq: int, exc: Exception) -> Outcome:
        """This rank's outcome of send ``seq`` that raised ``exc``."""
        group = self._group
        if isinstance(exc, WeightMismatchError | InvalidWeightsError):
            return Outcome(group.rank, seq, error=f"{type(exc).__name__}: {exc}", refused=exc)
        if isinstance(exc, WorkerError):
            failures = dict(exc.failures) or dict.fromkeys(exc.worker_ids, exc)
            return Outcome(group.rank, seq, failures=failures, version=exc.version)
        return Outcome(group.rank, seq, error=f"{type(exc).__name__}: {exc}")

    def _interrupted(self, seq: int, exc: BaseException) -> None:
        """Ctrl-C on this rank: the others hear of it now, not at the deadline."""
        group = self._group
        with contextlib.suppress(Exception):
            group.exchange(seq, Outcome(group.rank, seq, error=type(exc).__name__), time.monotonic())

    def _finish(self, seq: int, outcome: Outcome, until: float) -> SendReport:
        """Publish this rank's ``outcome``, read the others' (until
        ``until``), and return the group's report or raise its error."""
        group = self._group
        outcomes, dead = group.exchange(seq, outcome, until)
        # A rank that skipped versions brings every rank's count up to it.
        group.seq = max([group.seq] + [o.version for o in outcomes.values() if o.version is not None])
        return merge(outcomes, group.size, seq, self._scheme._model_id, dead)
