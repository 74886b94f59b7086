"""The scheme for workers that are ``torch.distributed.rpc`` peers (torchrl's
``RPCCollector``): each update one RPC call carrying the whole packet,
applied by the worker between two forward calls of its model.
``torch.distributed.rpc`` is imported lazily."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._exceptions import WeightSyncStateError
from .._sender import SendReport
from .._transports._base import SenderTransport, Staging
from ._base import EndpointFactory, WeightSyncScheme, _from

__all__ = ["RPCWeightSyncScheme"]


class RPCWeightSyncScheme(WeightSyncScheme):
    """Weights to workers that are peers of a ``torch.distributed.rpc`` job:
    torchrl's scheme of the same name (the default of torchrl's
    ``RPCCollector``), with weightsync's guarantees.

    Made as torchrl's: ``RPCWeightSyncScheme(strategy="tensordict")``; pass
    it to ``RPCCollector(..., weight_sync_schemes={"policy": scheme})`` and
    update with ``collector.update_policy_weights_()``. Every process must
    have called ``rpc.init_rpc`` (torchrl's collector does); weightsync
    never starts or shuts down RPC.

    Sender: ``init_on_sender(model_id, workers=[peer, ...], model=...)``,
    worker ``i`` being ``workers[i]``: an RPC peer's name, rank or
    ``WorkerInfo``; a context with ``collector_infos`` (an
    ``RPCCollector``) works too. Does not block. Each send copies the
    weights once into one flat tensor, then makes one RPC call to each
    targeted worker carrying it (TensorPipe sends its bytes as they are, no
    tensor pickled); the call returns once the worker applied it, and its
    result is the ack.

    Worker: ``init_on_worker(model_id, model=...)`` (or a context holding
    the model, as torchrl's collectors pass themselves) registers the
    receiver in the worker's process, where the sender's calls find it.
    An update arrives on a thread of TensorPipe's and waits there for the
    worker: at ``receive()`` (its safe point), or, after :meth:`connect`
    (``background=True``, what torchrl's collectors call), the background
    applier takes it at once, between two forward calls of the model, never
    during one. Every tensor keeps its identity and ``data_ptr()``. The
    worker's ``connect()`` never waits for weights: torchrl initialises the
    scheme on each worker before the trainer's ``init_on_sender``.

    Each ``send()`` blocks until every targeted worker applied that version
    and acked it (``SendReport.version``: 1, 2, ...; an ack names the
    version it acknowledges), up to ``timeout``. Errors: a dead peer is a
    :class:`WorkerLostError` naming the worker (with its exit status or
    signal when it ran on the trainer's host), reported as soon as RPC
    sees its connection end; a worker that has not applied by the
    deadline (e.g. inside a long forward call), an :class:`AckTimeoutError`;
    weights that do not fit a worker's model, a :class:`WeightMismatchError`
    before anything moves. A worker's ``receive()`` raises
    :class:`SenderClosedError` once the trainer's ``shutdown()`` told it
    (while RPC still runs), :class:`SenderLostError` once a trainer on its
    host exited.
    """

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], Staging | None]:
        from .._transports._rpc._transport import RPCSenderTransport, RPCStaging, rpc_ready

        peers: Sequence[Any] | None = kwargs.get("workers")
        if peers is None:
            peers = _from(context, kwargs, "collector_infos")
        if peers is None or not list(peers):
            raise ValueError(
                "RPCWeightSyncScheme.init_on_sender needs workers=[peer, ...] (each an RPC peer's name, "
                f"rank or WorkerInfo; at least one), or a context with collector_infos; got {peers!r}"
            )
        peers = list(peers)
        num_workers = _from(context, kwargs, "num_workers")
        if num_workers is not None and num_workers != len(peers):
            raise ValueError(f"num_workers={num_workers} but {len(peers)} RPC peers were given")
        if not rpc_ready():
            raise WeightSyncStateError(
                "RPCWeightSyncScheme.init_on_sender: torch.distributed.rpc is not initialised in this "
                "process; call torch.distributed.rpc.init_rpc(...) first",
                model_id=self._model_id,
            )
        staging = RPCStaging(self._model_id)
        transports: dict[int, SenderTransport] = {
            i: RPCSenderTransport(peer, i, staging, self._model_id) for i, peer in enumerate(peers)
        }
        return transports, staging

    def _new_transport(self, worker_id: int, channel: Any, *, replaces: bool) -> SenderTransport:
        """``channel``: the new worker's RPC peer (name, rank or ``WorkerInfo``)."""
        from .._transports._rpc._transport import RPCSenderTransport, RPCStaging

        staging = self.staging
        if channel is None or not isinstance(staging, RPCStaging):
            raise ValueError("RPCWeightSyncScheme.add_worker needs the worker's RPC peer")
        return RPCSenderTransport(channel, worker_id, staging, self._model_id)

    def create_transport(self, peer: Any) -> SenderTransport:
        """Legacy: a sender channel to one RPC peer, sharing this scheme's
        staging once ``init_on_sender`` has run."""
        from .._transports._rpc._transport import RPCSenderTransport, RPCStaging

        staging = self.staging
        if not isinstance(staging, RPCStaging):
            staging = RPCStaging(self._model_id)
        return RPCSenderTransport(peer, len(self.sender_transports), staging, self._model_id)

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> EndpointFactory:
        from .._transports._rpc._endpoint import RPCEndpoint

        model_id = self._model_id
        return lambda receiver: RPCEndpoint(model_id)

    def connect(
        self,
        *,
        worker_idx: int | None = None,
        weights: Any = None,
        timeout: float | None = None,
        background: bool = True,
    ) -> SendReport | None:
        """Sender: as :meth:`WeightSyncScheme.connect` (wait for the workers
        to announce themselves, send the initial weights). Worker: returns
        at once, never waiting for weights (torchrl's ``RPCCollector``
        initialises each worker before its sender exists); with
        ``background=True`` every update from now on is applied as it
        arrives, between two forward calls of the model.

        :raises WorkerError: (sender) naming every worker that died, did not
            announce itself, or did not apply the initial weights in time.
        """
        if self._async_receiver is not None:
            if worker_idx is not None:
                self._worker_idx = worker_idx
            self._synchronized_on_receiver = True
            if background:
                self.get_receiver().start_applier()
            return None
        return super().connect(worker_idx=worker_idx, weights=weights, timeout=timeout)
