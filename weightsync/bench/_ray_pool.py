"""The Ray side of ``weightsync bench``: a pool of Ray actors that runs the
Ray cases (the ``ray`` scheme, the ``ray-put`` and ``torchrl-ray``
alternatives) as :class:`weightsync.bench._pools.WorkerPool` runs the others.

The pool is started once per run and reused by every Ray case; each case
still builds a fresh model on the actors and a fresh scheme. Ray is started
only when the run has a Ray case: if it is not initialised in this process,
a new local instance with every core (shut down at the end of the run), even
where another instance runs on the machine; otherwise the caller's, a
cluster included, used as it is and left running. Actors reserve no CPU, so
a run may have more of them than cores.

The actors are plain (neither async nor threaded) Ray actors, whose class
needs nothing of weightsync: the Ray scheme reaches them through Ray's
``__ray_call__``, so each update runs between two of their method calls.
After each send the trainer asks every actor for the version it applied and
its CRC32 per tensor, outside the timing, as a process worker reports them.

Memory: Ray's object store stays mapped in the trainer and in every actor
for the whole run, and a page of it counts in a process's RSS from the first
time the process touches it. A Ray case whose objects land on pages that an
earlier case touched shows less extra memory than the same case run first.

Importing this module never imports ray: it is imported inside the
functions that need it, and :class:`BenchActor` is made a Ray actor class
only when the pool starts. Actor processes unpickle the class by its module
and name, so they need weightsync importable, as the trainer does.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import weightsync as ws

from ._model import GeneratedMLP, corrupt_model, tensor_checksums
from ._pools import Pool
from ._types import MODEL_ID, BenchError, Case, WorkerStartup

__all__ = ["BenchActor", "MixinBenchActor", "RayActorPool", "actor_applier"]


def actor_applier(name: str, model: nn.Module) -> Callable[[Any], None]:
    """How a bench Ray actor applies one round of alternative ``name`` to
    ``model`` (see :class:`BenchActor`)."""
    if name == "ray-put":
        targets = [tensor for _, tensor in sorted(model.state_dict().items())]

        def copy_in(arrays: Sequence[Any]) -> None:
            with torch.no_grad(), warnings.catch_warnings():
                # The arrays are read-only views of Ray's object store; they
                # are only read from, which torch cannot know.
                warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
                for target, array in zip(targets, arrays, strict=True):
                    target.copy_(torch.from_numpy(array).view(target.dtype).view(target.shape))

        return copy_in
    raise ValueError(f"no actor side for alternative {name!r}")


class BenchActor:
    """A bench worker as a Ray actor (made remote by :class:`RayActorPool`):
    holds one case's model at a time, and the scheme or the alternative's
    apply function that updates it. ``threads`` is torch's thread count in
    the actor (None: torch's default), as for a worker process."""

    def __init__(self, threads: int | None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self._model: GeneratedMLP | None = None
        self._scheme: ws.WeightSyncScheme | None = None
        self._apply: Callable[[Any], None] | None = None
        self._applied: int | None = None  # the newest round of an alternative not yet reported
        self._corrupt = False
        # torchrl-ray: what torchrl's RayWeightSyncScheme reads from or calls
        # on a collector (torchrl/collectors/_base.py).
        self.worker_idx: int | None = None
        self.policy: GeneratedMLP | None = None
        self._receiver_schemes: dict[str, Any] = {}
        self._received = 0

    def whereabouts(self) -> tuple[int, str]:
        """This actor's process id and the id of its Ray node."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def start_case(
        self, scheme: ws.WeightSyncScheme, shapes: dict[str, tuple[int, ...]], dtype: str, corrupt: bool
    ) -> None:
        """Build a model of zeros and initialise ``scheme`` on it; the
        trainer's calls update it from then on. ``corrupt``: the testing
        hook (:func:`weightsync.bench._model.corrupt_model` before each report)."""
        self._model = GeneratedMLP(shapes, dtype=dtype)
        self._corrupt = corrupt
        self._scheme = scheme
        scheme.init_on_worker(MODEL_ID, model=self._model)

    def start_alternative(
        self,
        name: str,
        shapes: dict[str, tuple[int, ...]],
        dtype: str,
        corrupt: bool,
        worker_idx: int = 0,
        payload: Any = None,
    ) -> None:
        """Build a model of zeros for alternative ``name``, applied by
        :meth:`apply`; for ``torchrl-ray``, initialise ``payload``, torchrl's
        scheme, as a collector's receiver (worker ``worker_idx``), applied by
        the calls torchrl's sender makes."""
        self._model = GeneratedMLP(shapes, dtype=dtype)
        self._corrupt = corrupt
        if name == "torchrl-ray":
            # As a collector's register_scheme_receiver(synchronize_weights=False).
            self.worker_idx, self.policy, self._received = worker_idx, self._model, 0
            payload.init_on_receiver(model_id="policy", context=self, worker_idx=worker_idx)
            self._receiver_schemes = {"policy": payload}
        else:
            self._apply = actor_applier(name, self._model)

    def _connect_weights_scheme(self, model_version: int | None = None) -> None:
        """torchrl's: join the scheme's process group, receive the initial weights."""
        for scheme in self._receiver_schemes.values():
            if not scheme.synchronized_on_receiver:
                scheme.connect(worker_idx=self.worker_idx)

    def _receive_weights_scheme(self, model_version: int | None = None) -> None:
        """torchrl's: receive one update; the n-th is round n."""
        for scheme in self._receiver_schemes.values():
            scheme.receive()
        self._received += 1
        self._applied = self._received

    def apply(self, version: int, data: Any) -> int:
        """Apply round ``version`` of the alternative; returns ``version``, the ack."""
        assert self._apply is not None, "start_alternative() comes first"
        self._apply(data)
        self._applied = version
        return version

    def report(self) -> tuple[int | None, list[int]]:
        """The newest version applied since the previous report (or None),
        and the CRC32 of each tensor of the model."""
        assert self._model is not None, "a case was started"
        if self._scheme is not None:
            version = self._scheme.receive()
        else:
            version, self._applied = self._applied, None
        tensors = self._model.state_dict()
        if self._corrupt:
            corrupt_model(tensors)
        return version, tensor_checksums(tensors)

    def end_case(self) -> None:
        """Shut the case's scheme down and drop its model."""
        scheme = self._scheme
        self._model = self._scheme = self._apply = self._applied = self.policy = None
        receivers, self._receiver_schemes = self._receiver_schemes, {}
        if scheme is not None:
            scheme.shutdown()
        for receiver in receivers.values():
            receiver.shutdown()


class MixinBenchActor(ws.RayWeightSyncMixin, BenchActor):
    """A :class:`BenchActor` with weightsync's optional mixin: the Ray
    scheme's updates are calls of its own method instead of ``__ray_call__``
    (:attr:`weightsync.bench.BenchConfig.ray_mixin`)."""


class RayActorPool(Pool):
    """The bench's Ray actors, started once and reused by every case of
    ``cases`` that runs on Ray (:func:`weightsync.bench.pool_of`); if no
    case does, neither Ray nor any actor is started.

    Use as a context manager: leaving it kills every actor, also after an
    error or Ctrl-C, and shuts down Ray if the pool started it. ``mixin``:
    the actors are :class:`MixinBenchActor`.
    """

    kind = "ray"

    def __init__(
        self,
        cases: Sequence[Case],
        *,
        timeout: float,
        worker_threads: int | None = 1,
        corrupt_worker: int | None = None,
        mixin: bool = False,
    ) -> None:
        super().__init__(cases, timeout=timeout, worker_threads=worker_threads, corrupt_worker=corrupt_worker)
        self.mixin = mixin
        self._actors: list[Any] = []
        self._pids: list[int | None] = []
        self._in_case: list[Any] = []
        self._started_ray = False

    def start(self) -> None:
        """Start Ray if it is not initialised, start the actors and block
        until each is up. Does nothing if no case runs on Ray.

        :raises BenchError: Ray did not start, or an actor failed or did not
            start in time.
        """
        if self.size == 0:
            return
        import ray

        ray_init_s = None
        if not ray.is_initialized():
            # "local": without it ray.init joins the newest Ray instance of
            # this machine (RAY_ADDRESS, `ray start`, a test cluster), which
            # refuses num_cpus, and the bench would run on another's Ray.
            started = time.perf_counter()
            try:
                ray.init(
                    address="local",
                    num_cpus=os.cpu_count(),
                    include_dashboard=False,
                    log_to_driver=False,
                    # Ray's start-up notices would break into the bench's table.
                    logging_level=logging.ERROR,
                )
            except (RuntimeError, ValueError, OSError) as exc:
                raise BenchError(f"could not start Ray: {exc}") from exc
            ray_init_s = time.perf_counter() - started
            self._started_ray = True
        started = time.perf_counter()
        # No CPU reserved per actor: a case may have more actors than cores.
        actor_class = ray.remote(num_cpus=0)(MixinBenchActor if self.mixin else BenchActor)
        self._actors = [actor_class.remote(self.worker_threads) for _ in range(self.size)]
        # Each actor imports torch first: allow for a slow start, as for a process.
        places = self.get(
            [actor.whereabouts.remote() for actor in self._actors],
            "start",
            self.startup_timeout,
        )
        self.startup = WorkerStartup(self.kind, self.size, time.perf_counter() - started, ray_init_s)
        here = ray.get_runtime_context().get_node_id()
        # The memory probe reads /proc: a pid on another node is not this machine's.
        self._pids = [pid if node == here else None for pid, node in places]

    def get(self, refs: Sequence[Any], what: str, timeout: float | None = None) -> list[Any]:
        """Block for the results of the actor calls ``refs`` (one ``ray.get``),
        at most ``timeout`` seconds (None: the pool's).

        :raises BenchError: an actor failed or died, or a call did not return
            in time; ``what`` says what it was doing.
        """
        import ray
        import ray.exceptions

        limit = self.timeout if timeout is None else timeout
        try:
            return list(ray.get(list(refs), timeout=limit))
        except ray.exceptions.GetTimeoutError as exc:
            raise BenchError(f"a bench actor did not {what} within {limit:g} s") from exc
        except ray.exceptions.RayError as exc:
            raise BenchError(f"a bench actor failed to {what}:\n{exc}") from exc

    def actors(self, count: int) -> list[Any]:
        """Handles of the first ``count`` actors."""
        return self._actors[:count]

    def worker_pids(self, count: int) -> list[int | None]:
        """Process ids of the first ``count`` actors (None: on another node)."""
        return self._pids[:count]

    def sender_args(self, index: int) -> dict[str, Any]:
        """``remote_collectors=``: the handles of case ``index``'s actors."""
        return {"remote_collectors": self.actors(self.cases[index].workers)}

    def start_case(
        self,
        index: int,
        scheme: ws.WeightSyncScheme,
        shapes: dict[str, tuple[int, ...]],
        *,
        check_once: bool = False,
    ) -> None:
        """Have the case's actors build their models and initialise
        ``scheme`` (a copy of its configuration each); block until each is
        ready. An actor reports after every update: ``check_once`` is refused.

        :raises BenchError: an actor failed, died or did not get ready in
            time, or ``check_once`` was asked.
        """
        if check_once:
            raise BenchError("Ray actors report after every update: check_once is for worker processes")
        case = self.cases[index]
        self._start(
            index,
            lambda actor, slot: actor.start_case.remote(
                scheme, shapes, case.dtype, slot == self.corrupt_worker
            ),
            "initialise the scheme",
        )

    def start_alternative(
        self, index: int, name: str, shapes: dict[str, tuple[int, ...]], payload: Any = None
    ) -> None:
        """Like :meth:`start_case`, for alternative ``name`` to weightsync;
        ``payload`` goes to every actor, with its slot."""
        case = self.cases[index]
        self._start(
            index,
            lambda actor, slot: actor.start_alternative.remote(
                name, shapes, case.dtype, slot == self.corrupt_worker, slot, payload
            ),
            f"start {name}",
        )

    def _start(self, index: int, call: Callable[[Any, int], Any], what: str) -> None:
        self._in_case = self.actors(self.cases[index].workers)
        self.get([call(actor, slot) for slot, actor in enumerate(self._in_case)], what)

    def _reports(self) -> list[tuple[int, int | None, Sequence[int]]]:
        """Ask every actor of the case for the version it applied and its
        checksums; blocks until each answered.

        :raises BenchError: an actor failed, died or did not answer in time.
        """
        reports = self.get([actor.report.remote() for actor in self._in_case], "report its weights")
        return [(slot, got_version, got) for slot, (got_version, got) in enumerate(reports)]

    def end_case(self, index: int) -> list[list[float]]:
        """After the trainer's scheme is shut down: block until the case's
        actors shut theirs down. (An actor applies each update as its call
        arrives, on a thread of Ray's: no CPU per update is measured.)

        :raises BenchError: an actor failed, died or did not end in time.
        """
        actors, self._in_case = self._in_case, []
        self.get([actor.end_case.remote() for actor in actors], "end the case")
        return [[] for _ in actors]

    def close(self) -> None:
        """Kill every actor, and shut Ray down if this pool started it.
        Idempotent; does not wait for the actors to exit."""
        if not self._actors and not self._started_ray:
            return
        import ray

        actors, self._actors, self._in_case = self._actors, [], []
        try:
            for actor in actors:
                ray.kill(actor)
        finally:
            if self._started_ray:
                self._started_ray = False
                ray.shutdown()
