"""The scheme for Ray actors: bytes through Ray's object store (and, across
hosts, the relay), updates applied on arrival. Ray is imported lazily."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch

from .._delta import check_delta, require_codec
from .._exceptions import WeightSyncStateError
from .._sender import DEFAULT_TIMEOUT, SendReport
from .._transports._base import SenderTransport, Staging
from .._transports._chain._delta_base import HISTORY
from ._base import EndpointFactory, SchemeConfig, StrategyName, WeightSyncScheme, _from

__all__ = ["RaySchemeConfig", "RayWeightSyncMixin", "RayWeightSyncScheme"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaySchemeConfig(SchemeConfig):
    """The options of :class:`RayWeightSyncScheme`: those of every scheme,
    and ``delta``, ``delta_threads``, ``delta_history``
    (older versions the trainer keeps, each a buffer of the model's size
    while a worker holds it, so that a worker that fell behind gets a
    delta against the version it holds; 0: it gets the full bytes).

    :raises MissingExtraError: ``delta=True`` without the ``delta`` extra
        installed (the message names it).
    :raises ValueError: a ``delta`` other than True, False or ``"always"``;
        negative ``delta_threads`` or ``delta_history``.
    """

    delta: bool | Literal["always"] = False
    delta_threads: int = 0
    delta_history: int = HISTORY

    def __post_init__(self) -> None:
        check_delta(self.delta, self.delta_threads, self.delta_history)
        if self.delta:
            require_codec()
        super().__post_init__()


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
    Default strategy: ``'tensordict'``, as torchrl's (whose ``RayCollector``
    extracts the weights itself with the scheme's ``strategy_str``).

    Across hosts (the targeted actors on two or more nodes besides the
    trainer's), each send travels along a pipelined chain of those nodes,
    one relay actor of weightsync's per node, which receives it into shared
    memory that the node's actors map and copy from (an actor that cannot
    map it reads the trainer's object from Ray's store). ``delta=True`` (the ``delta`` extra) makes that
    chain carry what changed where that is expected to pay: each whole
    send may go as a lossless delta against the base, the last whole
    relayed send that every actor of its send acked, encoded by the relay's
    thread after staging (``send_async()`` still returns once the weights
    are staged), in 1 MiB chunks that each pick their encoding, pipelined
    with the chain; each send is weighed first (random weights, dense
    updates or a link faster than the codec go whole;
    :attr:`last_delta_choice` says why, ``delta="always"`` skips the
    weighing; ``delta_threads`` sets the codec's threads). A
    node's relay actor keeps the last version it received whole and
    rebuilds the next one from it in place, checking each chunk against
    the trainer's digest before its actors read it. A node without the base
    (new, one that missed a send, after a partial update, any doubt) or
    whose rebuild fails its check gets the full bytes in the same send: no
    actor ever holds weights other than the trainer's. On one node (and
    for actors on the trainer's node) the bytes go through Ray's object
    store as they are: ``delta`` has no effect there. Memory: the trainer
    keeps two more buffers of the sent bytes' size (the base, and the send
    in flight), each relay actor one. A partial update is sent whole and
    leaves the base as it was. :attr:`last_delta` and
    :attr:`last_wire_bytes` say how the last send went.
    """

    default_strategy = "tensordict"
    _config_class = RaySchemeConfig
    _config: RaySchemeConfig
    # The sender finds a registered actor through Ray: nothing to announce,
    # and no event loop to enter, so this works inside an async actor's loop.
    _announces = False

    def __init__(
        self,
        strategy: StrategyName | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = False,
        per_worker_weights: bool = False,
        wire_dtype: torch.dtype | None = None,
        delta: bool | Literal["always"] = False,
        delta_threads: int = 0,
        delta_history: int = HISTORY,
    ) -> None:
        """:raises MissingExtraError: ``delta=True`` without the ``delta``
        extra installed (the message names it).
        :raises ValueError: a ``delta`` other than True, False or
            ``"always"``; negative ``delta_threads``.
        :raises ValueError: ``wire_dtype`` is not a floating dtype narrower than float32."""
        self._configure(
            strategy,
            timeout=timeout,
            verify=verify,
            per_worker_weights=per_worker_weights,
            wire_dtype=wire_dtype,
            delta=delta,
            delta_threads=delta_threads,
            delta_history=delta_history,
        )

    @property
    def delta(self) -> bool | Literal["always"]:
        """Whether the relay's chains may carry deltas (``config.delta``)."""
        return self._config.delta

    @property
    def delta_threads(self) -> int:
        """The codec's threads, 0 for the default (``config.delta_threads``)."""
        return self._config.delta_threads

    @property
    def delta_history(self) -> int:
        """Older versions kept for hosts that fell behind (``config.delta_history``)."""
        return self._config.delta_history

    @property
    def last_delta_choice(self) -> dict[str, Any]:
        """Why the relay's last send went as a delta or whole (``delta=True``
        weighs each send), and of the last delta the encode and rebuild
        GB/s per core and their threads: ``{"delta": bool, "why": str,
        "rates": {...}}``; empty without ``delta``, without the relay (one
        node), and on a worker."""
        from .._transports._ray._transport import RayStaging

        staging = self.staging
        relay = staging.relay if isinstance(staging, RayStaging) else None
        choice = None if relay is None else relay.delta_choice
        return {} if choice is None else choice.summary()

    @property
    def last_delta(self) -> list[bool]:
        """Per chain of the relay in the trainer's last send: whether it
        carried a delta (``delta=True``) or the full bytes. Empty when the
        send did not use the relay (one node), on a worker, and before the
        first send."""
        from .._transports._ray._transport import RayStaging

        staging = self.staging
        return staging.last_delta if isinstance(staging, RayStaging) else []

    @property
    def last_wire_bytes(self) -> int:
        """The bytes the trainer put on the relay's chains in its last send
        (the encoded frames with ``delta=True``); 0 when the send did not
        use the relay, and on a worker."""
        from .._transports._ray._transport import RayStaging

        staging = self.staging
        return staging.last_wire_bytes if isinstance(staging, RayStaging) else 0

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], Staging | None]:
        # The transport first: without Ray it raises the error naming the extra.
        from .._transports._ray._transport import RaySenderTransport, RayStaging, ray

        actors: Sequence[Any] | None = _from(context, kwargs, "remote_collectors")
        if actors is None or not list(actors):
            raise ValueError(
                f"{type(self).__name__}.init_on_sender needs remote_collectors=[actor, ...], one actor "
                f"handle per worker (at least one), got {actors!r}"
            )
        if not ray.is_initialized():
            # Otherwise the first send's ray.put would quietly start a new,
            # empty local Ray instance that none of the actors live in.
            raise WeightSyncStateError(
                f"{type(self).__name__}.init_on_sender: Ray is not initialised; call ray.init() "
                "(and create the actors) first",
                model_id=self._model_id,
            )
        staging = RayStaging(
            self._model_id,
            delta=self.delta,
            delta_threads=self.delta_threads,
            delta_history=self.delta_history,
        )
        transports: dict[int, SenderTransport] = {
            i: RaySenderTransport(actor, i, staging, self._model_id) for i, actor in enumerate(actors)
        }
        return transports, staging

    def init_on_sender(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Initialise the sender side; see the class docstring. Does not block.

        :raises RuntimeError: this scheme is already initialised here, or Ray
            is not initialised.
        :raises ValueError: no ``remote_collectors`` were given.
        :raises MissingExtraError: Ray is not installed (the ``ray`` extra).
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
        from .._transports._ray._transport import RaySenderTransport, RayStaging

        staging = self.staging
        if channel is None or not isinstance(staging, RayStaging):
            raise ValueError("RayWeightSyncScheme.add_worker needs the actor's handle")
        return RaySenderTransport(channel, worker_id, staging, self._model_id)

    def create_transport(self, actor: Any) -> SenderTransport:
        """Legacy: a sender channel to one Ray actor, sharing this scheme's
        object-store staging once ``init_on_sender`` has run."""
        from .._transports._ray._transport import RaySenderTransport, RayStaging

        staging = self.staging
        if not isinstance(staging, RayStaging):
            staging = RayStaging(
                self._model_id,
                delta=self.delta,
                delta_threads=self.delta_threads,
                delta_history=self.delta_history,
            )
        return RaySenderTransport(actor, len(self.sender_transports), staging, self._model_id)

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> EndpointFactory:
        from .._transports._ray._transport import RayEndpoint

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
        from .._transports._ray._transport import apply_on_actor

        return apply_on_actor(self, update)
