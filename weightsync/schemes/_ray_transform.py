"""The scheme for the module of a torchrl ``RayModuleTransform``: one Ray
actor, reached as :class:`RayWeightSyncScheme` reaches its actors (the bytes
through Ray's object store, the update applied between two of the actor's
method calls). Ray and torchrl are imported lazily."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._exceptions import AckTimeoutError, WorkerApplyError, WorkerLostError
from .._sender import DEFAULT_TIMEOUT, SendReport
from ._base import StrategyName
from ._ray import RaySchemeConfig, RayWeightSyncScheme

__all__ = ["RayModuleTransformScheme", "RayModuleTransformSchemeConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayModuleTransformSchemeConfig(RaySchemeConfig):
    """The options of :class:`RayModuleTransformScheme`: those of every
    scheme, and ``backend``.

    :raises ValueError: a ``backend`` other than ``"gloo"``.
    """

    backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.backend == "nccl":
            raise ValueError(
                "RayModuleTransformScheme(backend='nccl') needs CUDA staging, which weightsync does not "
                "have: use backend='gloo' (the weights travel from CPU memory through Ray's object store)"
            )
        if self.backend != "gloo":
            raise ValueError(f"RayModuleTransformScheme supports backend='gloo' only, not {self.backend!r}")
        super().__post_init__()


class RayModuleTransformScheme(RayWeightSyncScheme):
    """Weights to the module of a torchrl ``RayModuleTransform`` (a
    ``ModuleTransform`` running in a Ray actor), from the trainer or a
    collector: torchrl's scheme of the same name, with weightsync's
    guarantees.

    Made as torchrl's: ``RayModuleTransformScheme(strategy="tensordict",
    backend="gloo")``, then handed to the transform,
    ``RayModuleTransform(module=..., weight_sync_scheme=scheme)``, which
    calls :meth:`_set_transform`, :meth:`init_on_sender` and
    :meth:`connect`; pass the same scheme to a collector as
    ``weight_sync_schemes={"transform_module": scheme}`` and update with
    ``collector.update_policy_weights_(weights, model_id="transform_module")``
    (or ``scheme.send(weights)``). There is one worker, id 0: the
    transform's actor.

    ``backend``: ``"gloo"`` only, as a name; torchrl moves the bytes over a
    torch.distributed pair (the trainer rank 0, the actor rank 1), weightsync
    through Ray's object store as :class:`RayWeightSyncScheme` does (no
    process group, no port to open). ``"nccl"`` raises ``ValueError``.

    Sender: :meth:`init_on_sender` takes the actor from the transform
    (``_set_transform``, or ``ray_transform=``); ``model=`` (alias
    ``source_model=``), if given, is what ``send()`` reads when given no
    weights. Does not block. :meth:`connect` blocks until the actor
    initialised its side (torchrl's ``ModuleTransform`` does it in
    ``_init_weight_sync_scheme``, called here; another actor calls
    ``init_on_worker`` itself) and, when the sender holds a model, applied
    the initial weights; each phase within ``timeout``.

    Worker (the actor): ``init_on_receiver(model_id, context=transform)``
    updates the context's ``.module`` (or ``model=``) in place: every tensor
    keeps its identity and ``data_ptr()``. An update lands between two
    method calls of the actor, so never inside one of the transform's
    forward calls; ``receive()`` (torchrl's ``_receive_weights_scheme``)
    never waits: it returns the newest version applied since its last call.

    Each ``send()`` blocks until the actor applied that version and acked it
    (``SendReport.version``: 1, 2, ...), up to ``timeout``. Errors: a dead
    actor is a :class:`WorkerLostError` naming worker 0; an actor busy past
    the deadline an :class:`AckTimeoutError`; weights that do not fit the
    module a :class:`WeightMismatchError`, before anything moves.
    """

    _config_class = RayModuleTransformSchemeConfig
    _config: RayModuleTransformSchemeConfig

    def __init__(
        self,
        strategy: StrategyName = "tensordict",
        backend: str = "gloo",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        """:raises ValueError: a ``backend`` other than ``"gloo"``; a
        ``wire_dtype`` that is not a floating dtype narrower than float32.
        :raises MissingExtraError: ``verify=True`` without the ``verify``
            extra installed (the message names it)."""
        self._configure(strategy, timeout=timeout, verify=verify, wire_dtype=wire_dtype, backend=backend)

    def _reset(self) -> None:
        super()._reset()
        # The RayModuleTransform, on the sender: it belongs to this process
        # and never travels with the scheme.
        self._ray_transform: Any = None
        # Whether the actor's side was initialised by this sender's connect().
        self._actor_ready = False

    @property
    def backend(self) -> str:
        """``"gloo"`` (``config.backend``)."""
        return self._config.backend

    def _set_transform(self, ray_transform: Any) -> None:
        """Keep the ``RayModuleTransform`` whose actor is the worker (torchrl's
        transform calls it when given this scheme)."""
        self._ray_transform = ray_transform

    def _actor(self) -> Any:
        actor = getattr(self._ray_transform, "_actor", None)
        if actor is None:
            raise ValueError(
                "RayModuleTransformScheme.init_on_sender needs the transform: pass the scheme to "
                "RayModuleTransform(weight_sync_scheme=...), or give ray_transform=..."
            )
        return actor

    def init_on_sender(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Initialise the sender side; see the class docstring. Does not block.

        :raises RuntimeError: this scheme is already initialised here, or Ray
            is not initialised.
        :raises ValueError: no transform (``_set_transform`` or ``ray_transform=``).
        :raises MissingExtraError: Ray is not installed (the ``ray`` extra).
        """
        transform = kwargs.pop("ray_transform", None)
        if transform is not None:
            self._ray_transform = transform
        kwargs["remote_collectors"] = [self._actor()]
        super().init_on_sender(model_id, context, **kwargs)

    def init_on_receiver(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Initialise the actor's side: its model is ``model=``, else the
        context's ``.module`` (a ``ModuleTransform``), else as for every
        scheme. Does not block.

        :raises RuntimeError: this scheme is already initialised here.
        :raises ValueError: no model was found.
        """
        if kwargs.get("model") is None and getattr(context, "module", None) is not None:
            kwargs["model"] = context.module
        kwargs.setdefault("worker_idx", 0)
        super().init_on_receiver(model_id, context, **kwargs)

    def connect(
        self,
        *,
        worker_idx: int | None = None,
        weights: Any = None,
        timeout: float | None = None,
        background: bool = True,
    ) -> SendReport | None:
        """Sender: have the actor initialise its side (a ``ModuleTransform``'s
        ``_init_weight_sync_scheme``), then as :meth:`RayWeightSyncScheme.connect`.
        Worker: returns at once.

        :raises WorkerLostError: (sender) the actor died.
        :raises AckTimeoutError: (sender) the actor did not initialise within ``timeout``.
        :raises WorkerApplyError: (sender) the actor's initialisation raised.
        """
        wait = self.timeout if timeout is None else timeout
        if self._async_sender is not None and not self._actor_ready:
            self._init_actor(wait)
        return super().connect(worker_idx=worker_idx, weights=weights, timeout=wait, background=background)

    def _init_actor(self, timeout: float) -> None:
        """Run the actor's ``_init_weight_sync_scheme(scheme, model_id)`` (an
        actor without it registers its model itself) and wait for it."""
        from .._transports._ray._transport import ray

        actor = self._actor()
        if not hasattr(actor, "_init_weight_sync_scheme"):
            self._actor_ready = True
            return
        model_id = self._model_id
        try:
            ray.get(actor._init_weight_sync_scheme.remote(scheme=self, model_id=model_id), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise AckTimeoutError(
                f"worker 0 (model {model_id!r}): the transform's actor did not initialise its side within "
                f"{timeout:g} s",
                worker_id=0,
                model_id=model_id,
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerLostError(
                f"worker 0 (model {model_id!r}) is gone: the transform's Ray actor died "
                f"({type(exc).__name__})",
                worker_id=0,
                model_id=model_id,
            ) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            message = f"{type(cause).__name__}: {cause}"
            raise WorkerApplyError(
                f"worker 0 (model {model_id!r}) failed to initialise its side: {message}",
                worker_id=0,
                model_id=model_id,
                version=0,
                worker_message=message,
            ) from exc
        self._actor_ready = True
