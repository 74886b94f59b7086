"""Schemes: the configuration of how ONE model is synchronised, and the
entry point that builds each side.

A scheme is created on the trainer, can be pickled (configuration only) and
handed to spawned workers, and is initialised once per process:
``init_on_sender`` on the trainer, ``init_on_receiver`` (alias
``init_on_worker``) on each worker.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from ._exceptions import WeightSyncStateError
from ._facade import WeightReceiver, WeightSender
from ._receiver import AsyncWeightReceiver
from ._sender import DEFAULT_TIMEOUT, AsyncWeightSender, SendReport
from ._strategy import WeightStrategy
from ._transports._base import ReceiverTransport, SenderTransport, SharedTransport
from ._transports._mp import MPReceiverTransport, MPSenderTransport, StagingArea
from ._transports._none import NoReceiverTransport, NoTransport
from ._transports._shm import ShmReceiverTransport, ShmSenderTransport, SlotStore

__all__ = [
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


def _model_of(model_id: str | None, context: Any, kwargs: dict[str, Any]) -> Any:
    model = kwargs.get("model")
    if model is None and context is not None:
        get_model = getattr(context, "get_model", None)
        model = get_model(model_id) if get_model is not None else getattr(context, "model", None)
    return model


class WeightSyncScheme:
    """Base class of every scheme: the whole public surface, transport-agnostic.

    Subclasses provide the transports (``_sender_side`` / ``_receiver_side``).
    ``timeout`` is the default deadline of a send, in seconds.
    """

    _needs_model = True

    def __init__(
        self,
        strategy: Literal["state_dict", "tensordict"] = "tensordict",
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.strategy = WeightStrategy(strategy)
        self.timeout = timeout
        self._reset()

    def _reset(self) -> None:
        self._model_id: str | None = None
        self._context: Any = None
        self._model: Any = None
        self._worker_idx: int | None = None
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self._sender_transports: dict[int, SenderTransport] = {}
        self._receiver_transport: ReceiverTransport | None = None
        self._shared_transport: SharedTransport | None = None

    # A scheme crosses process boundaries as configuration only: pipes,
    # models and event loops belong to the process that created them.
    def __getstate__(self) -> dict[str, Any]:
        return {"strategy": self.strategy.extract_as, "timeout": self.timeout, "model_id": self._model_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.strategy = WeightStrategy(state["strategy"])
        self.timeout = state["timeout"]
        self._reset()
        self._model_id = state["model_id"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy.extract_as!r}, model_id={self._model_id!r})"

    # -- properties -----------------------------------------------------
    @property
    def context(self) -> Any | None:
        """The context object (e.g. a collector) given at init, if any."""
        return self._context

    @property
    def model(self) -> Any | None:
        """The model this process synchronises (the worker's model, or the
        sender's source model), if known."""
        return self._model

    @property
    def model_id(self) -> str | None:
        return self._model_id

    @property
    def worker_idx(self) -> int | None:
        """This worker's index (worker side), if set."""
        return self._worker_idx

    @property
    def weights(self) -> Any | None:
        """The current weights of :attr:`model` in the strategy's form, or None."""
        if self._model is None:
            return None
        return self.strategy.extract_weights(self._model, model_id=self._model_id)

    @property
    def sender_transports(self) -> dict[int, SenderTransport]:
        """The sender's channel to each worker, by worker id."""
        return dict(self._sender_transports)

    @property
    def receiver_transport(self) -> ReceiverTransport | None:
        return self._receiver_transport

    @property
    def shared_transport(self) -> SharedTransport | None:
        """What is written once per send for all workers (e.g. the staging area)."""
        return self._shared_transport

    # -- transports, per scheme ------------------------------------------
    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], SharedTransport | None]:
        raise NotImplementedError

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> ReceiverTransport:
        raise NotImplementedError

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
        if self._sender is not None or self._receiver is not None:
            raise WeightSyncStateError(f"{self!r} is already initialised in this process")
        self._model_id = model_id if model_id is not None else kwargs.get("model_id", self._model_id)
        self._context = context
        self._model = _model_of(self._model_id, context, kwargs)
        transports, shared = self._sender_side(context, kwargs)
        self._sender_transports = transports
        self._shared_transport = shared
        source = (
            context
            if context is not None
            else (types.SimpleNamespace(model=self._model) if self._model is not None else None)
        )
        self._sender = WeightSender(
            AsyncWeightSender(
                model_id=self._model_id,
                strategy=self.strategy,
                transports=transports,
                shared=shared,
                context=source,
                timeout=self.timeout,
            )
        )

    def init_on_receiver(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Initialise a worker (receiver side) and announce it to the sender.

        ``kwargs`` (or the context) give the ``model`` to update in place,
        and what the transport needs (see each scheme).

        :raises RuntimeError: this scheme is already initialised here.
        :raises ValueError: no model was given.
        """
        if self._sender is not None or self._receiver is not None:
            raise WeightSyncStateError(f"{self!r} is already initialised in this process")
        self._model_id = model_id if model_id is not None else kwargs.get("model_id", self._model_id)
        self._context = context
        self._model = _model_of(self._model_id, context, kwargs)
        self._worker_idx = _from(context, kwargs, "worker_idx")
        if self._model is None and self._needs_model:
            raise ValueError(
                f"init_on_receiver needs the model to update: pass model=... or a context with get_model() "
                f"(model {self._model_id!r})"
            )
        transport = self._receiver_side(context, kwargs)
        self._receiver_transport = transport
        self._receiver = WeightReceiver(
            AsyncWeightReceiver(model_id=self._model_id, model=self._model, transport=transport)
        )
        self._announce(self._receiver)

    def _announce(self, receiver: WeightReceiver) -> None:
        """Make a new worker known to the sender."""
        receiver.announce()

    def init_on_worker(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Alias of :meth:`init_on_receiver`."""
        self.init_on_receiver(model_id, context, **kwargs)

    def connect(self, *, worker_idx: int | None = None, timeout: float | None = None) -> None:
        """Sender: block until every worker (or ``worker_idx``) announced
        itself. Worker: announce again. Either side: no-op before init."""
        if self._sender is not None:
            self._sender.connect(worker_idx, timeout=timeout)
        elif self._receiver is not None:
            if worker_idx is not None:
                self._worker_idx = worker_idx
            self._receiver.announce()

    def get_sender(self) -> WeightSender:
        """The blocking sender. :raises RuntimeError: before ``init_on_sender``."""
        if self._sender is None:
            raise WeightSyncStateError(
                f"{self!r}: get_sender() before init_on_sender()", model_id=self._model_id
            )
        return self._sender

    def get_receiver(self) -> WeightReceiver:
        """The blocking receiver. :raises RuntimeError: before ``init_on_receiver``."""
        if self._receiver is None:
            raise WeightSyncStateError(
                f"{self!r}: get_receiver() before init_on_receiver()", model_id=self._model_id
            )
        return self._receiver

    def get_async_sender(self) -> AsyncWeightSender:
        """The coroutine sender, for async trainers. :raises RuntimeError: before init."""
        return self.get_sender().async_sender

    def get_async_receiver(self) -> AsyncWeightReceiver:
        """The coroutine receiver. :raises RuntimeError: before init."""
        return self.get_receiver().async_receiver

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
            context = (
                self._context
                if self._context is not None
                else (types.SimpleNamespace(model=self._model) if self._model is not None else None)
            )
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
    ) -> SendReport | None:
        """Blocking send to ``worker_ids`` (default all); see :meth:`WeightSender.send`."""
        return self.get_sender().send(weights, worker_ids, timeout=timeout)

    def receive(self, timeout: float | None = None) -> int | None:
        """Apply the newest pending update; see :meth:`WeightReceiver.receive`."""
        return self.get_receiver().receive(timeout)

    def shutdown(self) -> None:
        """Close this side's channels and release shared memory and the loop
        thread. Idempotent; safe on a scheme never initialised."""
        sender, receiver = self._sender, self._receiver
        try:
            if sender is not None:
                sender.shutdown()
        finally:
            if receiver is not None:
                receiver.shutdown()


class MultiProcessWeightSyncScheme(WeightSyncScheme):
    """Weights over ``multiprocessing`` pipes, bytes through shared memory.

    Sender: ``init_on_sender(model_id, pipes=[...], num_workers=len(pipes))``
    (or a context with ``pipes``/``num_workers``), the trainer's end of one
    duplex pipe per worker, used by this scheme only. Each send writes the
    bytes once into a shared staging segment, whatever the number of workers.

    Worker: ``init_on_worker(model_id, pipe=..., model=...)``. The worker
    copies the bytes into its own model when it calls ``receive()``: it never
    runs on half-written weights and is isolated from the trainer's later
    changes. Every parameter keeps its identity and ``data_ptr()``.
    """

    def __init__(
        self,
        strategy: Literal["state_dict", "tensordict"] = "state_dict",
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(strategy, timeout=timeout)

    # The pipe-based schemes differ only in these three classes.
    _shared_class: type[StagingArea] | type[SlotStore] = StagingArea
    _channel_class: type[MPSenderTransport] = MPSenderTransport
    _endpoint_class: type[MPReceiverTransport] = MPReceiverTransport

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], SharedTransport | None]:
        pipes: Sequence[Any] | None = _from(context, kwargs, "pipes")
        if pipes is None:
            raise ValueError(f"{type(self).__name__}.init_on_sender needs pipes=[...]")
        pipes = list(pipes)
        num_workers = _from(context, kwargs, "num_workers") or len(pipes)
        if num_workers != len(pipes):
            raise ValueError(f"num_workers={num_workers} but {len(pipes)} pipes were given")
        shared = self._shared_class()
        transports: dict[int, SenderTransport] = {
            i: self._channel_class(pipe, i, shared, self._model_id) for i, pipe in enumerate(pipes)
        }
        return transports, shared

    def create_transport(self, pipe: Any) -> MPSenderTransport:
        """Legacy: a sender channel over ``pipe``, sharing this scheme's
        staging memory once ``init_on_sender`` has run."""
        shared = self._shared_transport
        if not isinstance(shared, self._shared_class):
            shared = self._shared_class()
        return self._channel_class(pipe, len(self._sender_transports), shared, self._model_id)

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> ReceiverTransport:
        pipe = _from(context, kwargs, "pipe")
        if pipe is None:
            raise ValueError(f"{type(self).__name__}.init_on_worker needs pipe=...")
        return self._endpoint_class(pipe, self._model_id)


class SharedMemWeightSyncScheme(MultiProcessWeightSyncScheme):
    """Zero-copy weights on one host: workers run on weights in shared memory.

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
    """

    def __init__(
        self,
        strategy: Literal["state_dict", "tensordict"] = "tensordict",
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(strategy, timeout=timeout)

    _shared_class = SlotStore
    _channel_class = ShmSenderTransport
    _endpoint_class = ShmReceiverTransport


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
    """

    def __init__(
        self,
        strategy: Literal["state_dict", "tensordict"] = "state_dict",
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(strategy, timeout=timeout)

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], SharedTransport | None]:
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
        shared = RayStaging(self._model_id)
        transports: dict[int, SenderTransport] = {
            i: RaySenderTransport(actor, i, shared, self._model_id) for i, actor in enumerate(actors)
        }
        return transports, shared

    def init_on_sender(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Initialise the sender side; see the class docstring. Does not block.

        :raises RuntimeError: this scheme is already initialised here, or Ray
            is not initialised.
        :raises ValueError: no ``remote_collectors`` were given.
        """
        if "source_model" in kwargs and kwargs.get("model") is None:
            kwargs["model"] = kwargs.pop("source_model")
        super().init_on_sender(model_id, context, **kwargs)

    def create_transport(self, actor: Any) -> SenderTransport:
        """Legacy: a sender channel to one Ray actor, sharing this scheme's
        object-store staging once ``init_on_sender`` has run."""
        from ._transports._ray import RaySenderTransport, RayStaging

        shared = self._shared_transport
        if not isinstance(shared, RayStaging):
            shared = RayStaging(self._model_id)
        return RaySenderTransport(actor, len(self._sender_transports), shared, self._model_id)

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> ReceiverTransport:
        from ._transports._ray import RayReceiverTransport

        return RayReceiverTransport(self._model_id, on_update=_from(context, kwargs, "on_update"))

    def _announce(self, receiver: WeightReceiver) -> None:
        # Registering is all a Ray worker does: the sender asks the actor for
        # its layout through Ray. No event loop is involved, so this also
        # works inside an async actor's running loop.
        from ._transports._ray import RayReceiverTransport

        transport = receiver.async_receiver.transport
        assert isinstance(transport, RayReceiverTransport)
        core = receiver.async_receiver
        transport.register(core.apply_update, core.manifest())


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
    """No synchronisation: ``send`` and ``receive`` do nothing and return None."""

    _needs_model = False

    def __init__(
        self,
        strategy: Literal["state_dict", "tensordict"] = "tensordict",
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(strategy, timeout=timeout)

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], SharedTransport | None]:
        return {}, None

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> ReceiverTransport:
        return NoReceiverTransport()

    def create_transport(self, **kwargs: Any) -> NoTransport:
        """A transport that moves nothing."""
        return NoTransport()

    def connect(self, *, worker_idx: int | None = None, timeout: float | None = None) -> None:
        """No-op."""

    def send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """No-op send: does nothing."""
        return None

    def receive(self, timeout: float | None = None) -> None:
        """No-op receive: always returns None."""
        return None
