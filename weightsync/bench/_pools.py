"""The workers of ``weightsync bench``: the base class of its pools, and the
pool of worker processes.

A run starts one pool of worker processes (spawn, :class:`WorkerPool`) and
reuses it for every case that runs in processes: starting a process that
imports torch costs seconds on a small machine, more than most cases. Each
case still gets its own scheme, its own pipes and freshly built models, so
no weightsync state crosses cases. Ray cases run on a pool of Ray actors
instead (:class:`weightsync.bench._ray_pool.RayActorPool`), the other
subclass of :class:`Pool`.

A worker process serves one case at a time: the trainer sends it the
function that serves the case (:func:`_serve_case` for a weightsync scheme,
an alternative's own for ``--compare``) with its arguments, so the pool
needs to know nothing of the alternatives. Worker processes run torch
single-threaded by default (``worker_threads``): several workers share the
cores, and oversubscribed OpenMP threads measure the scheduler rather than
the transport.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Any, ClassVar, TypeVar

import torch

import weightsync as ws

from ._model import GeneratedMLP, change_model, check_applied, corrupt_model, tensor_checksums
from ._types import (
    MODEL_ID,
    RECEIVE_POLL,
    SCHEMES,
    STARTUP_TIMEOUT,
    BenchConfig,
    BenchError,
    Case,
    CaseResult,
    WorkerStartup,
    pool_of,
)

__all__ = ["AlternativeServer", "Pool", "WorkerPool", "timed_rounds"]

# A worker process's side of an alternative: called in the worker as
# ``serve(ctrl, pipe, name, shapes, dtype, device, payload, corrupt)``
# (``device``: where the worker builds its model); it reports over ``ctrl``
# as :func:`_serve_case` does. A module-level function: it is pickled to the
# worker by name.
AlternativeServer = Callable[
    [Connection, Connection, str, dict[str, tuple[int, ...]], str, str, Any, bool], None
]

_PoolT = TypeVar("_PoolT", bound="Pool")


# -- the base of the pools ------------------------------------------------------


class Pool(ABC):
    """What running a case needs of the workers, and what the pools share:
    :class:`WorkerPool` (processes joined by pipes) and
    :class:`weightsync.bench._ray_pool.RayActorPool` (Ray actors).

    ``cases`` is the whole run's, so a case's index is the same in every
    pool; a pool starts workers only for the cases it runs (those whose
    :func:`pool_of` is its ``kind``), as many as the largest of them needs
    (``size``). Entering a pool starts it (and closes what started if that
    fails), leaving closes it, also after an error or Ctrl-C.
    """

    kind: ClassVar[str]  # the pool_of() of the cases it runs: "processes" or "ray"

    def __init__(
        self,
        cases: Sequence[Case],
        *,
        timeout: float,
        worker_threads: int | None = 1,
        corrupt_worker: int | None = None,
    ) -> None:
        self.cases = list(cases)
        self.timeout = timeout
        self.worker_threads = worker_threads
        self.corrupt_worker = corrupt_worker
        self._mine = [i for i, case in enumerate(self.cases) if pool_of(case.scheme) == self.kind]
        self.size = max((self.cases[i].workers for i in self._mine), default=0)
        # Set by start(): how long the workers took to start (None: none started).
        self.startup: WorkerStartup | None = None

    @property
    def startup_timeout(self) -> float:
        """How long a worker may take to start: each imports torch first, so
        allow for a slow start on a loaded machine."""
        return max(self.timeout, STARTUP_TIMEOUT)

    @abstractmethod
    def start(self) -> None:
        """Start the workers; block until each is up."""

    @abstractmethod
    def close(self) -> None:
        """Stop every worker. Idempotent."""

    def __enter__(self: _PoolT) -> _PoolT:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @abstractmethod
    def worker_pids(self, count: int) -> Sequence[int | None]:
        """Process ids of the first ``count`` workers (None: not on this machine)."""

    @abstractmethod
    def sender_args(self, index: int) -> dict[str, Any]:
        """What ``init_on_sender`` needs, besides the model, to reach case ``index``'s workers."""

    @abstractmethod
    def start_case(
        self,
        index: int,
        scheme: ws.WeightSyncScheme,
        shapes: dict[str, tuple[int, ...]],
        *,
        check_once: bool = False,
    ) -> None:
        """Have the case's workers build their models and initialise
        ``scheme``. ``check_once``: each worker reports its checksums once,
        when the trainer's scheme is shut down, instead of after every
        update (:attr:`BenchConfig.check_once`)."""

    @abstractmethod
    def end_case(self, index: int) -> list[list[float]]:
        """After the trainer's scheme is shut down: end the workers' side of
        the case. Each worker's CPU seconds per update it took, in order,
        where it measures them (:func:`timed_worker_cpu`); else empty."""

    @abstractmethod
    def _reports(self) -> Iterable[tuple[int, int | None, Sequence[int]]]:
        """What each worker of the case reports after a send: its slot, the
        version it applied and its checksums."""

    def verify(self, version: int, names: Sequence[str], expected: Sequence[int]) -> None:
        """Block until every worker of the case reported the version it
        applied and its checksums after ``version``, and compare them with
        ``expected`` (the trainer's).

        :raises VerificationError: a worker holds other weights, or another version.
        :raises BenchError: a worker failed, died or did not report in time.
        """
        for slot, got_version, got in self._reports():
            check_applied(slot, version, got_version, got, names, expected)


def timed_rounds(
    pool: Pool,
    config: BenchConfig,
    named: dict[str, torch.Tensor],
    one_round: Callable[[int], None],
    result: CaseResult,
    before_verify: Callable[[int], None] | None = None,
) -> None:
    """The rounds of an alternative to weightsync on ``pool``: warm up, then
    time ``one_round(version)`` (which returns once every worker applied the
    version) for each version, changing the model before and verifying after
    each, outside the timing (after ``before_verify(version)``, if given)."""
    names = list(named)
    tensors = list(named.values())
    for step in config.rounds(result.send_s):
        change_model(tensors, step)
        version = step + 1
        start = time.perf_counter()
        one_round(version)
        elapsed = time.perf_counter() - start
        # The trainer's checksums first: a worker may share its tensors (torchrl-mp, torchrl-shared).
        expected = tensor_checksums(named)
        if before_verify is not None:
            before_verify(version)
        pool.verify(version, names, expected)
        if step >= config.warmup:
            result.send_s.append(elapsed)


def timed_worker_cpu(per_worker: Sequence[Sequence[float]], repeats: int) -> list[float]:
    """The CPU seconds of the timed sends' updates, every worker's together:
    each worker's last ``repeats`` (one update per send: the ones before are
    the warm-up's and the first weights')."""
    return [cpu for cpus in per_worker for cpu in cpus[max(len(cpus) - repeats, 0) :]] if repeats > 0 else []


# -- worker processes -----------------------------------------------------------


# This worker process's slot (set by _worker_main): worker ``slot`` of a case
# reached by rank is rank ``slot + 1``.
_SLOT = 0


def _worker_main(slot: int, ctrl: Connection, pipes: dict[int, Connection], threads: int | None) -> None:
    """A bench worker: serves the cases the trainer starts over ``ctrl``.

    Commands from the trainer: ("serve", index, serve, *args), which calls
    ``serve(ctrl, pipe, *args)`` with case ``index``'s pipe, and ("stop",).
    Messages to the trainer: ("up", pid), ("ready",), ("applied", version,
    checksums), ("ended", [CPU seconds of each update taken]) (or ("ended",)
    where the case does not measure them), ("failed", traceback).
    """
    # Ctrl-C reaches the whole process group; the trainer decides when the
    # workers stop, so they finish cleanly instead of dying mid-case.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _SLOT
    _SLOT = slot
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        ctrl.send(("up", os.getpid()))
        while True:
            try:
                command = ctrl.recv()
            except EOFError:
                return  # the trainer is gone
            if command[0] == "stop":
                return
            _, index, serve, *args = command
            pipe = pipes.pop(index)
            try:
                serve(ctrl, pipe, *args)
            finally:
                pipe.close()
                # What the case shared (a CUDA tensor by IPC, a mapping) is let go now.
                del command, args
    except BaseException:
        with suppress(OSError):
            ctrl.send(("failed", traceback.format_exc()))
        raise
    finally:
        for pipe in pipes.values():
            pipe.close()


def _serve_case(
    ctrl: Connection,
    pipe: Connection,
    scheme: ws.WeightSyncScheme,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    device: str,
    reach: str,
    check_once: bool,
    corrupt: bool,
) -> None:
    """A worker's side of a weightsync scheme: build a model of zeros on
    ``device``, initialise ``scheme`` on it with ``pipe`` (or, ``reach="rank"``, as rank
    slot + 1), then report the version and checksums after each update it
    applies, until the trainer's sender is gone (``check_once``: only
    once, for the last update, when the sender is gone)."""
    model = GeneratedMLP(shapes, dtype=dtype, device=device)

    def report(version: int | None) -> None:
        # Looked up after every update: a zero-copy scheme re-points the
        # model's tensors, so views taken before would show old memory.
        tensors = model.state_dict()
        if corrupt:
            corrupt_model(tensors)
        ctrl.send(("applied", version, tensor_checksums(tensors)))

    cpus: list[float] = []  # (the CPU time of each receive() that applied an update)
    try:
        if reach == "rank":
            scheme.init_on_worker(MODEL_ID, model=model, worker_idx=_SLOT + 1)
        else:
            scheme.init_on_worker(MODEL_ID, pipe=pipe, model=model)
        ctrl.send(("ready",))
        last = None
        while True:
            cpu = time.thread_time()
            try:
                version = scheme.receive(timeout=RECEIVE_POLL)
            except ws.SenderLostError:
                break  # the trainer shut its sender down: the case is over
            if version is None:
                continue
            cpus.append(time.thread_time() - cpu)
            last = version
            if not check_once:
                report(version)
        if check_once:
            report(last)
    finally:
        scheme.shutdown()
        ctrl.send(("ended", cpus))


class WorkerPool(Pool):
    """The bench's worker processes, started once and reused by every case
    of ``cases`` that runs in processes (:func:`pool_of`); none are started
    if no case does.

    Each case gets its own pipes, created with the pool (a spawned process
    receives pipes only at start). Use as a context manager: leaving it stops
    and joins every worker, also after an error or Ctrl-C, killing any that
    does not exit in time.
    """

    kind = "processes"

    def __init__(
        self,
        cases: Sequence[Case],
        *,
        timeout: float,
        worker_threads: int | None = 1,
        corrupt_worker: int | None = None,
    ) -> None:
        super().__init__(cases, timeout=timeout, worker_threads=worker_threads, corrupt_worker=corrupt_worker)
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._ctrls: list[Connection] = []
        self._case_pipes: dict[int, list[Connection]] = {}
        self._in_case: list[int] = []
        self._broken = False

    def start(self) -> None:
        """Spawn the workers and block until each is up.

        :raises BenchError: a worker died or did not start in time.
        """
        if self.size == 0:
            return
        started = time.perf_counter()
        theirs: list[dict[int, Connection]] = [{} for _ in range(self.size)]
        for index in self._mine:
            ours = []
            for slot in range(self.cases[index].workers):
                mine, other = self._ctx.Pipe()
                ours.append(mine)
                theirs[slot][index] = other
            self._case_pipes[index] = ours
        try:
            for slot in range(self.size):
                ctrl, child_ctrl = self._ctx.Pipe()
                self._ctrls.append(ctrl)
                proc = self._ctx.Process(
                    target=_worker_main,
                    args=(slot, child_ctrl, theirs[slot], self.worker_threads),
                    name=f"weightsync-bench-worker-{slot}",
                    daemon=True,  # a safety net: never outlive the trainer
                )
                try:
                    proc.start()
                finally:
                    child_ctrl.close()
                self._procs.append(proc)
        finally:
            # The workers hold their own ends now (or never will).
            for pipes in theirs:
                for conn in pipes.values():
                    conn.close()
        deadline = time.monotonic() + self.startup_timeout
        for slot in range(self.size):
            self._expect(slot, "up", deadline)
        self.startup = WorkerStartup(self.kind, self.size, time.perf_counter() - started)

    def pipes(self, index: int) -> list[Connection]:
        """The trainer's ends of case ``index``'s pipes, one per worker."""
        return self._case_pipes[index]

    def sender_args(self, index: int) -> dict[str, Any]:
        """``pipes=``: the trainer's ends of case ``index``'s pipes; for a
        scheme that reaches its workers by rank, their number and the
        address of the store (this host's loopback)."""
        case = self.cases[index]
        if case.scheme in SCHEMES and SCHEMES[case.scheme].reach == "rank":
            return {"num_workers": case.workers, "host": "127.0.0.1"}
        return {"pipes": self.pipes(index)}

    def _expect(self, slot: int, kind: str, deadline: float) -> tuple[Any, ...]:
        """The next message of ``kind`` from worker ``slot``, skipping older ones.

        :raises BenchError: the worker failed, died or was silent until the deadline.
        """
        ctrl, proc = self._ctrls[slot], self._procs[slot]
        while True:
            ready = mp.connection.wait([ctrl, proc.sentinel], timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                self._broken = True
                raise BenchError(f"bench worker {slot} (pid {proc.pid}) sent no {kind!r} before the deadline")
            # A worker's last words arrive with its exit: read the pipe first.
            if ctrl in ready:
                try:
                    message = ctrl.recv()
                except (EOFError, OSError):
                    pass  # it exited; its exit code says more
                else:
                    if message[0] == "failed":
                        self._broken = True
                        raise BenchError(f"bench worker {slot} failed:\n{message[1]}")
                    if message[0] == kind:
                        return tuple(message)
                    continue
            self._broken = True
            proc.join(5)
            raise BenchError(f"bench worker {slot} (pid {proc.pid}) exited with code {proc.exitcode}")

    def start_case(
        self,
        index: int,
        scheme: ws.WeightSyncScheme,
        shapes: dict[str, tuple[int, ...]],
        *,
        check_once: bool = False,
    ) -> None:
        """Have the case's workers build their models and initialise ``scheme``;
        block until each is ready.

        :raises BenchError: a worker failed, died or did not get ready in time.
        """
        case = self.cases[index]
        reach = SCHEMES[case.scheme].reach
        self._start(index, _serve_case, scheme, shapes, case.dtype, case.worker_device, reach, check_once)

    def start_alternative(
        self,
        index: int,
        name: str,
        shapes: dict[str, tuple[int, ...]],
        payload: Any,
        serve: AlternativeServer,
    ) -> None:
        """Like :meth:`start_case`, for alternative ``name`` to weightsync:
        each worker runs ``serve``, the alternative's side of a worker, with
        its model on the case's worker device; ``payload`` (pickled with
        torch's reductions: a CUDA tensor goes by CUDA IPC) goes to every
        worker."""
        case = self.cases[index]
        self._start(index, serve, name, shapes, case.dtype, case.worker_device, payload)

    def worker_pids(self, count: int) -> list[int]:
        """Process ids of the first ``count`` workers."""
        return [proc.pid for proc in self._procs[:count]]

    def _start(self, index: int, serve: Callable[..., None], *args: Any) -> None:
        """Have the case's workers run ``serve(ctrl, pipe, *args, corrupt)``;
        block until each is ready."""
        workers = self.cases[index].workers
        for slot in range(workers):
            self._ctrls[slot].send(("serve", index, serve, *args, slot == self.corrupt_worker))
            self._in_case.append(slot)
        deadline = time.monotonic() + self.timeout
        for slot in range(workers):
            self._expect(slot, "ready", deadline)

    def _reports(self) -> Iterator[tuple[int, int | None, Sequence[int]]]:
        """Each worker's report after a send, as it arrives (the first waited
        for first, so a wrong one fails before the next is read).

        :raises BenchError: a worker failed, died or did not report in time.
        """
        deadline = time.monotonic() + self.timeout
        for slot in self._in_case:
            _, got_version, got = self._expect(slot, "applied", deadline)
            yield slot, got_version, got

    def end_case(self, index: int) -> list[list[float]]:
        """After the trainer's scheme is shut down: block until the case's
        workers closed their side, then close the case's pipes (also when
        that fails). Each worker's CPU seconds per update, where it
        measured them (empty where it did not).

        :raises BenchError: a worker failed, died or did not end in time.
        """
        slots, self._in_case = self._in_case, []
        deadline = time.monotonic() + self.timeout
        try:
            ended = [self._expect(slot, "ended", deadline) for slot in slots]
        finally:
            self.close_pipes(index)
        return [list(message[1]) if len(message) > 1 else [] for message in ended]

    def close_pipes(self, index: int) -> None:
        """Close the trainer's ends of case ``index``'s pipes, if still open."""
        for conn in self._case_pipes.pop(index, []):
            conn.close()

    def close(self) -> None:
        """Stop and join every worker, killing those that do not exit in
        time; close every pipe. Idempotent; blocks at most a few seconds
        per worker."""
        for ctrl, proc in zip(self._ctrls, self._procs, strict=False):
            if proc.is_alive():
                with suppress(OSError):
                    ctrl.send(("stop",))
        grace = 1.0 if self._broken else 10.0
        for proc in self._procs:
            proc.join(grace)
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
            if proc.exitcode is not None:
                proc.close()
        self._procs = []
        for ctrl in self._ctrls:
            ctrl.close()
        self._ctrls = []
        for index in list(self._case_pipes):
            self.close_pipes(index)
