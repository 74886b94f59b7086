"""Schemes: the configuration of how ONE model is synchronised, and the
entry point that builds each side.

A scheme is created on the trainer, can be pickled (configuration only) and
handed to spawned workers, and is initialised once per process:
``init_on_sender`` on the trainer, ``init_on_receiver`` (alias
``init_on_worker``) on each worker.
"""

from __future__ import annotations

import multiprocessing
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from typing import Any, ClassVar, Literal

import torch

from ._exceptions import WeightSyncStateError
from ._facade import WeightReceiver, WeightSender
from ._receiver import AsyncWeightReceiver
from ._sender import DEFAULT_TIMEOUT, AsyncWeightSender, Keys, SendReport
from ._strategy import WeightStrategy, model_of, model_tensors
from ._torchrl import register_with_torchrl as _register
from ._transports._base import Applier, SenderTransport, Staging, WorkerEndpoint
from ._transports._copy_staging import CopyReader, SegmentStaging
from ._transports._none import NoEndpoint, NoTransport
from ._transports._pipe import PipeEndpoint, PipeSenderTransport
from ._transports._slot_staging import SlotReader, SlotStaging

__all__ = [
    "InProcessWeightSyncScheme",
    "register_with_torchrl",
    "MultiProcessWeightSyncScheme",
    "NoWeightSyncScheme",
    "RayWeightSyncMixin",
    "RayWeightSyncScheme",
    "SharedMemWeightSyncScheme",
    "WeightSyncScheme",
]


def _from(context: Any, kwargs: dict[str, Any], name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return getattr(context, name, default) if context is not None else default


def _num_workers(context: Any, kwargs: dict[str, Any]) -> Any:
    """``num_workers``, else one worker per entry of ``devices`` (as
    torchrl's schemes take it: the device of each worker's policy)."""
    num_workers = _from(context, kwargs, "num_workers")
    if num_workers is None:
        devices = kwargs.get("devices")
        if devices is not None and not isinstance(devices, str | torch.device):
            num_workers = len(devices)
    return num_workers


def _model_of(model_id: str | None, context: Any, kwargs: dict[str, Any]) -> Any:
    model = kwargs.get("model")
    if model is not None:
        return model
    try:
        return model_of(context, model_id)
    except (LookupError, ValueError, AttributeError):
        # A context that holds no such model (yet): e.g. a torchrl collector
        # whose workers build their policy from a factory.
        return None


StrategyName = Literal["state_dict", "tensordict"]
EndpointFactory = Callable[[Applier], WorkerEndpoint]


class WeightSyncScheme:
    """Base class of every scheme: the whole public surface, transport-agnostic.

    Subclasses provide the transports (``_sender_side`` / ``_receiver_side``).
    ``strategy`` is the form weights are handed back in (default: the
    class's ``default_strategy``); ``timeout`` is the default deadline of a
    send, in seconds; ``verify`` the default of ``send(verify=...)``: an
    end-to-end check of every tensor (the ``verify`` extra).

    ``per_worker_weights=True``: each worker keeps weights of its own (a
    policy built by a factory per worker, possibly of another layout), and
    ``send({worker_id: weights, ...})`` gives each its own, one send per
    worker, each with its own version (``send(weights, worker_ids=i)``
    updates worker ``i`` alone, under any scheme). Without it, weights keyed
    by worker id are refused (``ValueError``), before anything moves.
    """

    default_strategy: ClassVar[StrategyName] = "tensordict"
    _needs_model = True

    def __init__(
        self,
        strategy: StrategyName | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = False,
        per_worker_weights: bool = False,
    ) -> None:
        self.strategy = WeightStrategy(strategy or self.default_strategy)
        self.timeout = timeout
        self.verify = verify
        self.per_worker_weights = per_worker_weights
        self._reset()

    def _reset(self) -> None:
        self._model_id: str | None = None
        self._context: Any = None
        self._model: Any = None
        self._worker_idx: int | None = None
        self._async_sender: AsyncWeightSender | None = None
        self._async_receiver: AsyncWeightReceiver | None = None
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self._on_update: Callable[[int], Any] | None = None
        self._synchronized_on_sender = False
        self._synchronized_on_receiver = False
        _register(WeightSyncScheme)

    # A scheme crosses process boundaries as configuration only: pipes,
    # models and event loops belong to the process that created them.
    def __getstate__(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy.extract_as,
            "timeout": self.timeout,
            "verify": self.verify,
            "per_worker_weights": self.per_worker_weights,
            "model_id": self._model_id,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.strategy = WeightStrategy(state["strategy"])
        self.timeout = state["timeout"]
        self.verify = state.get("verify", False)
        self.per_worker_weights = state.get("per_worker_weights", False)
        self._reset()
        self._model_id = state["model_id"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy.extract_as!r}, model_id={self._model_id!r})"

    # -- properties -----------------------------------------------------
    @property
    def context(self) -> Any | None:
        """The context object (e.g. a collector) given at init, if any.

        Settable (torchrl's collectors set it on a worker once its inner
        collector exists): a context with ``increment_version()`` has it
        called after each update that follows ``connect()``."""
        return self._context

    @context.setter
    def context(self, context: Any) -> None:
        self._context = context
        if self._async_sender is not None and self._model is None:
            self._async_sender.context = self._source()

    @property
    def model(self) -> Any | None:
        """The model this process synchronises (the worker's model, or the
        sender's source model), if known.

        Settable: on a worker, the next updates go to the new model (same
        layout), whose forward calls become the steps the background applier
        waits for; on the sender, ``send(None)`` reads it."""
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        self._model = model
        if self._async_receiver is not None and model is not None:
            self.get_receiver().set_model(model)
        elif self._async_sender is not None:
            self._async_sender.context = self._source()

    @property
    def model_id(self) -> str | None:
        return self._model_id

    @property
    def worker_idx(self) -> int | None:
        """This worker's index (worker side), if set."""
        return self._worker_idx

    @worker_idx.setter
    def worker_idx(self, worker_idx: int | None) -> None:
        if self._async_sender is not None and worker_idx is not None:
            raise WeightSyncStateError(f"{self!r}: a sender has no worker index", model_id=self._model_id)
        self._worker_idx = worker_idx

    # torchrl's collectors read these four (and set the last two).
    @property
    def initialized_on_sender(self) -> bool:
        """Whether ``init_on_sender`` ran in this process."""
        return self._async_sender is not None

    @property
    def initialized_on_receiver(self) -> bool:
        """Whether ``init_on_receiver`` ran in this process."""
        return self._async_receiver is not None

    @property
    def synchronized_on_sender(self) -> bool:
        """Whether the sender's ``connect()`` finished."""
        return self._synchronized_on_sender

    @synchronized_on_sender.setter
    def synchronized_on_sender(self, value: bool) -> None:
        self._synchronized_on_sender = bool(value)

    @property
    def synchronized_on_receiver(self) -> bool:
        """Whether this worker's ``connect()`` finished."""
        return self._synchronized_on_receiver

    @synchronized_on_receiver.setter
    def synchronized_on_receiver(self, value: bool) -> None:
        self._synchronized_on_receiver = bool(value)

    @property
    def weights(self) -> Any | None:
        """The current weights of :attr:`model` in the strategy's form, or None."""
        if self._model is None:
            return None
        return self.strategy.extract_weights(self._model, model_id=self._model_id)

    @property
    def sender_transports(self) -> dict[int, SenderTransport]:
        """The sender's channel to each worker, by worker id."""
        return {} if self._async_sender is None else dict(self._async_sender.transports)

    @property
    def receiver_transport(self) -> WorkerEndpoint | None:
        """This worker's endpoint (worker side), once initialised."""
        return None if self._async_receiver is None else self._async_receiver.endpoint

    @property
    def staging(self) -> Staging | None:
        """Where each send's bytes wait for the workers (sender side), if the
        scheme stages them."""
        return None if self._async_sender is None else self._async_sender.staging

    # -- transports, per scheme ------------------------------------------
    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], Staging | None]:
        raise NotImplementedError

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> EndpointFactory:
        """How to build this worker's endpoint, given its receiver."""
        raise NotImplementedError

    def _initialised(self) -> bool:
        return self._async_sender is not None or self._async_receiver is not None

    def create_transport(self, *args: Any, **kwargs: Any) -> Any:
        """Build one transport (legacy); see each scheme."""
        raise NotImplementedError

    # -- lifecycle --------------------------------------------------------
    def init_on_sender(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Initialise the sender side (the trainer). Does not block.

        ``context`` (e.g. a collector) or ``kwargs`` give what the scheme
        needs (see each scheme); ``kwargs`` win. A ``model`` (kwarg) or the
        context's ``get_model(model_id)`` is what ``send(None)`` reads.

        :raises RuntimeError: this scheme is already initialised here.
        """
        if self._initialised():
            raise WeightSyncStateError(f"{self!r} is already initialised in this process")
        _register(WeightSyncScheme)
        self._model_id = model_id if model_id is not None else kwargs.get("model_id", self._model_id)
        self._context = context
        self._model = _model_of(self._model_id, context, kwargs)
        transports, staging = self._sender_side(context, kwargs)
        self._async_sender = AsyncWeightSender(
            model_id=self._model_id,
            strategy=self.strategy,
            transports=transports,
            staging=staging,
            context=self._source(),
            timeout=self.timeout,
            verify=self.verify,
            per_worker_weights=self.per_worker_weights,
        )

    def _source(self) -> Any:
        """Where ``send(None)`` reads the weights: the context, or the model."""
        if self._context is not None:
            return self._context
        return types.SimpleNamespace(model=self._model) if self._model is not None else None

    def init_on_receiver(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Initialise a worker (receiver side) and announce it to the sender.

        ``kwargs`` (or the context) give the ``model`` to update in place,
        and what the transport needs (see each scheme). Also:

        - ``on_update(version)``: called after each update is applied,
          before the ack (an exception in it is reported to the sender);
        - ``device``: where tensors of a model built on the meta device get
          their storage at the first update (default: the context's
          ``policy_device``, else the CPU). Such a model is acked only once
          it holds the weights.

        :raises RuntimeError: this scheme is already initialised here.
        :raises ValueError: no model was given.
        """
        if self._initialised():
            raise WeightSyncStateError(f"{self!r} is already initialised in this process")
        _register(WeightSyncScheme)
        self._model_id = model_id if model_id is not None else kwargs.get("model_id", self._model_id)
        self._context = context
        self._model = _model_of(self._model_id, context, kwargs)
        self._worker_idx = _from(context, kwargs, "worker_idx")
        self._on_update = _from(context, kwargs, "on_update")
        if self._model is None and self._needs_model:
            raise ValueError(
                f"init_on_receiver needs the model to update: pass model=... or a context with get_model() "
                f"(model {self._model_id!r})"
            )
        endpoint = self._receiver_side(context, kwargs)
        device = kwargs.get("device", getattr(context, "policy_device", None))
        self._async_receiver = AsyncWeightReceiver(
            model_id=self._model_id,
            model=self._model,
            endpoint=endpoint,
            device=device if isinstance(device, str | torch.device) else None,
            on_update=self._updated if self._announces else None,
        )
        if self._announces:
            self.get_receiver().announce()

    def _updated(self, version: int) -> None:
        """After each update on a worker: the user's ``on_update``, then the
        context's version (torchrl's collectors count policy versions)."""
        if self._on_update is not None:
            self._on_update(version)
        if self._synchronized_on_receiver:
            bump = getattr(self._context, "increment_version", None)
            if callable(bump):
                bump()

    #: Whether a new worker announces itself over its channel (a push
    #: endpoint is found by the sender instead).
    _announces = True

    def init_on_worker(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Alias of :meth:`init_on_receiver`."""
        self.init_on_receiver(model_id, context, **kwargs)

    def connect(
        self,
        *,
        worker_idx: int | None = None,
        weights: Any = None,
        timeout: float | None = None,
        background: bool = True,
    ) -> SendReport | None:
        """The rendezvous of the two sides, once the workers are started.

        Sender: block until every worker (or ``worker_idx``) announced itself,
        then send it the initial weights (``weights``, else the model or
        context given at init) and wait for its ack. Returns that send's
        report (None when there was nothing to send: the workers then wait
        for the first ``send()``).

        Worker: block until the initial weights are applied (a model built on
        the meta device gets its storage then). Then, with ``background=True``
        (torchrl's collectors never call ``receive()``), every later update
        is applied as it arrives, between two forward calls of the model
        (see :meth:`WeightReceiver.start_applier`); with ``background=False``
        the worker goes on calling ``receive()``.

        ``timeout``: per phase, default the scheme's ``timeout``. Either side:
        no-op before init.

        :raises WorkerError: (sender) naming every worker that died, did not
            show up, or did not apply the initial weights in time.
        :raises WaitTimeoutError: (worker) no initial weights in time.
        :raises SenderLostError: (worker) the sender died or shut down first.
        """
        wait = self.timeout if timeout is None else timeout
        if self._async_sender is not None:
            sender = self.get_sender()
            sender.connect(worker_idx, timeout=wait)
            self._connected()
            report = None
            # Under per_worker_weights each worker starts from weights of its
            # own (its factory's policy) unless some are given here.
            initial = self._source() is not None and not self.per_worker_weights
            if weights is not None or initial:
                report = sender.send(weights, worker_idx, timeout=wait)
            self._synchronized_on_sender = True
            return report
        if self._async_receiver is not None:
            if worker_idx is not None:
                self._worker_idx = worker_idx
            receiver = self.get_receiver()
            if not receiver.applying_in_background and self._waits_for_initial_weights():
                receiver.wait_for_version(1, wait)  # any version: the initial weights
            self._synchronized_on_receiver = True
            if background:
                receiver.start_applier()
        return None

    def _waits_for_initial_weights(self) -> bool:
        """Whether a worker's ``connect()`` waits for the sender's initial
        weights: always, but under ``per_worker_weights`` for a model that
        holds weights of its own already (none of its tensors on the meta
        device)."""
        if not self.per_worker_weights or self._model is None:
            return True
        try:
            tensors = model_tensors(self._model, model_id=self._model_id)
        except Exception:
            return True
        return any(t.is_meta for t in tensors.values())

    def _connected(self) -> None:
        """Called on the sender once its workers announced themselves."""

    # -- membership -----------------------------------------------------------
    def add_worker(
        self,
        channel: Any = None,
        *,
        worker_id: int | None = None,
        weights: Any = None,
        timeout: float | None = None,
    ) -> int:
        """Sender: add a worker while the trainer runs, and return its id.

        ``channel`` is what the scheme reaches it by (see each scheme: the
        trainer's end of a new pipe, a Ray actor handle). ``worker_id``: the
        id of a worker that died and was restarted, to bring it back under
        its old id (the old channel is closed); default, a new id. If the
        sender has sent before (or ``weights`` are given), the new worker
        gets the latest weights (``weights``, else the model), alone, and
        this blocks until it applied them (its first ``receive()`` or its
        ``connect()``), up to ``timeout``; the others get nothing.

        :raises ValueError: a bad ``worker_id`` or channel.
        :raises WorkerError: the new worker did not apply the weights (it
            stays a worker: later sends go to it).
        :raises RuntimeError: before ``init_on_sender``, or during a send.
        """
        sender = self.get_sender()
        if worker_id is not None and (not isinstance(worker_id, int) or worker_id < 0):
            raise ValueError(f"worker_id must be an int >= 0, not {worker_id!r}")
        known = self.sender_transports
        wid = worker_id if worker_id is not None else max(known, default=-1) + 1
        sender.add_worker(wid, self._new_transport(wid, channel, replaces=wid in known))
        if weights is not None or (sender.async_sender.version > 0 and self._source() is not None):
            sender.send(weights, [wid], timeout=timeout)
        return wid

    def remove_worker(self, worker_id: int) -> None:
        """Sender: stop sending to ``worker_id`` and free what was held for
        it; its channel is closed (the worker hears a clean shutdown). Sends
        to the others go on.

        :raises UnknownWorkerError: no such worker.
        :raises RuntimeError: before ``init_on_sender``, or during a send.
        """
        self.get_sender().remove_worker(worker_id)

    def _new_transport(self, worker_id: int, channel: Any, *, replaces: bool) -> SenderTransport:
        raise NotImplementedError(f"{type(self).__name__} has no workers to add")

    def get_sender(self) -> WeightSender:
        """The blocking sender. :raises RuntimeError: before ``init_on_sender``."""
        if self._sender is None:
            self._sender = WeightSender(self.get_async_sender())
        return self._sender

    def get_receiver(self) -> WeightReceiver:
        """The blocking receiver. :raises RuntimeError: before ``init_on_receiver``."""
        if self._receiver is None:
            self._receiver = WeightReceiver(self.get_async_receiver())
        return self._receiver

    def get_async_sender(self) -> AsyncWeightSender:
        """The coroutine sender, for async trainers (no blocking facade, no
        loop thread involved). :raises RuntimeError: before ``init_on_sender``."""
        if self._async_sender is None:
            raise WeightSyncStateError(
                f"{self!r}: get_sender() before init_on_sender()", model_id=self._model_id
            )
        return self._async_sender

    def get_async_receiver(self) -> AsyncWeightReceiver:
        """The coroutine receiver. :raises RuntimeError: before ``init_on_receiver``."""
        if self._async_receiver is None:
            raise WeightSyncStateError(
                f"{self!r}: get_receiver() before init_on_receiver()", model_id=self._model_id
            )
        return self._async_receiver

    def create_sender(self) -> WeightSender:
        """Legacy: the sender of this scheme (same as :meth:`get_sender`)."""
        return self.get_sender()

    def create_receiver(self) -> WeightReceiver:
        """Legacy: the receiver of this scheme (same as :meth:`get_receiver`)."""
        return self.get_receiver()

    # -- operations ---------------------------------------------------------
    def prepare_weights(
        self, weights: Any, model_id: str | None, strategy: WeightStrategy, context: Any = None
    ) -> Any:
        """Extract ``weights`` (None: the context's model) in ``strategy``'s form."""
        if weights is None and context is None:
            context = self._source()
        return strategy.extract_weights(weights, context=context, model_id=model_id)

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Apply ``weights`` to this process's model directly (no transport).

        :raises WeightMismatchError: names, shapes or dtypes differ (nothing written).
        """
        if self._model is None:
            raise WeightSyncStateError(f"{self!r} has no model to apply weights to")
        self.strategy.apply_weights(self._model, weights, inplace=inplace, model_id=self._model_id)

    def send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
        keys: Keys | None = None,
        partial: bool = False,
        verify: bool | None = None,
    ) -> SendReport | None:
        """Blocking send to ``worker_ids`` (default all), whole or partial
        (``keys=``, ``partial=True``), checked end to end with ``verify``;
        see :meth:`WeightSender.send`."""
        return self.get_sender().send(
            weights, worker_ids, timeout=timeout, keys=keys, partial=partial, verify=verify
        )

    def receive(self, timeout: float | None = None) -> int | None:
        """Apply the newest pending update; see :meth:`WeightReceiver.receive`."""
        return self.get_receiver().receive(timeout)

    def shutdown(self) -> None:
        """Close this side's channels and release shared memory and the loop
        thread. Idempotent; safe on a scheme never initialised.

        An async trainer may ``await get_async_sender().aclose()`` instead."""
        try:
            if self._async_sender is not None:
                self.get_sender().shutdown()
        finally:
            if self._async_receiver is not None:
                self.get_receiver().shutdown()


def register_with_torchrl() -> None:
    """Make weightsync's schemes pass torchrl's ``isinstance(scheme,
    torchrl.weight_update.WeightSyncScheme)`` check, importing torchrl.

    Not needed where torchrl is imported before a scheme is initialised (the
    scheme registers itself then); weightsync never imports torchrl unasked.

    :raises ImportError: torchrl is not installed.
    """
    _register(WeightSyncScheme, load=True)


class _PipeScheme(WeightSyncScheme):
    """Control over one duplex pipe per worker; bytes through a staging
    (``_staging_class`` on the sender, ``_reader_class`` on each worker).

    The pipes are the user's (``pipes=`` on the sender, ``pipe=`` on each
    worker), or the scheme's own: given a multiprocessing context (``ctx=``,
    as torchrl's collectors pass it) or no pipes at all, ``init_on_sender``
    makes one pipe per worker (``num_workers``), and the worker ends travel
    inside the pickled scheme to the workers, where ``worker_idx`` picks
    each one's end.
    """

    _staging_class: ClassVar[type[SegmentStaging] | type[SlotStaging]]
    _reader_class: ClassVar[type[CopyReader] | type[SlotReader]]
    #: Added to the error of a worker killed by SIGSEGV.
    _fault_hint: ClassVar[str | None] = None

    def _reset(self) -> None:
        super()._reset()
        # The ends of the pipes this scheme made: the sender's, and the
        # workers' (held here until every worker has its own copy).
        self._own_pipes: list[Connection] = []
        self._worker_ends: dict[int, Connection] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._worker_ends:
            state["worker_ends"] = dict(self._worker_ends)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._worker_ends = dict(state.get("worker_ends", {}))

    def _sender_pipes(self, context: Any, kwargs: dict[str, Any]) -> list[Connection]:
        ctx = kwargs.get("ctx")
        pipes: Sequence[Any] | None = None if ctx is not None else _from(context, kwargs, "pipes")
        if pipes is None:
            return self._make_pipes(ctx, _num_workers(context, kwargs))
        pipes = list(pipes)
        num_workers = _from(context, kwargs, "num_workers") or len(pipes)
        if num_workers != len(pipes):
            raise ValueError(f"num_workers={num_workers} but {len(pipes)} pipes were given")
        return pipes

    def _make_pipes(self, ctx: Any, num_workers: Any) -> list[Connection]:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(
                f"{type(self).__name__}.init_on_sender needs pipes=[...], or num_workers=N (N >= 1) "
                "for the scheme to make its own"
            )
        ctx = ctx if ctx is not None else multiprocessing.get_context()
        pairs = [ctx.Pipe(duplex=True) for _ in range(num_workers)]
        self._own_pipes = [ours for ours, _ in pairs]
        self._worker_ends = {i: theirs for i, (_, theirs) in enumerate(pairs)}
        return list(self._own_pipes)

    def _worker_pipe(self, context: Any, kwargs: dict[str, Any]) -> Connection:
        pipe = _from(context, kwargs, "pipe")
        if pipe is not None:
            return pipe
        index = self._worker_idx
        if not self._worker_ends:
            raise ValueError(
                f"{type(self).__name__}.init_on_worker needs pipe=..., or a scheme whose "
                "init_on_sender made the pipes (and worker_idx=i)"
            )
        if not isinstance(index, int) or index not in self._worker_ends:
            raise ValueError(
                f"{type(self).__name__}.init_on_worker needs worker_idx=i, one of "
                f"{sorted(self._worker_ends)} (got {index!r})"
            )
        # Keep this worker's end; close the others' (a worker holding another
        # one's end open would hide that one's death from the sender).
        ends, self._worker_ends = self._worker_ends, {}
        for i, end in ends.items():
            if i != index:
                end.close()
        self._own_pipes = [ends[index]]
        return ends[index]

    def _new_transport(self, worker_id: int, channel: Any, *, replaces: bool) -> SenderTransport:
        """``channel``: the trainer's end of a new duplex pipe to the worker."""
        if channel is None:
            raise ValueError(f"{type(self).__name__}.add_worker needs the trainer's end of a new pipe")
        return self._pipe_transport(channel, worker_id)

    def _pipe_transport(
        self, pipe: Connection, worker_id: int, staging: Staging | None = None
    ) -> PipeSenderTransport:
        """The sender's channel to worker ``worker_id`` over ``pipe``, through
        ``staging`` (default: the sender's)."""
        staging = staging if staging is not None else self.staging
        assert staging is not None
        return PipeSenderTransport(pipe, worker_id, staging, self._model_id, fault_hint=self._fault_hint)

    def _connected(self) -> None:
        # Every worker has its end now: the sender's copies would only keep
        # a dead worker's pipe from closing.
        for end in self._worker_ends.values():
            end.close()
        self._worker_ends = {}

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], Staging | None]:
        staging = self._staging_class()
        pipes = self._sender_pipes(context, kwargs)
        transports: dict[int, SenderTransport] = {
            i: self._pipe_transport(pipe, i, staging) for i, pipe in enumerate(pipes)
        }
        return transports, staging

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> EndpointFactory:
        pipe = self._worker_pipe(context, kwargs)
        model_id, reader = self._model_id, self._reader_class()
        return lambda receiver: PipeEndpoint(pipe, model_id, reader)

    def shutdown(self) -> None:
        """As :meth:`WeightSyncScheme.shutdown`; also closes the pipes the
        scheme made."""
        try:
            super().shutdown()
        finally:
            for pipe in [*self._own_pipes, *self._worker_ends.values()]:
                pipe.close()
            self._own_pipes = []
            self._worker_ends = {}

    def create_transport(self, pipe: Any) -> PipeSenderTransport:
        """Legacy: a sender channel over ``pipe``, sharing this scheme's
        staging memory once ``init_on_sender`` has run."""
        staging = self.staging
        if not isinstance(staging, self._staging_class):
            staging = self._staging_class()
        return PipeSenderTransport(pipe, len(self.sender_transports), staging, self._model_id)


class MultiProcessWeightSyncScheme(_PipeScheme):
    """Weights over ``multiprocessing`` pipes, bytes through shared memory.

    Default strategy: ``'state_dict'``.

    Sender: ``init_on_sender(model_id, pipes=[...], num_workers=len(pipes))``
    (or a context with ``pipes``/``num_workers``), the trainer's end of one
    duplex pipe per worker, used by this scheme only. Each send writes the
    bytes once into a shared staging segment, whatever the number of workers.

    Worker: ``init_on_worker(model_id, pipe=..., model=...)``. The worker
    copies the bytes into its own model when it calls ``receive()``: it never
    runs on half-written weights and is isolated from the trainer's later
    changes. Every parameter keeps its identity and ``data_ptr()``.
    """

    default_strategy = "state_dict"
    _staging_class = SegmentStaging
    _reader_class = CopyReader


class SharedMemWeightSyncScheme(_PipeScheme):
    """Zero-copy weights on one host: workers run on weights in shared memory.

    Default strategy: ``'tensordict'``.

    Set up exactly like :class:`MultiProcessWeightSyncScheme` (pipes on the
    sender, ``pipe`` and ``model`` on each worker). Each send is written once
    into a shared-memory slot that no worker is reading; a worker moves to it
    at ``receive()`` by re-pointing its tensors, without copying, and acks.
    Nothing a worker reads between two ``receive()`` calls ever changes under
    it, and the trainer's later changes reach no worker without a send.

    A tensor keeps its identity (the same ``nn.Parameter`` object) but not its
    ``data_ptr()``, which changes at each update (the first one included:
    until then a worker runs on its own memory). Where ``data_ptr()`` must
    stay fixed (CUDA graphs, compiled code holding addresses), use
    :class:`MultiProcessWeightSyncScheme`.

    Slots are mapped read-only by the workers, so no worker can change what
    another reads. For an ``nn.Module``, only parameters run on shared
    memory: buffers (BatchNorm statistics, counters) are copied into the
    worker's own memory at each update, so worker code may write into them
    (BatchNorm in train mode) and the next update replaces them. Writing
    into a parameter in place faults (a SIGSEGV of that worker); a worker
    that trains its own copy needs :class:`MultiProcessWeightSyncScheme`.
    Slots stay mapped while the worker's model runs on them, even after
    ``shutdown()``.
    """

    default_strategy = "tensordict"
    _staging_class = SlotStaging
    _reader_class = SlotReader
    _fault_hint = (
        "Under SharedMemWeightSyncScheme a worker's parameters are read-only shared memory: "
        "a worker that writes into them faults; use MultiProcessWeightSyncScheme for workers that "
        "must write their parameters"
    )


class _Rendezvous:
    """Where the two sides of an in-process scheme meet: one duplex pipe per
    worker index, made by whichever side asks first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pipes: dict[int, tuple[Connection, Connection]] = {}

    def end(self, index: int, *, worker: bool) -> Connection:
        with self._lock:
            if index not in self._pipes:
                self._pipes[index] = multiprocessing.Pipe(duplex=True)
            return self._pipes[index][1 if worker else 0]


class InProcessWeightSyncScheme(_PipeScheme):
    """Trainer and workers in one process: threads, or tasks on one event
    loop. For testing trainer and collector code without processes.

    Default strategy: ``'state_dict'``.

    It behaves as :class:`MultiProcessWeightSyncScheme` (same channels, same
    staging segment, each worker copies an update into its model in
    ``receive()``, acks, deadlines and errors), but it makes its own pipes:

    - sender: ``init_on_sender(model_id, model=..., num_workers=N)``;
    - worker ``i``: on its own copy of the scheme (``copy.copy(scheme)``, as
      each process gets its own when a scheme is pickled),
      ``init_on_worker(model_id, model=..., worker_idx=i)``.

    It cannot be pickled: it works within one process only.
    """

    default_strategy = "state_dict"
    _staging_class = SegmentStaging
    _reader_class = CopyReader

    def __init__(
        self,
        strategy: StrategyName | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = False,
        per_worker_weights: bool = False,
    ) -> None:
        super().__init__(strategy, timeout=timeout, verify=verify, per_worker_weights=per_worker_weights)
        self._rendezvous = _Rendezvous()

    def __copy__(self) -> InProcessWeightSyncScheme:
        clone = type(self)(
            self.strategy.extract_as,
            timeout=self.timeout,
            verify=self.verify,
            per_worker_weights=self.per_worker_weights,
        )
        clone._rendezvous = self._rendezvous
        clone._model_id = self._model_id
        return clone

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "InProcessWeightSyncScheme works within one process: give each worker copy.copy(scheme); "
            "between processes use MultiProcessWeightSyncScheme"
        )

    def _sender_pipes(self, context: Any, kwargs: dict[str, Any]) -> list[Connection]:
        num_workers = _num_workers(context, kwargs)
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"{type(self).__name__}.init_on_sender needs num_workers=N (N >= 1)")
        pipes = [self._rendezvous.end(i, worker=False) for i in range(num_workers)]
        self._own_pipes = pipes
        return pipes

    def _new_transport(self, worker_id: int, channel: Any, *, replaces: bool) -> SenderTransport:
        """No channel: the scheme makes the pipe of worker ``worker_id``
        (whose thread inits its copy with ``worker_idx=worker_id``)."""
        if channel is not None:
            raise ValueError("InProcessWeightSyncScheme.add_worker makes its own pipe: pass no channel")
        if replaces:
            raise ValueError(
                "InProcessWeightSyncScheme.add_worker cannot bring back a worker under its old id; "
                "add it under a new one"
            )
        pipe = self._rendezvous.end(worker_id, worker=False)
        self._own_pipes.append(pipe)
        return self._pipe_transport(pipe, worker_id)

    def _worker_pipe(self, context: Any, kwargs: dict[str, Any]) -> Connection:
        index = _from(context, kwargs, "worker_idx")
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"{type(self).__name__}.init_on_worker needs worker_idx=i (i >= 0)")
        pipe = self._rendezvous.end(index, worker=True)
        self._own_pipes = [pipe]
        return pipe


class RayWeightSyncScheme(WeightSyncScheme):
    """Weights to Ray actors through Ray's object store, on one machine or a cluster.

    Sender (the trainer, a Ray driver or actor):
    ``init_on_sender(model_id, remote_collectors=[actor, ...], model=...)``
    (``source_model=`` is an alias of ``model=``; a context with
    ``remote_collectors`` works too). Worker ``i`` is ``remote_collectors[i]``.
    Each send puts the bytes into the object store once, as numpy buffers
    (no torch pickling), then calls every targeted actor; each actor's node
    holds one copy, which the actors there read in place.

    Worker (inside any Ray actor, typically its ``__init__``):
    ``init_on_worker(model_id, model=..., on_update=None)``. No base class or
    method is needed on the actor: the sender reaches it through Ray's
    ``__ray_call__`` (or, slightly faster, through the method of
    :class:`RayWeightSyncMixin` when the actor's class has it). Each update
    is copied into the model in place (every
    tensor keeps its identity and ``data_ptr()``) and acked when the call
    returns:

    - a plain actor applies it between two of its method calls;
    - an async actor applies it on its event loop, between two awaits (call
      ``init_on_worker`` from ``__init__`` or a method, which run on that
      loop, so weightsync knows it; off the loop it raises);
    - a threaded actor (``max_concurrency > 1``) applies it on a thread of
      its own, concurrently with the methods running then.

    ``on_update(version)``, if given, runs on the actor after each update.
    ``receive()`` never waits: it returns the newest version applied since
    its previous call, or None.

    Errors are weightsync's: a dead or unreachable actor is a
    :class:`WorkerLostError` naming the worker; no Ray exception reaches the
    caller. Ray must be initialised (``ray.init``) before ``init_on_sender``.
    Default strategy: ``'state_dict'``.
    """

    default_strategy = "state_dict"
    # The sender finds a registered actor through Ray: nothing to announce,
    # and no event loop to enter, so this works inside an async actor's loop.
    _announces = False

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], Staging | None]:
        import ray

        from ._transports._ray import RaySenderTransport, RayStaging

        actors: Sequence[Any] | None = _from(context, kwargs, "remote_collectors")
        if actors is None:
            raise ValueError(f"{type(self).__name__}.init_on_sender needs remote_collectors=[actor, ...]")
        if not ray.is_initialized():
            # Otherwise the first send's ray.put would quietly start a new,
            # empty local Ray instance that none of the actors live in.
            raise WeightSyncStateError(
                f"{type(self).__name__}.init_on_sender: Ray is not initialised; call ray.init() "
                "(and create the actors) first",
                model_id=self._model_id,
            )
        staging = RayStaging(self._model_id)
        transports: dict[int, SenderTransport] = {
            i: RaySenderTransport(actor, i, staging, self._model_id) for i, actor in enumerate(actors)
        }
        return transports, staging

    def init_on_sender(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Initialise the sender side; see the class docstring. Does not block.

        :raises RuntimeError: this scheme is already initialised here, or Ray
            is not initialised.
        :raises ValueError: no ``remote_collectors`` were given.
        """
        if "source_model" in kwargs and kwargs.get("model") is None:
            kwargs["model"] = kwargs.pop("source_model")
        super().init_on_sender(model_id, context, **kwargs)

    def connect(
        self,
        *,
        worker_idx: int | None = None,
        weights: Any = None,
        timeout: float | None = None,
        background: bool = True,
    ) -> SendReport | None:
        """Sender: as :meth:`WeightSyncScheme.connect` (wait for the actors,
        send the initial weights). Worker: returns at once: an actor applies
        every update as it arrives anyway, and waiting inside its
        ``__init__`` would keep it from taking the call that brings them."""
        if self._async_receiver is not None:
            self._synchronized_on_receiver = True
            return None
        return super().connect(worker_idx=worker_idx, weights=weights, timeout=timeout)

    def _new_transport(self, worker_id: int, channel: Any, *, replaces: bool) -> SenderTransport:
        """``channel``: the new actor's handle."""
        from ._transports._ray import RaySenderTransport, RayStaging

        staging = self.staging
        if channel is None or not isinstance(staging, RayStaging):
            raise ValueError("RayWeightSyncScheme.add_worker needs the actor's handle")
        return RaySenderTransport(channel, worker_id, staging, self._model_id)

    def create_transport(self, actor: Any) -> SenderTransport:
        """Legacy: a sender channel to one Ray actor, sharing this scheme's
        object-store staging once ``init_on_sender`` has run."""
        from ._transports._ray import RaySenderTransport, RayStaging

        staging = self.staging
        if not isinstance(staging, RayStaging):
            staging = RayStaging(self._model_id)
        return RaySenderTransport(actor, len(self.sender_transports), staging, self._model_id)

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> EndpointFactory:
        from ._transports._ray import RayEndpoint

        model_id, on_update = self._model_id, self._updated
        return lambda receiver: RayEndpoint(model_id, receiver, on_update)


class RayWeightSyncMixin:
    """Optional base class for Ray actors synchronised by
    :class:`RayWeightSyncScheme`.

    Not needed: without it the sender reaches the actor through Ray's
    ``__ray_call__``. With it, each update is a call of the actor's own
    :meth:`weightsync_apply` method, which saves Ray from serialising a
    function with every call (about 0.1 ms of the trainer's time per actor
    and update, measured on a 2-core machine). Behaviour is otherwise the
    same.
    """

    def weightsync_apply(self, update: Any) -> Any:
        """Apply one update sent by a :class:`RayWeightSyncScheme` sender
        (called by the sender through Ray; not for user code)."""
        from ._transports._ray import apply_on_actor

        return apply_on_actor(self, update)


class NoWeightSyncScheme(WeightSyncScheme):
    """No synchronisation: ``send`` and ``receive`` do nothing and return None.

    Default strategy: ``'tensordict'``.
    """

    _needs_model = False

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], Staging | None]:
        return {}, None

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> EndpointFactory:
        return lambda receiver: NoEndpoint()

    def create_transport(self, **kwargs: Any) -> NoTransport:
        """A transport that moves nothing."""
        return NoTransport()

    def connect(
        self,
        *,
        worker_idx: int | None = None,
        weights: Any = None,
        timeout: float | None = None,
        background: bool = True,
    ) -> None:
        """Nothing to exchange: marks this side synchronised."""
        if self._async_sender is not None:
            self._synchronized_on_sender = True
        elif self._async_receiver is not None:
            self._synchronized_on_receiver = True

    def send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
        keys: Keys | None = None,
        partial: bool = False,
        verify: bool | None = None,
    ) -> None:
        """No-op send: does nothing."""
        return None

    def receive(self, timeout: float | None = None) -> None:
        """No-op receive: always returns None."""
        return None
