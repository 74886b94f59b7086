"""The async sender: prepare a packet once, fan it out, gather the acks."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from ._copy import WireCast, usable_cores
from ._digest import digests
from ._exceptions import (
    AckTimeoutError,
    UnknownWorkerError,
    WeightMismatchError,
    WeightSyncStateError,
    WorkerError,
    combine_worker_errors,
)
from ._offload import NEEDS_LOOP, NeedsLoop, inline_allowed, require_asyncio, run_blocking
from ._packet import DEFAULT_TIMEOUT, Manifest, Packet, describe_mismatch, signature_of
from ._strategy import ModuleReads, WeightStrategy, is_tensordict
from ._transports._base import EVERY_VERSION, SenderTransport, Staging
from ._transports._channel import ReadyWatch

# DEFAULT_TIMEOUT: from _packet
__all__ = ["DEFAULT_TIMEOUT", "AsyncWeightSender", "Keys", "PendingSend", "SendReport"]

# How long a blocked caller's gather waits in one poll before it lets its
# loop run (Ctrl-C and the deadline cancel it there): the most a Ctrl-C is
# held back while no ack comes.
_POLL_SLICE = 0.05
# How often a wait for workers to announce themselves logs who it waits for.
_PROGRESS_EVERY = 5.0
_log = logging.getLogger("weightsync")

#: Which weights a partial send takes: names, or a test on names.
Keys = Iterable[str] | Callable[[str], bool]


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
    ) -> None:
        self._sender = sender
        self.packet = packet
        #: The workers targeted.
        self.worker_ids: tuple[int, ...] = tuple(worker_ids)
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
        self._waited = False
        #: Whether the reachable workers were told (``finish_now`` tells them
        #: before it hands the send over to a loop), and those that acked.
        self.posted = False
        self.done: set[int] = set()

    @property
    def version(self) -> int:
        """The version this send carries."""
        return self.packet.version

    def abandon(self) -> None:
        """Give up a send that no worker was told of (before :meth:`wait`):
        the sender may run the next one."""
        assert not self.posted and not self._waited, "only a send not yet told or waited for"
        self._waited = True
        self._sender._busy = False

    async def wait(self) -> SendReport:
        """Block until every targeted worker acked this version, or the
        send's deadline passed; its report.

        :raises WorkerLostError: a worker died; the others still got the update.
        :raises AckTimeoutError: a worker did not ack in time (also a TimeoutError).
        :raises WorkerApplyError: a worker failed to apply; carries its message.
        :raises WeightSyncStateError: awaited a second time.
        """
        if self._waited:
            raise WeightSyncStateError(
                f"version {self.version} of model {self._sender.model_id!r} was already waited for",
                model_id=self._sender.model_id,
            )
        self._waited = True
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
        self.transports: dict[int, SenderTransport] = dict(transports)
        self.staging = staging
        self.context = context
        self.timeout = timeout
        self.version = 0
        # The last version each worker acked.
        self._acked: dict[int, int] = {}
        # The workers that may take a partial update: they acked a whole one,
        # and every send to them since.
        self._whole: set[int] = set()
        self._busy = False
        self._closed = False
        self._manifests: dict[Any, Manifest] = {}
        # The model's weights as last read, and what was derived from that
        # very read (its manifest, its tensors in manifest order): a model
        # whose tensors stay put is not checked and laid out again each send.
        self._reads = ModuleReads()
        self._derived: tuple[dict[str, torch.Tensor], Manifest, list[torch.Tensor]] | None = None
        # Watches the workers' acks of a send (_await_acks); made on first use.
        self._ready_watch: ReadyWatch | None = None

    @property
    def worker_ids(self) -> list[int]:
        return list(self.transports)

    @property
    def worker_versions(self) -> dict[int, int | None]:
        """The last version each worker acked (None: none yet), by worker id."""
        return {wid: self._acked.get(wid) for wid in self.transports}

    def _targets(self, worker_ids: int | Iterable[int] | None) -> list[int]:
        if worker_ids is None:
            return list(self.transports)
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        if not ids:
            raise ValueError(
                f"worker_ids=[] targets no worker (model {self.model_id!r}); pass None to send to all"
            )
        unknown = [w for w in ids if w not in self.transports]
        if unknown:
            raise UnknownWorkerError(
                f"unknown worker id(s) {unknown} for model {self.model_id!r}; "
                f"known: {sorted(self.transports)}",
                model_id=self.model_id,
                unknown_ids=tuple(unknown),
            )
        return list(dict.fromkeys(ids))

    def _manifest(self, tensors: Mapping[str, torch.Tensor]) -> Manifest:
        key = signature = signature_of(tensors)
        manifest = self._manifests.get(key)
        if manifest is None:
            if self._wire is not None:
                # What the workers get: float32 weights as the wire dtype.
                wire = str(self._wire.dtype).removeprefix("torch.")
                signature = tuple((n, wire if d == "float32" else d, s) for n, d, s in signature)
            manifest = self._manifests[key] = Manifest.from_signature(signature)
        return manifest

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
        tensors = self._reads.read(weights, context=self.context, model_id=self.model_id)
        if keys is not None:
            tensors = self._select(tensors, keys)
            partial = True
        derived = self._derived
        if derived is None or derived[0] is not tensors:
            manifest = self._manifest(tensors)
            # (The same list, send after send, lets the staging keep its copy plan.)
            derived = self._derived = (tensors, manifest, manifest.ordered(tensors))
        return Packet(self.version + 1, derived[1], derived[2], fanout, partial)

    def _select(self, tensors: dict[str, torch.Tensor], keys: Keys) -> dict[str, torch.Tensor]:
        if callable(keys):
            chosen = {name: t for name, t in tensors.items() if keys(name)}
        else:
            names = [keys] if isinstance(keys, str) else list(keys)
            unknown = [n for n in names if n not in tensors]
            if unknown:
                raise WeightMismatchError(
                    describe_mismatch([], unknown, [], where="the weights sent (keys=)"),
                    model_id=self.model_id,
                )
            chosen = {name: tensors[name] for name in names}
        if not chosen:
            raise ValueError(f"keys= selects no weight of model {self.model_id!r}: nothing to send")
        return chosen

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
        targets = self._targets(worker_ids)
        return await self._announced(targets, self.timeout if timeout is None else timeout)

    async def connect(
        self, worker_ids: int | Iterable[int] | None = None, *, timeout: float | None = None
    ) -> None:
        """:meth:`wait_for_workers`, returning nothing (the name torchrl's
        sender uses)."""
        await self.wait_for_workers(worker_ids, timeout=timeout)

    async def _announced(
        self, targets: list[int], timeout: float, version: int | None = None
    ) -> dict[int, float]:
        """Wait for every target's announcement; their times (see
        :meth:`wait_for_workers`), logging who is still awaited every
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
            await self._fan_out(waiting, announce, deadline, failures, "announce itself", version)
            group.cancel_scope.cancel()
        if failures:
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
        if self._busy:
            raise WeightSyncStateError(
                f"a send of model {self.model_id!r} is already in progress", model_id=self.model_id
            )
        each = self._per_worker(weights, worker_ids)
        self._busy = True
        try:
            if each is not None:
                return await self._stage_each(each, timeout, keys, partial, verify)
            return await self._stage(weights, worker_ids, timeout, keys, partial, verify)
        except BaseException:
            self._busy = False
            raise

    def _per_worker(self, weights: Any, worker_ids: int | Iterable[int] | None) -> dict[int, Any] | None:
        """``weights`` as {worker id: its weights} when it gives each worker
        its own (a mapping keyed by worker ids), else None.

        :raises ValueError: such a mapping without ``per_worker_weights=True``,
            or along with ``worker_ids``, or empty.
        :raises UnknownWorkerError: it names a worker that is not one.
        """
        if is_tensordict(weights) or not isinstance(weights, Mapping):
            return None
        ids = list(weights.keys())
        if not ids or not all(isinstance(k, int) and not isinstance(k, bool) for k in ids):
            return None  # names of tensors: the same weights for every target
        if not self.per_worker_weights:
            raise ValueError(
                f"weights keyed by worker id ({sorted(weights)}) give each worker its own, which the scheme "
                f"of model {self.model_id!r} does not: create it with per_worker_weights=True"
            )
        if worker_ids is not None:
            raise ValueError(
                "weights keyed by worker id name their workers already: pass no worker_ids "
                f"(model {self.model_id!r})"
            )
        self._targets(list(weights))  # raises for an unknown id
        return dict(weights)

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
            pending = await self._stage(weights, wid, deadline - anyio.current_time(), keys, partial, verify)
            try:
                earlier.append(await self._gather(pending, keep_busy=True))
            except WorkerError as exc:
                failures.update(exc.failures)
        pending = await self._stage(last[1], last[0], deadline - anyio.current_time(), keys, partial, verify)
        pending.earlier, pending.started = tuple(earlier), started
        pending.failures.update(failures)
        pending.worker_ids = tuple(each)
        pending.staged_seconds = time.perf_counter() - started
        return pending

    async def _stage(
        self,
        weights: Any,
        worker_ids: int | Iterable[int] | None,
        timeout: float | None,
        keys: Keys | None = None,
        partial: bool = False,
        verify: bool | None = None,
    ) -> PendingSend:
        started = time.perf_counter()
        timeout = self.timeout if timeout is None else timeout
        targets = self._targets(worker_ids)
        failures: dict[int, WorkerError] = {}
        # Every target's layout must be known before anything is staged, so a
        # mismatch is rejected with no worker touched. Workers still starting
        # are waited for first, up to the scheme's timeout, and the send's
        # deadline starts after that: a slow start is not taken for a slow
        # send.
        announce_seconds = 0.0
        if any(self.transports[w].layout is None for w in targets):
            try:
                await self._announced(targets, self.timeout, self.version + 1)
            except WorkerError as exc:
                failures.update(exc.failures)
            announce_seconds = time.perf_counter() - started
        staging_started = time.perf_counter()
        deadline = anyio.current_time() + timeout
        packet = self.prepare(weights, fanout=len(targets), keys=keys, partial=partial)
        reachable = self._check_layouts(packet, [w for w in targets if w not in failures])
        if reachable:
            verifying = self.verify if verify is None else verify
            sums: tuple[int, ...] | None = None
            if self._wire is not None:
                # Cast once, here: every staging then moves the cast bytes.
                cast = await run_blocking(packet.nbytes, self._wire.cast, packet.tensors, usable_cores())
                packet = dataclasses.replace(packet, tensors=cast)
            if self.staging is not None:
                # A staging digests what it stages, each block as it is copied.
                sums = await self.staging.stage(packet, verifying)
            if verifying:
                if sums is None:
                    sums = await run_blocking(packet.nbytes, digests, packet.tensors, usable_cores())
                packet = dataclasses.replace(packet, digests=sums)
            self.version = packet.version  # bytes moved: the version is used
            # Staged: nothing below reads the caller's tensors again (each
            # worker reads the staging), so the packet lets go of them.
            packet = dataclasses.replace(packet, tensors=())
        staged = time.perf_counter() - staging_started
        return PendingSend(
            self, packet, targets, reachable, failures, deadline, started, staged, announce_seconds
        )

    def _check_layouts(self, packet: Packet, reachable: list[int]) -> list[int]:
        """``reachable``, once ``packet`` fits the model of each of them.

        :raises WeightMismatchError: it does not fit one (nothing was sent).
        :raises WeightSyncStateError: a partial update, to a worker that has
            not applied a whole one (nothing was sent).
        """
        check = packet.manifest.check_within if packet.partial else packet.manifest.check_matches
        for wid in reachable:
            layout = self.transports[wid].layout
            if layout is not None:
                check(layout, model_id=self.model_id, where=f"the model of worker {wid}")
        behind = [w for w in reachable if w not in self._whole] if packet.partial else []
        if behind:
            raise WeightSyncStateError(
                f"a partial update of model {self.model_id!r} cannot go to worker(s) {behind}: they "
                "have not applied a whole update, or missed a send since; send them the whole model first",
                model_id=self.model_id,
            )
        return reachable

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
        shared segment, or slots), every target has announced its layout,
        the weights are the same for every target, with no wire dtype and no
        digests. Returns :data:`NEEDS_LOOP`, having changed nothing, where
        one of these does not hold (run :meth:`start_send` instead).

        Blocks for the copy. Where ``interrupted()`` is true once the copy is
        done, the send is abandoned before any worker is told, and
        KeyboardInterrupt raised. Raises what :meth:`start_send` raises.
        """
        stage_now = self._stage_now()
        verifying = self.verify if verify is None else verify
        if self._closed or self._busy or self._wire is not None or verifying or stage_now is None:
            return NEEDS_LOOP
        if self._per_worker(weights, worker_ids) is not None:
            return NEEDS_LOOP
        targets = self._targets(worker_ids)
        if any(self.transports[w].layout is None for w in targets):
            return NEEDS_LOOP  # (announcing waits)
        # Taken as start_send() takes it: a send that another thread starts
        # meanwhile is refused.
        self._busy = True
        try:
            started = time.perf_counter()
            # (The loop's clock is this one: a send finished in a loop keeps its deadline.)
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            packet = self.prepare(weights, fanout=len(targets), keys=keys, partial=partial)
            reachable = self._check_layouts(packet, targets)
            if reachable:
                stage_now(packet)
                self.version = packet.version  # bytes moved: the version is used
                packet = dataclasses.replace(packet, tensors=())
            if interrupted():
                raise KeyboardInterrupt  # (nobody would wait for the send)
        except BaseException:
            self._busy = False
            raise
        staged = time.perf_counter() - started
        return PendingSend(self, packet, targets, reachable, {}, deadline, started, staged)

    def _stage_now(self) -> Callable[[Packet], None] | None:
        """The staging's way to stage on the calling thread, if it has one:
        the pipe schemes' (a shared segment, or slots), whose transports'
        posts and acks need no loop either."""
        return getattr(self.staging, "stage_now", None)

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
        if self._stage_now() is None or pending.posted or pending._waited:
            return NEEDS_LOOP
        packet = pending.packet
        try:
            self._post(pending)
            rest = [w for w in pending.reachable if w not in pending.failures]
            watched = self._watchable(rest, packet)
            if len(watched) < len(rest):
                return pending  # (no ack is taken yet: the loop gathers them all)
            done = pending.done
            spilled = self._await_acks_now(
                watched, packet, pending.failures, done, pending.deadline, interrupted
            )
            if spilled:
                return pending  # (the loop tells them again and gathers the rest)
            self._late(rest, done, pending.failures, f"ack version {packet.version}", packet.version)
            self._record(pending)
        except BaseException:
            self._busy = False
            raise
        self._busy = False
        pending._waited = True
        return self._report(pending)

    def _await_acks_now(
        self,
        watched: dict[int, tuple[int, ...]],
        packet: Packet,
        failures: dict[int, WorkerError],
        done: set[int],
        deadline: float,
        interrupted: Callable[[], bool],
    ) -> list[int]:
        """:meth:`_await_acks` on the calling thread: waits in the poll
        itself until every watched worker acked or failed, the deadline
        (``time.monotonic()``) passes, or ``interrupted()`` (looked at at
        least every _POLL_SLICE seconds, and after every wakeup: a flooding
        worker cannot hold it off). Returns the workers that need
        :meth:`SenderTransport.deliver` after all.

        :raises KeyboardInterrupt: ``interrupted()`` turned true.
        """
        waiting = dict(watched)
        spilled: list[int] = []
        if self._ready_watch is None:
            self._ready_watch = ReadyWatch()
        with self._ready_watch.armed(in_loop=False) as watch:
            for fds in waiting.values():
                watch.watch(fds)
            ready = watch.poll(0)
            while True:
                news = [wid for wid, fds in waiting.items() if not ready.isdisjoint(fds)]
                self._take_acks(news, waiting, packet, failures, done, spilled, watch)
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    return spilled
                if interrupted():
                    raise KeyboardInterrupt
                ready = watch.poll(min(left, _POLL_SLICE))

    def _take_acks(
        self,
        news: list[int],
        waiting: dict[int, tuple[int, ...]],
        packet: Packet,
        failures: dict[int, WorkerError],
        done: set[int],
        spilled: list[int],
        watch: ReadyWatch,
    ) -> None:
        """Read what each of the ``news`` workers sent; one that acked
        ``packet`` goes to ``done``, one that failed to ``failures``, one
        that needs :meth:`SenderTransport.deliver` to ``spilled``, and
        either way it leaves ``waiting`` (and ``watch``)."""
        for wid in news:
            try:
                got = self.transports[wid].try_ack(packet)
            except WorkerError as exc:
                failures[wid] = exc
                got = True
            if got is None:
                spilled.append(wid)
            if got is not False:
                watch.forget(waiting.pop(wid))
                if got and wid not in failures:
                    done.add(wid)

    def _post(self, pending: PendingSend) -> None:
        """Tell every reachable worker of the staged update, without waiting;
        one whose pipe is full is told by :meth:`SenderTransport.deliver`."""
        for wid in pending.reachable:
            try:
                self.transports[wid].post(pending.packet)
            except WorkerError as exc:
                pending.failures[wid] = exc
        pending.posted = True

    def _record(self, pending: PendingSend) -> None:
        """Remember which workers acked ``pending``'s version."""
        packet = pending.packet
        for wid in pending.reachable:
            if wid in pending.failures:
                self._whole.discard(wid)
            else:
                self._acked[wid] = packet.version
                if not packet.partial:
                    self._whole.add(wid)

    def _report(self, pending: PendingSend) -> SendReport:
        """The report of a gathered send.

        :raises WorkerError: a worker failed (see :meth:`send`).
        """
        packet = pending.packet
        if pending.failures:
            raise combine_worker_errors(pending.failures, model_id=self.model_id, version=packet.version)
        return SendReport(
            packet.version,
            pending.worker_ids,
            packet.nbytes + sum(r.nbytes for r in pending.earlier),
            time.perf_counter() - pending.started,
            pending.staged_seconds,
            pending.announce_seconds,
        )

    async def _gather(self, pending: PendingSend, *, keep_busy: bool = False) -> SendReport:
        packet, failures, reachable = pending.packet, pending.failures, pending.reachable
        try:
            if reachable:
                # Notify every worker first, so none waits for the task
                # group's bookkeeping; the tasks then only gather the acks.
                # (Not before the caller got its weights back: on a machine
                # with few cores, the workers this wakes would hold the
                # caller up.)
                if not pending.posted:
                    self._post(pending)
                await self._fan_out(
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
            if not keep_busy:
                self._busy = False
        return self._report(pending)

    async def _fan_out(
        self,
        targets: list[int],
        step: Any,
        deadline: float,
        failures: dict[int, WorkerError],
        what: str,
        version: int | None = None,
        *,
        acks_of: Packet | None = None,
    ) -> None:
        """Run ``step(transport)`` for every target concurrently, all under the
        deadline; a failing worker never cancels the others. A target that
        neither finished nor failed by the deadline gets an AckTimeoutError.

        With ``acks_of`` (a posted packet), ``step`` gathers its acks: the
        workers whose transports can be watched by descriptor
        (:meth:`SenderTransport.ack_fds`) are waited for together by one
        waiter, and ``step`` runs only for the others."""
        done: set[int] = set()

        async def one(wid: int) -> None:
            try:
                await step(self.transports[wid])
                done.add(wid)
            except WorkerError as exc:
                failures[wid] = exc

        watched = self._watchable(targets, acks_of) if acks_of is not None else {}
        rest = [w for w in targets if w not in watched]
        # One cancel scope for the whole fan-out: the deadline is the same for
        # every worker, and a scope per worker costs more than the send itself
        # for small models.
        with anyio.move_on_after(max(deadline - anyio.current_time(), 0)):
            if not rest:
                if acks_of is not None and watched:
                    await self._await_acks(watched, acks_of, failures, done, None)
            elif len(rest) == 1 and not watched:
                await one(rest[0])
            else:
                async with anyio.create_task_group() as group:
                    for wid in rest:
                        group.start_soon(one, wid)
                    if acks_of is not None and watched:

                        def spill(wid: int) -> None:
                            group.start_soon(one, wid)

                        group.start_soon(self._await_acks, watched, acks_of, failures, done, spill)
        self._late(targets, done, failures, what, version)

    def _late(
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

    def _watchable(self, targets: list[int], packet: Packet) -> dict[int, tuple[int, ...]]:
        """{worker: descriptors} of the targets whose acks of ``packet`` one
        waiter can gather: posted, and watchable by descriptor."""
        watched = {}
        for wid in targets:
            transport = self.transports[wid]
            fds = transport.ack_fds(packet)
            if fds is not None:
                watched[wid] = fds
        return watched

    async def _await_acks(
        self,
        watched: dict[int, tuple[int, ...]],
        packet: Packet,
        failures: dict[int, WorkerError],
        done: set[int],
        spill: Callable[[int], Any] | None,
    ) -> None:
        """Gather the acks of ``packet`` from the ``watched`` workers with one
        waiter over all their descriptors: per ack one wakeup, not a task
        and a wait per worker (on a machine with few cores, that machinery
        cost more than a small model's whole send). Each worker's error stays
        its own, and a dead worker is reported as soon as its pidfd wakes
        the waiter. A worker that turns out to need :meth:`deliver` (it
        restarted) is handed to ``spill``, or delivered here after the
        others when there is none."""
        waiting = dict(watched)
        spilled: list[int] = []
        # A blocked caller's own loop has nothing else to run (no task group
        # here): the wait then blocks in the poll itself, with no loop
        # iteration per ack. It comes up for the loop every _POLL_SLICE
        # seconds, so that Ctrl-C and the deadline still cancel it.
        blocking = spill is None and inline_allowed()
        if self._ready_watch is None:
            self._ready_watch = ReadyWatch()
        with self._ready_watch.armed(in_loop=not blocking) as watch:
            for fds in waiting.values():
                watch.watch(fds)
            # Whatever is in already (on a machine with few cores the workers
            # woken by the posts may have run before this): one look at the
            # whole set, not a read attempt per worker.
            ready = watch.poll(0)
            news = [wid for wid, fds in waiting.items() if not ready.isdisjoint(fds)]
            looked = anyio.current_time()  # when the loop last ran (blocking)
            while True:
                self._take_acks(news, waiting, packet, failures, done, spilled, watch)
                if spill is not None:
                    for wid in spilled:
                        spill(wid)
                    spilled.clear()
                if not waiting:
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
                news = [wid for wid, fds in waiting.items() if not ready.isdisjoint(fds)]
        for wid in spilled:  # only without a task group: rare (a restarted worker)
            try:
                await self.transports[wid].deliver(packet)
                done.add(wid)
            except WorkerError as exc:
                failures[wid] = exc

    async def add_worker(self, worker_id: int, transport: SenderTransport) -> None:
        """Send to ``transport`` as worker ``worker_id`` from now on. An
        existing worker of that id (one that died and was restarted) is
        replaced: its channel is closed and what was staged for it freed.

        :raises WeightSyncStateError: a send is running, or the sender is closed.
        """
        self._check_membership("add_worker()")
        old = self.transports.get(worker_id)
        self.transports[worker_id] = transport
        self._acked.pop(worker_id, None)
        self._whole.discard(worker_id)
        if old is not None:
            await self._let_go(worker_id, old)

    async def remove_worker(self, worker_id: int) -> None:
        """Stop sending to worker ``worker_id``: close its channel (the worker
        hears a clean shutdown) and free what was staged for it. Sends to the
        others go on.

        :raises UnknownWorkerError: no such worker.
        :raises WeightSyncStateError: a send is running, or the sender is closed.
        """
        self._check_membership("remove_worker()")
        self._targets(worker_id)  # raises for an unknown id
        transport = self.transports.pop(worker_id)
        self._acked.pop(worker_id, None)
        self._whole.discard(worker_id)
        await self._let_go(worker_id, transport)

    async def _let_go(self, worker_id: int, transport: SenderTransport) -> None:
        with anyio.CancelScope(shield=True):
            if self.staging is not None:
                self.staging.released(worker_id, EVERY_VERSION, None)
            await transport.aclose()

    def _check_membership(self, what: str) -> None:
        self._check_open()
        if self._busy:
            raise WeightSyncStateError(
                f"{what} while a send of model {self.model_id!r} is running", model_id=self.model_id
            )

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
            for transport in self.transports.values():
                await transport.aclose()
            if self.staging is not None:
                await self.staging.aclose()
            if self._ready_watch is not None:
                self._ready_watch.close()
                self._ready_watch = None
