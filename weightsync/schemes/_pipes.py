"""The schemes over one pipe per worker, bytes through a staging of shared
memory: multiprocess (workers copy), shared (workers view) and in-process."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import torch

from .._send import refuse_options
from .._sender import DEFAULT_TIMEOUT, Keys, SendReport
from .._transports._base import SenderTransport, Staging
from .._transports._pipes._copy_staging import CopyReader, SegmentStaging
from .._transports._pipes._device_staging import PlacedReader, PlacedStaging
from .._transports._pipes._slot_staging import SlotReader, SlotStaging
from .._transports._pipes._transport import EncodedUpdates, PipeEndpoint, PipeSenderTransport
from ._base import EndpointFactory, SchemeConfig, StrategyName, WeightSyncScheme, _from, _num_workers

__all__ = [
    "InProcessWeightSyncScheme",
    "MultiProcessWeightSyncScheme",
    "PipeSchemeConfig",
    "SharedMemWeightSyncScheme",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipeSchemeConfig(SchemeConfig):
    """The options of the pipe schemes: those of every scheme, and ``sync``."""

    sync: bool = True


class _PipeScheme(WeightSyncScheme):
    """Control over one duplex pipe per worker; bytes through a staging
    (``_staging_class`` on the sender, ``_reader_class`` on each worker),
    and, for workers on GPUs of a trainer on a GPU, through a device slab
    (``_device_staging``).

    The pipes are the user's (``pipes=`` on the sender, ``pipe=`` on each
    worker), or the scheme's own: given a multiprocessing context (``ctx=``,
    as torchrl's collectors pass it) or no pipes at all, ``init_on_sender``
    makes one pipe per worker (``num_workers``), and the worker ends travel
    inside the pickled scheme to the workers, where ``worker_idx`` picks
    each one's end.
    """

    _config_class = PipeSchemeConfig
    _config: PipeSchemeConfig
    _staging_class: ClassVar[type[SegmentStaging] | type[SlotStaging]]
    # Whether workers on the trainer's GPU run on its slots (zero-copy)
    # rather than copy out of one slab.
    _device_slots: ClassVar[bool] = False
    _reader_class: ClassVar[type[CopyReader] | type[SlotReader]]
    #: Added to the error of a worker killed by SIGSEGV.
    _fault_hint: ClassVar[str | None] = None

    def __init__(
        self,
        strategy: StrategyName | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = False,
        per_worker_weights: bool = False,
        sync: bool = True,
        wire_dtype: torch.dtype | None = None,
        **unknown: Any,
    ) -> None:
        """``sync=False`` (as torchrl's schemes take it): :meth:`send` returns
        once the weights are staged, without waiting for the acks.

        :raises TypeError: an option this scheme does not take (``delta``:
            the message names the schemes that do)."""
        self._refuse_options(unknown)
        self._configure(
            strategy,
            timeout=timeout,
            verify=verify,
            per_worker_weights=per_worker_weights,
            wire_dtype=wire_dtype,
            sync=sync,
        )

    @property
    def sync(self) -> bool:
        """Whether :meth:`send` waits for the acks (``config.sync``)."""
        return self._config.sync

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
        """As :meth:`WeightSyncScheme.send`. Under ``sync=False`` it is
        ``get_sender().send_async(...)`` and returns None once the weights
        are staged (they may be changed then): the acks, and the errors, of
        that send are gathered by the next ``send()`` (which raises them
        before sending anything), by ``get_sender().wait_async()``, or by
        ``shutdown()`` (which ignores them)."""
        refuse_options(unknown, "send()")
        if self.sync:
            return super().send(
                weights, worker_ids, timeout=timeout, keys=keys, partial=partial, verify=verify
            )
        sender = self.get_sender()
        if sender.pending:
            sender.wait_async()
        sender.send_async(weights, worker_ids, timeout=timeout, keys=keys, partial=partial, verify=verify)
        return None

    def _reset(self) -> None:
        super()._reset()
        # The ends of the pipes this scheme made: the sender's, and the
        # workers' (held here until every worker has its own copy).
        self._own_pipes: list[Connection] = []
        self._worker_ends: dict[int, Connection] = {}
        # The update messages, encoded once per send for every worker.
        self._updates: EncodedUpdates | None = None

    # The worker ends of the pipes this scheme made travel with it, to the
    # workers (each keeps its own, by worker_idx).
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
        if not pipes:
            # Accepted, it would make a sender whose sends go to nobody.
            raise ValueError(
                f"{type(self).__name__}.init_on_sender got no workers (pipes=[]): give the trainer's end "
                "of one pipe per worker, pipes=[...] (each worker passing its end as "
                "init_on_worker(..., pipe=...)), or num_workers=N (N >= 1) for the scheme to make "
                "them (then hand this scheme to each worker after init_on_sender, and call "
                "init_on_worker(..., worker_idx=i) there)"
            )
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
        if self._updates is None:
            self._updates = EncodedUpdates()
        return PipeSenderTransport(
            pipe, worker_id, staging, self._model_id, fault_hint=self._fault_hint, updates=self._updates
        )

    def _connected(self) -> None:
        # Every worker has its end now: the sender's copies would only keep
        # a dead worker's pipe from closing.
        for end in self._worker_ends.values():
            end.close()
        self._worker_ends = {}

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], Staging | None]:
        staging = self._new_staging()
        pipes = self._sender_pipes(context, kwargs)
        transports: dict[int, SenderTransport] = {
            i: self._pipe_transport(pipe, i, staging) for i, pipe in enumerate(pipes)
        }
        return transports, staging

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> EndpointFactory:
        pipe = self._worker_pipe(context, kwargs)
        model_id, reader = self._model_id, PlacedReader(self._reader_class())
        return lambda receiver: PipeEndpoint(pipe, model_id, reader)

    def _new_staging(self) -> Staging:
        """The sender's staging: the scheme's host staging, and GPU memory
        for workers on GPUs when the trainer's tensors are on a GPU
        (``_device_staging``): a slab they copy out of, or the shared
        scheme's slots, which workers on their GPU run on."""
        return PlacedStaging(self._staging_class(), device_slots=self._device_slots)

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
        if staging is None:
            staging = self._new_staging()
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

    With the trainer's weights on a GPU, a worker whose parameters are on
    that same GPU runs on slots there (CUDA IPC; its own copy of the
    parameters is freed), and waits for its current stream before it acks,
    so that the slot it leaves is no longer read when the sender reuses it.
    Slots on a GPU cannot be made read-only: a worker that writes into its
    parameters there changes what every worker on that GPU runs on, without
    a fault. A slot on a GPU lives only as long as the trainer's process:
    once told that the sender shut down (``SenderClosedError``) a worker
    runs on a copy of its own; if that process dies instead, what such a
    worker runs on is undefined until its next ``receive()`` raises
    ``SenderLostError``. Workers on another GPU, or in host memory,
    copy (the first keep their ``data_ptr()``); ``SendReport.placements``
    says which placement each worker's send took.
    """

    default_strategy = "tensordict"
    _staging_class = SlotStaging
    _reader_class = SlotReader
    _device_slots = True
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
        wire_dtype: torch.dtype | None = None,
        **unknown: Any,
    ) -> None:
        self._refuse_options(unknown)
        super().__init__(
            strategy,
            timeout=timeout,
            verify=verify,
            per_worker_weights=per_worker_weights,
            wire_dtype=wire_dtype,
        )
        self._rendezvous = _Rendezvous()

    def __copy__(self) -> InProcessWeightSyncScheme:
        clone = type(self).__new__(type(self))
        clone._enter(self._config)
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
