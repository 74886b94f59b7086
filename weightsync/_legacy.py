"""The legacy remote weight updaters: copy the trainer's weights straight into
buffers that workers read while they run.

:class:`MultiProcessedRemoteWeightUpdate` holds, per device (or worker id), the
``TensorDict`` that the workers on that device run on, typically
``TensorDict.from_module(policy).data.share_memory_()``. ``update_weights()``
copies the trainer's weights into those very tensors, in place.

What this updater does NOT guarantee: workers keep reading the shared buffer
while it is being overwritten. There is no version, no ack and no safe point,
so a worker that reads during an update can see a mix of old and new weights
(a torn read): some tensors already new, others still old, or even one tensor
half written. The update is also invisible to the trainer: it never learns
whether, or when, a worker saw it. Use it only where that is acceptable, e.g.
to keep old collector code running. For updates that a worker applies whole
at a point of its choosing, and acknowledges, use a scheme
(:class:`weightsync.MultiProcessWeightSyncScheme` and its siblings).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn

from ._copy import check_writable_in_place
from ._exceptions import InvalidWeightsError, UnknownWorkerError, WeightSyncStateError
from ._packet import Manifest
from ._strategy import flat_weights, model_tensors

if TYPE_CHECKING:
    from tensordict import TensorDictBase

__all__ = ["MultiProcessedRemoteWeightUpdate", "RemoteWeightUpdaterBase"]

# A string, so that tensordict is imported only by whoever builds a TensorDict.
Weights: TypeAlias = "TensorDictBase | nn.Module | Mapping[str, Any]"
"""What weights (and the workers' buffers) may be: a TensorDict, a module, or
a (nested) dict of tensors."""


class RemoteWeightUpdaterBase:
    """Base of the legacy updaters: push the trainer's weights to remote workers.

    The base holds the collector registration and the ``update_weights()``
    flow; a subclass says where weights come from and how they reach a
    worker by overriding the hooks :meth:`_get_server_weights`,
    :meth:`_maybe_map_weights`, :meth:`_sync_weights_with_worker` and
    :meth:`all_worker_ids` (and, to refuse bad weights before any worker is
    written, :meth:`_check_worker_weights`).

    The base gives no consistency guarantee of its own: see the module
    documentation.
    """

    def __init__(self) -> None:
        self._collector: Any = None

    # -- collector ----------------------------------------------------------

    def register_collector(self, collector: Any) -> None:
        """Register the collector that owns this updater.

        Once a collector is registered, the updater accepts no other. The
        updater holds a strong reference to it.

        :raises TypeError: ``collector`` is None.
        :raises WeightSyncStateError: (a ``RuntimeError``) a collector is
            already registered.
        """
        if collector is None:
            raise TypeError("register_collector() needs a collector, got None")
        if self._collector is not None:
            raise WeightSyncStateError(
                f"a collector ({type(self._collector).__name__}) is already registered with this "
                "updater; an updater serves one collector"
            )
        self._collector = collector

    @property
    def collector(self) -> Any:
        """The registered collector, or None before :meth:`register_collector`."""
        return self._collector

    # -- the update ---------------------------------------------------------

    def update_weights(self, weights: Weights | None = None, worker_ids: Any = None) -> None:
        """Push weights to the workers; blocks until every targeted worker's
        :meth:`_sync_weights_with_worker` has returned (for
        :class:`MultiProcessedRemoteWeightUpdate`: until every buffer has been
        written). It neither waits for nor hears from the workers themselves.

        ``weights`` None reads them from the server (:meth:`_get_server_weights`).
        Either way they go through :meth:`_maybe_map_weights`, whose result
        is what the workers get. ``worker_ids`` None targets every worker in
        :meth:`all_worker_ids`; a list (or tuple) targets those, each once,
        and an empty one does nothing; anything else is one worker id. Worker
        ids, then the weights (through :meth:`_check_worker_weights`), are
        checked for every target before the first one is written.

        :raises UnknownWorkerError: a worker id is not in :meth:`all_worker_ids`.
        :raises InvalidWeightsError: no weights were given and the server has
            none (no ``get_server_weights``), or the mapped weights are None
            or not tensors.
        :raises WeightMismatchError: (from :meth:`_check_worker_weights`) the
            weights do not match a targeted worker's buffer (names, shapes,
            dtypes); no worker was written.
        """
        targets = self._resolve_worker_ids(worker_ids)
        if not targets:
            return
        server_weights = self._get_server_weights() if weights is None else weights
        if server_weights is None:
            raise InvalidWeightsError(
                f"{type(self).__name__}.update_weights() was given no weights and the server has "
                "none to give (no get_server_weights callable, or it returned None)"
            )
        server_weights = self._maybe_map_weights(server_weights)
        if server_weights is None:
            raise InvalidWeightsError(f"{type(self).__name__}._maybe_map_weights() returned None")
        for worker_id in targets:
            self._check_worker_weights(worker_id, server_weights)
        for worker_id in targets:
            self._sync_weights_with_worker(worker_id, server_weights)

    def _resolve_worker_ids(self, worker_ids: Any) -> list[Any]:
        known = list(self.all_worker_ids())
        if worker_ids is None:
            return known
        wanted = list(worker_ids) if isinstance(worker_ids, list | tuple) else [worker_ids]
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise UnknownWorkerError(
                f"unknown worker id(s) {unknown!r}; this updater knows {known!r}", unknown_ids=tuple(unknown)
            )
        targets: list[Any] = []
        for w in wanted:  # each worker once, in the order asked
            if w not in targets:
                targets.append(w)
        return targets

    # -- hooks --------------------------------------------------------------

    def all_worker_ids(self) -> list[Any]:
        """Every worker id (device or process) this updater can reach."""
        raise NotImplementedError(f"{type(self).__name__} must implement all_worker_ids()")

    def _get_server_weights(self) -> Weights | None:
        """The latest weights of the server (trainer), or None if it has none."""
        raise NotImplementedError(f"{type(self).__name__} must implement _get_server_weights()")

    def _maybe_map_weights(self, server_weights: Weights) -> Weights:
        """Transform the server's weights before they are distributed; the
        result is what every worker gets."""
        raise NotImplementedError(f"{type(self).__name__} must implement _maybe_map_weights()")

    def _check_worker_weights(self, worker_id: Any, server_weights: Weights) -> None:
        """Raise if ``server_weights`` cannot be applied to ``worker_id``.

        Called for every target before any is written. The base accepts
        anything; override it to refuse bad weights up front.
        """

    def _sync_weights_with_worker(self, worker_id: Any, server_weights: Weights) -> None:
        """Deliver ``server_weights`` to one worker."""
        raise NotImplementedError(f"{type(self).__name__} must implement _sync_weights_with_worker()")


class MultiProcessedRemoteWeightUpdate(RemoteWeightUpdaterBase):
    """Update workers by copying weights into the shared buffers they run on.

    ``policy_weights`` maps each device (or worker id) to the buffer that the
    workers on it use: a ``TensorDict`` (typically
    ``TensorDict.from_module(policy).data.share_memory_()``), an ``nn.Module``
    or a dict of tensors. For workers in other processes to see an update the
    buffer must be in shared memory (or on a GPU the workers share).
    ``get_server_weights`` returns the trainer's current weights; None means
    the weights must be passed to :meth:`update_weights`.

    ``update_weights()`` writes into the buffers in place, while workers may
    be reading them: a worker can see a mix of old and new weights. See the
    module documentation; use a scheme where that matters.

    :raises TypeError: ``get_server_weights`` is not callable or None, or
        ``policy_weights`` is not a mapping.
    :raises InvalidWeightsError: a buffer is not a TensorDict, module or dict
        of tensors.
    """

    def __init__(
        self,
        get_server_weights: Callable[[], Weights | None] | None,
        policy_weights: Mapping[Any, Weights],
    ) -> None:
        super().__init__()
        if get_server_weights is not None and not callable(get_server_weights):
            raise TypeError(
                f"get_server_weights must be a callable or None, not {type(get_server_weights).__name__}"
            )
        if not isinstance(policy_weights, Mapping):
            raise TypeError(
                "policy_weights must map each device or worker id to its weights, "
                f"not {type(policy_weights).__name__}"
            )
        for buffer in policy_weights.values():
            model_tensors(buffer)  # fail now, not at the first update
        self.get_server_weights = get_server_weights
        # The set of workers is fixed at construction.
        self._policy_weights: dict[Any, Weights] = dict(policy_weights)

    @property
    def policy_weights(self) -> dict[Any, Weights]:
        """Each device or worker id, mapped to the buffer its workers run on."""
        return self._policy_weights

    def all_worker_ids(self) -> list[Any]:
        """The keys of ``policy_weights``, in their order."""
        return list(self._policy_weights)

    def _get_server_weights(self) -> Weights | None:
        """What ``get_server_weights()`` returns; None when there is no getter."""
        if self.get_server_weights is None:
            return None
        return self.get_server_weights()

    def _maybe_map_weights(self, server_weights: Weights) -> Weights:
        """Return ``server_weights`` unchanged: they fit the workers as they are."""
        return server_weights

    def _check_worker_weights(self, worker_id: Any, server_weights: Weights) -> None:
        """:raises WeightMismatchError: names, shapes or dtypes differ from
        the worker's buffer, or a buffer tensor cannot be written in place.
        :raises InvalidWeightsError: the weights are not dense tensors.

        A worker id without a buffer (a subclass that extends
        :meth:`all_worker_ids`) is left to that subclass's sync hook.
        """
        if worker_id in self._policy_weights:
            self._plan(worker_id, server_weights)

    def _sync_weights_with_worker(self, worker_id: Any, server_weights: Weights) -> None:
        """Copy ``server_weights`` into the worker's buffer, in place.

        Blocks until the copy is done. Every tensor of the buffer keeps its
        identity and storage. The copy is not atomic: a worker reading
        meanwhile can see part old, part new weights.

        :raises UnknownWorkerError: ``worker_id`` has no buffer.
        :raises WeightMismatchError: the weights do not match the buffer;
            nothing was written.
        """
        if worker_id not in self._policy_weights:
            raise UnknownWorkerError(
                f"worker {worker_id!r} has no buffer in policy_weights; known: {self.all_worker_ids()!r}",
                unknown_ids=(worker_id,),
            )
        targets, sources = self._plan(worker_id, server_weights)
        with torch.no_grad():
            torch._foreach_copy_(targets, sources)

    def _plan(self, worker_id: Any, server_weights: Weights) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The buffer's tensors and the matching weights, checked."""
        flat = flat_weights(server_weights)
        buffer = model_tensors(self._policy_weights[worker_id])
        where = f"the buffer of worker {worker_id!r}"
        sides = ("trainer", "buffer")
        Manifest.of(flat).check_matches(Manifest.of(buffer), model_id=None, where=where, sides=sides)
        check_writable_in_place(buffer.items(), where=f" in {where}")
        names = list(buffer)
        return [buffer[n] for n in names], [flat[n] for n in names]
