"""The base of every scheme: the configuration of how ONE model is
synchronised, and the entry point that builds each side.

A scheme is created on the trainer, can be pickled (configuration only) and
handed to spawned workers, and is initialised once per process:
``init_on_sender`` on the trainer, ``init_on_receiver`` (alias
``init_on_worker``) on each worker. A scheme family (its own module in this
package) provides the transports.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Literal

import torch

from .._copy import WireCast
from .._digest import require_xxh3
from .._exceptions import WeightSyncStateError
from .._exit import front_of
from .._facade import WeightReceiver, WeightSender
from .._receiver import AsyncWeightReceiver
from .._send import refuse_options
from .._sender import DEFAULT_TIMEOUT, AsyncWeightSender, Keys, SendReport
from .._strategy import WeightStrategy, model_of, model_tensors, refuse_sharded
from .._torchrl import is_torchrl_collector
from .._torchrl import register_with_torchrl as _register
from .._transports._base import Applier, SenderTransport, Staging, WorkerEndpoint

__all__ = ["EndpointFactory", "SchemeConfig", "StrategyName", "WeightSyncScheme", "register_with_torchrl"]


def _from(context: Any, kwargs: dict[str, Any], name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return getattr(context, name, default) if context is not None else default


def _params_map(kwargs: dict[str, Any]) -> dict[int, Any] | None:
    """torchrl's ``params_map={worker_idx: weights}``, checked: one entry per
    worker, keyed 0 to N-1."""
    params_map = kwargs.get("params_map")
    if params_map is None:
        return None
    if not isinstance(params_map, Mapping):
        raise ValueError(
            f"params_map must be a dict of worker index to weights, not {type(params_map).__name__}"
        )
    if not params_map or set(params_map) != set(range(len(params_map))):
        raise ValueError(
            f"params_map must map the worker indices 0 to N-1 (N >= 1), got keys {list(params_map)!r}"
        )
    return dict(params_map)


def _num_workers(context: Any, kwargs: dict[str, Any]) -> Any:
    """``num_workers``, else one worker per entry of ``devices`` or of
    ``params_map`` (as torchrl's schemes take them: the device of each
    worker's policy; the weights of each worker)."""
    num_workers = _from(context, kwargs, "num_workers")
    params_map = _params_map(kwargs)
    if params_map is not None:
        if num_workers is not None and num_workers != len(params_map):
            raise ValueError(f"num_workers={num_workers} but params_map has {len(params_map)} workers")
        return len(params_map)
    if num_workers is None:
        devices = kwargs.get("devices")
        if devices is not None and not isinstance(devices, str | torch.device):
            num_workers = len(devices)
    return num_workers


def _given_model(kwargs: dict[str, Any]) -> Any:
    """The model passed explicitly: ``model``, else ``weights`` (as torchrl's
    schemes take them), else worker 0's entry of ``params_map`` (each
    worker's copy is made by its own receiver, so one source serves all);
    None if none was."""
    for name in ("model", "weights"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    params_map = _params_map(kwargs)
    if params_map is not None:
        return params_map[0]
    return None


def _model_of(model_id: str | None, context: Any, kwargs: dict[str, Any]) -> Any:
    """The model of this process, in torchrl's order: the one passed
    explicitly (:func:`_given_model`), else the context's (its
    ``get_model(model_id)``, ``.model``, or attribute ``model_id``)."""
    given = _given_model(kwargs)
    if given is not None:
        return given
    try:
        return model_of(context, model_id)
    except (LookupError, ValueError, AttributeError):
        # A context that holds no such model (yet): e.g. a torchrl collector
        # whose workers build their policy from a factory.
        return None


def _factory_model(context: Any, model_id: str | None) -> Any:
    """Where a torchrl collector's workers build their policy from one
    factory (the same for every worker) and the collector holds none, the
    trainer builds one too, as torchrl's schemes do: its weights are the
    initial ones. None otherwise (distinct factories keep their own)."""
    if context is None or model_id != "policy":
        return None
    factories = getattr(context, "policy_factory", None)
    if isinstance(factories, list | tuple):
        if not factories or not all(f is factories[0] for f in factories):
            return None
        factories = factories[0]
    return factories() if callable(factories) else None


StrategyName = Literal["state_dict", "tensordict"]
EndpointFactory = Callable[[Applier], WorkerEndpoint]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchemeConfig:
    """What a scheme was constructed with, checked once and frozen: the
    options of every scheme (see :class:`WeightSyncScheme`). A scheme
    family adds its own options in a subclass. It pickles as it is: a
    pickled scheme is this, its ``model_id``, and the few process-crossing
    handles its family hands to its workers.

    :raises ValueError: an unknown ``strategy``, or a ``wire_dtype`` that is
        not a floating dtype narrower than float32.
    :raises MissingExtraError: ``verify=True`` without the ``verify`` extra
        installed (the message names it).
    """

    strategy: StrategyName = "tensordict"
    timeout: float = DEFAULT_TIMEOUT
    verify: bool = False
    per_worker_weights: bool = False
    wire_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        # Refused here, where the scheme is made, rather than at the first send.
        if self.verify:
            require_xxh3()
        WeightStrategy(self.strategy)
        if self.wire_dtype is not None:
            WireCast(self.wire_dtype)


class _SchemeState:
    """What every scheme is in one process: its frozen configuration (the
    read-only options), the state torchrl's collectors read and set
    (context, model, worker index, whether each side is initialised and
    synchronised), and the hooks a family fills in (its transports). The
    two sides build on it (:class:`_SenderSide`, :class:`_WorkerSide`)."""

    default_strategy: ClassVar[StrategyName] = "tensordict"

    _config_class: ClassVar[type[SchemeConfig]] = SchemeConfig

    _needs_model = True

    def _refuse_options(self, unknown: Mapping[str, Any]) -> None:
        """A ``TypeError`` naming this (public) class for options it does not
        take, where Python's own would name the class that defines
        ``__init__`` (a private base); for ``delta``, which schemes take it.

        :raises TypeError: ``unknown`` is not empty.
        """
        if not unknown:
            return
        name = type(self).__name__
        if "delta" in unknown:
            raise TypeError(
                f"{name}() takes no delta option: delta sends are for the cross-host schemes, "
                "RayWeightSyncScheme(delta=True) and DistributedWeightSyncScheme(delta=True); on one "
                "host every send's bytes move once, through shared memory"
            )
        taken = [
            p.name
            for p in inspect.signature(type(self)).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        raise TypeError(
            f"{name}() got an unexpected keyword argument {next(iter(unknown))!r}; it takes "
            + ", ".join(taken)
        )

    def _configure(self, strategy: StrategyName | None, **options: Any) -> None:
        """Check the options and freeze them (a subclass's ``__init__`` calls
        this with its own options, as its ``_config_class`` takes them)."""
        self._enter(self._config_class(strategy=strategy or self.default_strategy, **options))

    def _enter(self, config: SchemeConfig) -> None:
        """This scheme in this process, uninitialised, from ``config``: once
        made, and once unpickled (or copied) in another process."""
        self._config = config
        self._strategy = WeightStrategy(config.strategy)
        self._reset()
        # torchrl's collectors check isinstance(scheme, its WeightSyncScheme):
        # register if this process has torchrl already (init looks again).
        _register(WeightSyncScheme)

    def _reset(self) -> None:
        """The state of this process's side, before any init (a subclass
        adds its own)."""
        self._model_id: str | None = None
        self._context: Any = None
        self._model: Any = None
        # Whether the sender's model was passed explicitly (it then wins over
        # the context's, as in torchrl) rather than found in the context
        # (then each send(None) looks it up in the context again).
        self._model_given = False
        self._worker_idx: int | None = None
        self._async_sender: AsyncWeightSender | None = None
        self._async_receiver: AsyncWeightReceiver | None = None
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self._on_update: Callable[[int], Any] | None = None
        self._synchronized_on_sender = False
        self._synchronized_on_receiver = False
        # Whether the next update a worker applies is its initial weights
        # (the sender's connect), which torchrl's policy versions do not count.
        self._initial_pending = False

    # A scheme crosses process boundaries as its frozen configuration and its
    # model id; pipes, models and event loops belong to the process that
    # created them (a family adds the handles it hands to its workers).
    def __getstate__(self) -> dict[str, Any]:
        return {"config": self._config, "model_id": self._model_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._enter(state["config"])
        self._model_id = state["model_id"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy.extract_as!r}, model_id={self._model_id!r})"

    @property
    def config(self) -> SchemeConfig:
        """The options this scheme was made with, frozen (assigning a field
        raises ``dataclasses.FrozenInstanceError``)."""
        return self._config

    @property
    def strategy(self) -> WeightStrategy:
        """How weights are extracted and applied (``config.strategy``)."""
        return self._strategy

    @property
    def timeout(self) -> float:
        """The default deadline of a send and of each phase of ``connect()``, in seconds."""
        return self._config.timeout

    @property
    def verify(self) -> bool:
        """The default of ``send(verify=...)``."""
        return self._config.verify

    @property
    def per_worker_weights(self) -> bool:
        """Whether each worker keeps weights of its own."""
        return self._config.per_worker_weights

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype float32 weights travel and land as, or None."""
        return self._config.wire_dtype

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
        if self._async_sender is not None:
            self._async_sender.context = self._source()

    @property
    def model(self) -> Any | None:
        """The model this process synchronises (the worker's model, or the
        sender's source model), if known.

        Settable: on a worker, the next updates go to the new model (same
        layout), whose forward calls become the steps the background applier
        waits for; on the sender, ``send(None)`` reads it (rather than the
        context's)."""
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        self._model = model
        self._model_given = model is not None
        if self._async_receiver is not None and model is not None:
            self.get_receiver().set_model(model)
        elif self._async_sender is not None:
            self._async_sender.context = self._source()

    @property
    def model_id(self) -> str | None:
        return self._model_id

    @property
    def strategy_str(self) -> StrategyName:
        """The strategy's name, ``'state_dict'`` or ``'tensordict'`` (torchrl's
        trainers and Ray collector read it to extract weights themselves)."""
        return self.strategy.extract_as

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

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], Staging | None]:
        raise NotImplementedError

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> EndpointFactory:
        """How to build this worker's endpoint, given its receiver."""
        raise NotImplementedError

    def _refuse_sharded(self, model: Any, side: str) -> None:
        """Refuse a sharded model (one that holds DTensors) before anything
        is made: this scheme reads and writes whole tensors in one process.

        :raises InvalidWeightsError: naming the sharded tensors and what to do.
        """
        refuse_sharded(model, self._model_id, side=side)

    def _initialised(self) -> bool:
        return self._async_sender is not None or self._async_receiver is not None

    def create_transport(self, *args: Any, **kwargs: Any) -> Any:
        """Build one transport (legacy); see each scheme."""
        raise NotImplementedError

    def _begin_init(self, model_id: str | None, context: Any, kwargs: dict[str, Any]) -> None:
        """What both sides' init start with: this process's model id,
        context and model.

        :raises RuntimeError: this scheme is already initialised here."""
        if self._initialised():
            raise WeightSyncStateError(f"{self!r} is already initialised in this process")
        # torchrl may have been imported since the scheme was made (or unpickled).
        _register(WeightSyncScheme)
        self._model_id = model_id if model_id is not None else kwargs.get("model_id", self._model_id)
        self._context = context
        self._model = _model_of(self._model_id, context, kwargs)

    def _source(self) -> Any:
        """Where ``send(None)`` reads the weights: the model given explicitly,
        else the context (looked up at each send), else the model found at init."""
        if self._model is not None and (self._model_given or self._context is None):
            return types.SimpleNamespace(model=self._model)
        return self._context

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

    def get_sender(self) -> WeightSender:
        """The blocking sender. :raises RuntimeError: before ``init_on_sender``."""
        return self._blocking_sender()

    def _blocking_sender(self) -> WeightSender:
        """The blocking sender, as the scheme's own calls use it (a scheme may
        keep :meth:`get_sender` from its users)."""
        if self._sender is None:
            if self._async_sender is None:
                raise WeightSyncStateError(
                    f"{self!r}: get_sender() before init_on_sender()", model_id=self._model_id
                )
            self._sender = WeightSender(self._async_sender)
        return self._sender

    def get_async_sender(self) -> AsyncWeightSender:
        """The coroutine sender, for async trainers (no blocking facade, no
        loop thread involved). :raises RuntimeError: before ``init_on_sender``."""
        if self._async_sender is None:
            raise WeightSyncStateError(
                f"{self!r}: get_sender() before init_on_sender()", model_id=self._model_id
            )
        return self._async_sender

    def get_receiver(self) -> WeightReceiver:
        """The blocking receiver. :raises RuntimeError: before ``init_on_receiver``."""
        if self._receiver is None:
            self._receiver = WeightReceiver(self.get_async_receiver())
        return self._receiver

    def get_async_receiver(self) -> AsyncWeightReceiver:
        """The coroutine receiver. :raises RuntimeError: before ``init_on_receiver``."""
        if self._async_receiver is None:
            raise WeightSyncStateError(
                f"{self!r}: get_receiver() before init_on_receiver()", model_id=self._model_id
            )
        return self._async_receiver


class _SenderSide(_SchemeState):
    """The trainer's side of a scheme: ``init_on_sender``, its workers
    (waited for, added, removed), its senders and ``send``."""

    def init_on_sender(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Initialise the sender side (the trainer). Does not block.

        ``context`` (e.g. a collector) or ``kwargs`` give what the scheme
        needs (see each scheme); ``kwargs`` win. ``send(None)`` reads, as
        torchrl's schemes do, the ``model`` (or ``weights``) kwarg if given,
        else the context's model at each send: its ``get_model(model_id)``,
        else its ``.model``, else its attribute named ``model_id`` (e.g. a
        collector's ``.policy``). A torchrl collector that holds no policy,
        its workers building theirs from one factory, gets one built here by
        that factory, as in torchrl: its weights are the initial ones.

        :raises RuntimeError: this scheme is already initialised here.
        :raises ValueError: no workers (``pipes=[]``, ``num_workers=0``,
            ``remote_collectors=[]``), or what the scheme needs is missing.
        """
        self._begin_init(model_id, context, kwargs)
        self._model_given = _given_model(kwargs) is not None
        if self._model is None and not self.per_worker_weights:
            self._model = _factory_model(context, self._model_id)
            self._model_given = self._model is not None
        try:
            self._refuse_sharded(self._model, "the trainer's")
        except BaseException:
            self._reset()  # nothing was made: the scheme may be initialised again
            raise
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
            wire_dtype=self.wire_dtype,
        )
        # A trainer that ends without shutdown() still frees its workers:
        # at exit the scheme closes its sender (see _exit), if still here.
        front_of(self._async_sender, self)

    def _close_at_exit(self) -> None:
        """As the interpreter exits: close the sender, not waiting for a send
        under way (see ``WeightSender.close_at_exit``)."""
        if self._async_sender is not None:
            self._blocking_sender().close_at_exit()

    def _holds_a_model(self) -> bool:
        """Whether ``send(None)`` has a model to read now: a context whose
        workers build their policy from a factory (a torchrl collector given
        ``policy_factory``) holds none, and its workers then wait for the
        first ``send()`` with weights."""
        source = self._source()
        if source is None:
            return False
        try:
            return model_of(source, self._model_id) is not None
        except (LookupError, ValueError, AttributeError):
            return False

    def wait_for_workers(
        self, worker_ids: int | Iterable[int] | None = None, *, timeout: float | None = None
    ) -> dict[int, float]:
        """Sender: block until the workers (default: all) have announced
        themselves; the seconds each took. Sends nothing (unlike
        :meth:`connect`). An async trainer awaits
        ``get_async_sender().wait_for_workers()`` instead. See
        :meth:`AsyncWeightSender.wait_for_workers` for what it logs while it
        waits.

        :raises RuntimeError: called before ``init_on_sender`` (on a worker too).
        :raises WorkerError: naming every worker that died or did not
            announce itself within ``timeout`` (default: the scheme's).
        """
        if self._async_sender is None:
            raise WeightSyncStateError(
                f"{self!r}: wait_for_workers() is the sender's, after init_on_sender()",
                model_id=self._model_id,
            )
        return self._blocking_sender().wait_for_workers(worker_ids, timeout=timeout)

    def _connected(self) -> None:
        """Called on the sender once its workers announced themselves."""

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
            never announced itself, died, or cannot take them): it is
            removed again, and later sends do not wait for it.
        :raises RuntimeError: before ``init_on_sender``, or during a send.
        """
        sender = self._blocking_sender()
        if worker_id is not None and (not isinstance(worker_id, int) or worker_id < 0):
            raise ValueError(f"worker_id must be an int >= 0, not {worker_id!r}")
        known = self.sender_transports
        wid = worker_id if worker_id is not None else max(known, default=-1) + 1
        initial = weights is not None or (sender.async_sender.version > 0 and self._holds_a_model())
        transport = self._new_transport(wid, channel, replaces=wid in known)
        sender.add_worker(wid, transport, send=initial, weights=weights, timeout=timeout)
        return wid

    def remove_worker(self, worker_id: int) -> None:
        """Sender: stop sending to ``worker_id`` and free what was held for
        it; its channel is closed (the worker hears a clean shutdown). Sends
        to the others go on.

        :raises UnknownWorkerError: no such worker.
        :raises RuntimeError: before ``init_on_sender``, or during a send.
        """
        self._blocking_sender().remove_worker(worker_id)

    def _new_transport(self, worker_id: int, channel: Any, *, replaces: bool) -> SenderTransport:
        raise NotImplementedError(f"{type(self).__name__} has no workers to add")

    def create_sender(self) -> WeightSender:
        """Legacy: the sender of this scheme (same as :meth:`get_sender`)."""
        return self.get_sender()

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
    ) -> SendReport | None:
        """Blocking send to ``worker_ids`` (default all), whole or partial
        (``keys=``, ``partial=True``), checked end to end with ``verify``;
        see :meth:`WeightSender.send`."""
        refuse_options(unknown, "send()")
        return self._blocking_sender().send(
            weights, worker_ids, timeout=timeout, keys=keys, partial=partial, verify=verify
        )


class _WorkerSide(_SchemeState):
    """A worker's side of a scheme: ``init_on_receiver`` (alias
    ``init_on_worker``), what runs after each update, its receivers and
    ``receive``."""

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
        self._begin_init(model_id, context, kwargs)
        self._worker_idx = _from(context, kwargs, "worker_idx")
        self._on_update = _from(context, kwargs, "on_update")
        if self._model is None and self._needs_model:
            raise ValueError(
                f"init_on_receiver needs the model to update: pass model=..., or a context with get_model(), "
                f".model or an attribute {self._model_id!r}"
            )
        try:
            self._refuse_sharded(self._model, "the worker's")
        except BaseException:
            self._reset()
            raise
        self._initial_pending = self._waits_for_initial_weights()
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
        context's version (torchrl's collectors count policy versions), as
        torchrl's own schemes count it: the initial weights (the sender's
        ``connect()``) are version 0, each later update adds one."""
        if self._on_update is not None:
            self._on_update(version)
        initial, self._initial_pending = self._initial_pending, False
        # A push worker (Ray) is "connected" before its initial weights land;
        # those are still not an update of the policy.
        if self._synchronized_on_receiver and not initial:
            bump = getattr(self._context, "increment_version", None)
            if callable(bump):
                bump()

    #: Whether a new worker announces itself over its channel (a push
    #: endpoint is found by the sender instead).
    _announces = True

    def init_on_worker(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Alias of :meth:`init_on_receiver`."""
        self.init_on_receiver(model_id, context, **kwargs)

    def _loop_is_a_collectors(self) -> bool:
        """Whether this worker runs inside a loop that is not the user's: its
        context is a torchrl collector, which never calls ``receive()``
        (torchrl's own schemes apply from a thread of their own there)."""
        return is_torchrl_collector(self._context)

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

    def create_receiver(self) -> WeightReceiver:
        """Legacy: the receiver of this scheme (same as :meth:`get_receiver`)."""
        return self.get_receiver()

    def receive(self, timeout: float | None = None) -> int | None:
        """Apply the newest pending update; see :meth:`WeightReceiver.receive`."""
        return self.get_receiver().receive(timeout)


class WeightSyncScheme(_SenderSide, _WorkerSide):
    """Base class of every scheme: the whole public surface, transport-agnostic.

    Subclasses provide the transports (``_sender_side`` / ``_receiver_side``)
    and, for options of their own, a :class:`SchemeConfig` subclass
    (``_config_class``).
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

    ``wire_dtype`` (``torch.bfloat16`` or ``torch.float16``; lossy, opt-in):
    the trainer's float32 weights are cast once, as they are staged, and
    travel and land as that dtype: each worker's model holds those tensors
    in ``wire_dtype`` and gets, bit for bit, ``trainer_tensor.to(wire_dtype)``
    (round to nearest even, as torch casts). Other dtypes travel as they
    are. The trainer keeps one cast copy of the float32 weights (half their
    size for bfloat16). A worker whose model holds float32 there is refused
    before anything moves (:class:`WeightMismatchError`).

    The options are read-only once the scheme is made (:attr:`config`, and
    one property per option: ``scheme.timeout``, ``scheme.sync``, ...).
    """

    def __init__(
        self,
        strategy: StrategyName | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = False,
        per_worker_weights: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        """:raises ValueError: ``wire_dtype`` is not a floating dtype narrower than float32.
        :raises MissingExtraError: ``verify=True`` without the ``verify`` extra
            installed (the message names it)."""
        self._configure(
            strategy,
            timeout=timeout,
            verify=verify,
            per_worker_weights=per_worker_weights,
            wire_dtype=wire_dtype,
        )

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
        report (None when there was nothing to send, e.g. a context that
        holds no model because its workers build their policy from a
        factory: the workers then wait for the first ``send()``).

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
            sender = self._blocking_sender()
            sender.connect(worker_idx, timeout=wait)
            self._connected()
            report = None
            # Under per_worker_weights each worker starts from weights of its
            # own (its factory's policy) unless some are given here.
            initial = not self.per_worker_weights and self._holds_a_model()
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

    def __enter__(self) -> WeightSyncScheme:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Leaving ``with scheme:`` (by an exception too) calls :meth:`shutdown`."""
        self.shutdown()

    def shutdown(self) -> None:
        """Close this side's channels and release shared memory and the loop
        thread. Idempotent; safe on a scheme never initialised.

        A trainer that exits without calling it (an exception escaped,
        Ctrl-C) has its sender closed as the interpreter exits, before
        Python waits for child processes: its workers hear
        :class:`SenderClosedError` and can end.

        An async trainer may ``await get_async_sender().aclose()`` instead."""
        try:
            if self._async_sender is not None:
                self._blocking_sender().shutdown()
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
