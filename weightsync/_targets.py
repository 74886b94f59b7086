"""A sender's workers: who they are, which a send targets, what each acked.

The one record of the last version each worker acked, for every transport:
the sender writes it once a send's acks are in, and membership changes
(a worker added, restarted or removed) forget what it knew of that worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._exceptions import UnknownWorkerError, WeightSyncStateError
from ._packet import Packet
from ._strategy import is_tensordict
from ._transports._base import SenderTransport

__all__ = ["Workers"]


class Workers:
    """The workers of one sender, by id, and what each acked."""

    def __init__(
        self, transports: Mapping[int, SenderTransport], model_id: str | None, per_worker_weights: bool
    ) -> None:
        #: Worker id -> the sender's channel to it (changed in place).
        self.transports: dict[int, SenderTransport] = dict(transports)
        self.model_id = model_id
        self.per_worker_weights = per_worker_weights
        # The last version each worker acked.
        self._acked: dict[int, int] = {}
        # The workers that may take a partial update: they acked a whole one,
        # and every send to them since.
        self._whole: set[int] = set()

    @property
    def devices(self) -> dict[int, tuple[str, ...] | None]:
        """The devices each worker's model is on, as it announced them
        (None: not yet, or its transport cannot tell), by worker id."""
        return {wid: t.devices for wid, t in self.transports.items()}

    @property
    def versions(self) -> dict[int, int | None]:
        """The last version each worker acked (None: none yet), by worker id."""
        return {wid: self._acked.get(wid) for wid in self.transports}

    def targets(self, worker_ids: int | Iterable[int] | None) -> list[int]:
        """The workers ``worker_ids`` names (None: all), each once, in order.

        :raises ValueError: it names none.
        :raises UnknownWorkerError: it names a worker that is not one.
        """
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

    def per_worker(self, weights: Any, worker_ids: int | Iterable[int] | None) -> dict[int, Any] | None:
        """``weights`` as {worker id: its weights} when it gives each worker
        its own (a mapping keyed by worker ids), else None.

        :raises ValueError: such a mapping without ``per_worker_weights=True``,
            or along with ``worker_ids``, or empty.
        :raises UnknownWorkerError: it names a worker that is not one.
        """
        if weights is None or is_tensordict(weights) or not isinstance(weights, Mapping):
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
        self.targets(list(weights))  # raises for an unknown id
        return dict(weights)

    def check_layouts(self, packet: Packet, reachable: list[int]) -> list[int]:
        """``reachable``, once ``packet`` fits the model of each of them.

        :raises WeightMismatchError: it does not fit one (nothing was sent).
        :raises WeightSyncStateError: a partial update, to a worker that has
            not applied a whole one (nothing was sent).
        """
        transports, layout_id = self.transports, packet.manifest.layout_id
        if not packet.partial:
            # A warm send: every worker known to hold this very layout (a
            # loop, not a comprehension: one frame less per send).
            for wid in reachable:
                layout = transports[wid].layout
                if layout is not None and layout.layout_id != layout_id:
                    break
            else:
                return reachable
        layouts = {wid: transports[wid].layout for wid in reachable}
        packet.manifest.check_workers(layouts, partial=packet.partial, model_id=self.model_id)
        behind = [w for w in reachable if w not in self._whole] if packet.partial else []
        if behind:
            raise WeightSyncStateError(
                f"a partial update of model {self.model_id!r} cannot go to worker(s) {behind}: they "
                "have not applied a whole update, or missed a send since; send them the whole model first",
                model_id=self.model_id,
            )
        return reachable

    def record(self, packet: Packet, reachable: list[int], failed: Iterable[int]) -> None:
        """Remember that the ``reachable`` workers but those that ``failed``
        acked ``packet``'s version."""
        failed = set(failed)
        for wid in reachable:
            if wid in failed:
                self._whole.discard(wid)
            else:
                self._acked[wid] = packet.version
                if not packet.partial:
                    self._whole.add(wid)

    def put(self, worker_id: int, transport: SenderTransport) -> SenderTransport | None:
        """Send to ``transport`` as worker ``worker_id`` from now on; the
        transport it replaces (a worker restarted under its old id), if any."""
        old = self.transports.get(worker_id)
        self.transports[worker_id] = transport
        self._forget(worker_id)
        return old

    def pop(self, worker_id: int) -> SenderTransport:
        """Stop sending to ``worker_id``; its transport.

        :raises UnknownWorkerError: no such worker.
        """
        self.targets(worker_id)  # raises for an unknown id
        self._forget(worker_id)
        return self.transports.pop(worker_id)

    def _forget(self, worker_id: int) -> None:
        self._acked.pop(worker_id, None)
        self._whole.discard(worker_id)
