"""The scheme for workers reached through ``torch.distributed``: on other
hosts, started by ``torchrun``, SLURM or any launcher."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch

from .._delta import check_delta, require_codec
from .._exceptions import (
    AckTimeoutError,
    InvalidWeightsError,
    WeightMismatchError,
    WeightSyncError,
    WeightSyncStateError,
    combine_worker_errors,
)
from .._facade import WeightSender
from .._frames import CHUNK_BYTES
from .._packing import Keys
from .._sender import DEFAULT_TIMEOUT, AsyncWeightSender, SendReport
from .._strategy import is_dtensor, values_of
from .._transports._base import SenderTransport, Staging
from .._transports._chain._delta_base import HISTORY
from ._base import EndpointFactory, SchemeConfig, StrategyName, WeightSyncScheme, _num_workers
from ._group_send import GroupSender

#: The smallest frame of a sender group's chains (bytes).
_MIN_GROUP_CHUNK = 512 << 10

if TYPE_CHECKING:
    from .._memory._segment import Segment
    from .._shards import Part, Want
    from .._transports._distributed._group import SenderGroup
    from .._transports._distributed._host_group import HostBuffer

__all__ = ["DistributedSchemeConfig", "DistributedWeightSyncScheme"]


def _holds_dtensors(model: Any) -> bool:
    """Whether ``model`` (a module, a TensorDict, a mapping) holds a DTensor."""
    return model is not None and any(is_dtensor(value) for value in values_of(model).values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedSchemeConfig(SchemeConfig):
    """The options of :class:`DistributedWeightSyncScheme`: those of every
    scheme, and ``backend``, ``sync``, ``share_on_host``,
    ``share_from_trainer``, ``delta``, ``delta_threads``, ``delta_history``
    (older versions the trainer keeps, each a buffer of the model's size
    while a worker holds it, so that a worker that fell behind gets a
    delta against the version it holds; 0: it gets the full bytes).

    :raises ValueError: a ``backend`` other than ``"gloo"``; a ``delta``
        other than True, False or ``"always"``; negative ``delta_threads``
        or ``delta_history``.
    :raises MissingExtraError: ``delta=True`` without the ``delta`` extra
        installed (the message names it).
    """

    backend: str = "gloo"
    sync: bool = True
    share_on_host: bool = True
    share_from_trainer: bool = True
    delta: bool | Literal["always"] = False
    delta_threads: int = 0
    delta_history: int = HISTORY

    def __post_init__(self) -> None:
        check_delta(self.delta, self.delta_threads, self.delta_history)
        if self.delta:
            require_codec()
        if self.backend == "nccl":
            raise ValueError(
                "DistributedWeightSyncScheme(backend='nccl') needs CUDA staging, which weightsync does not "
                "have (and cannot test): use backend='gloo', which sends the weights from CPU memory"
            )
        if self.backend != "gloo":
            raise ValueError(
                f"DistributedWeightSyncScheme supports backend='gloo' only, not {self.backend!r}"
            )
        super().__post_init__()


def _torchrun_store() -> tuple[str, int] | None:
    """The store of torchrun's agent, which it shares with the ranks it
    started (``TORCHELASTIC_USE_AGENT_STORE``), if this process is one."""
    env = os.environ
    if (
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and env.get("MASTER_ADDR")
        and env.get("MASTER_PORT")
    ):
        return env["MASTER_ADDR"], int(env["MASTER_PORT"])
    return None


def _address_towards(host: str, port: int) -> str:
    """This host's address on its route to ``host`` (the one a process
    there reaches it by). Sends nothing: connecting a UDP socket only
    looks the route up."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), port))
        return str(probe.getsockname()[0])


def _default_host() -> str:
    """The address workers reach the trainer by: ``MASTER_ADDR`` (as
    torchrun and SLURM scripts set it), else this host name's address."""
    host = os.environ.get("MASTER_ADDR")
    if host:
        return socket.gethostbyname(host)
    return socket.gethostbyname(socket.gethostname())


@dataclasses.dataclass(frozen=True)
class _GroupSetting:
    """What a sender group's rank keeps from init for its plan: the store
    (and its address), this rank's address, the workers, the trainer's
    process group."""

    store: Any
    address: tuple[str, int]
    host: str
    num_workers: int
    group: Any


def _plan_refusal(
    wants: dict[int, Want], ranks: list[int], parts: tuple[Part, ...], timeout: float, model_id: str | None
) -> tuple[str, Any] | None:
    """Why the plan cannot be made from what the workers said they hold
    (``wants``, of worker ranks ``ranks``): the kind of error and what it
    says, the same on every rank (or None: it can)."""
    from .._packet import Manifest
    from .._shards import pieces_misfit

    missing = [r for r in ranks if r not in wants]
    if missing:
        return (
            "missing",
            {
                r - 1: f"worker {r - 1} (model {model_id!r}) did not announce itself within {timeout:g} s: "
                f"rank {r} did not say what it holds (its init_on_worker did not reach the trainer's store)"
                for r in missing
            },
        )
    said = []
    for rank, want in sorted(wants.items()):
        why = pieces_misfit(Manifest.from_signature(want.signature), parts)
        if why is not None:
            said.append(f"worker {rank - 1}: {why}")
        strays = [m for m in want.members if m not in wants or wants[m].members != want.members]
        if strays:
            said.append(
                f"worker {rank - 1}: its tensor-parallel group {list(want.members)} (worker ranks) is not "
                f"this trainer's, or its members disagree on it (ranks {strays})"
            )
    if said:
        return ("WeightMismatchError", f"{'; '.join(said)}; nothing was sent")
    return None


class DistributedWeightSyncScheme(WeightSyncScheme):
    """Weights to workers on other hosts over ``torch.distributed`` (gloo),
    without Ray.

    ``backend``: ``"gloo"`` (the only one: ``"nccl"`` needs CUDA staging,
    which weightsync does not have). ``sync``: True, a worker applies an
    update only inside its ``receive()`` (a safe point); False, its
    ``connect()`` starts the background applier, which applies each update
    as it arrives, between two forward calls of the model (see
    :meth:`WeightReceiver.start_applier`). A worker inside a torchrl
    collector (``DistributedCollector``: the context given to
    ``init_on_worker`` is a collector, whose loop never calls
    ``receive()``) applies in the background whatever ``sync`` says. ``timeout``: the default deadline
    of a send and of each phase of ``connect()``, in seconds (torchrl's
    default is an hour; weightsync's, a minute).

    Sender (the trainer, rank 0): ``init_on_sender(model_id, num_workers=N,
    model=...)``; worker ``i`` (``send(worker_ids=i)``) is rank ``i + 1``.
    The scheme makes its own TCPStore on ``host`` (default: ``MASTER_ADDR``,
    else the address this host's name resolves to, which some systems map
    to a loopback address: pass ``host=`` there) and ``port`` (default: any
    free one), unless given ``store=`` (a ``torch.distributed.TCPStore``).
    :meth:`get_store_info` says where it is; a pickled scheme carries it to
    the workers.

    Under ``torchrun`` (``TORCHELASTIC_USE_AGENT_STORE=True`` in the
    environment), given neither ``store`` nor ``host``/``port``, both sides
    use torchrun's own store (``MASTER_ADDR:MASTER_PORT``), the trainer
    takes ``num_workers`` as ``WORLD_SIZE - 1`` and a worker its rank from
    ``RANK``: nothing needs to be passed from rank to rank. The trainer
    listens (for its workers' liveness connections and its end of the
    chain) on its own address on the route to the store.

    Worker: ``init_on_worker(model_id, model=..., worker_idx=rank)``, with
    its rank 1..N (the trainer is rank 0, as torchrl's distributed
    collectors number them; ``rank=`` also works, default ``RANK`` from the
    environment), on a copy of the
    scheme pickled after ``init_on_sender`` or given ``store_info=`` or
    ``store=``. It blocks until the trainer's store answers (up to
    ``timeout``), then a thread of the worker takes part in every send
    (see below) whatever the worker is doing; the update is written into
    its model only by ``receive()`` (or the background applier), one whole
    version at a time, and acked then. Every tensor keeps its identity and
    ``data_ptr()``.

    Each send's bytes go along a pipelined chain of the hosts of the send
    (gloo point-to-point, 1 MiB chunks, each passing every chunk on to the
    next as soon as it has it), so every NIC carries them about once:
    about S/B + (hosts - 1) x 1 MiB/B for S bytes over links of B bytes/s,
    where a star (torchrl's scheme, or a gloo ``broadcast``) takes workers x
    S/B. With ``share_on_host`` (the default), one worker of each host is in
    the chain and writes what it receives into shared memory (a ``memfd``,
    which nothing can leave behind), from which the host's other workers
    copy each part as it arrives: one local copy each, no loopback hop. On
    the trainer's own host the trainer leads (``share_from_trainer``, the
    default, without ``delta``): it stages each send in shared memory, and
    the workers there copy it from the trainer's buffer with no chain and
    no socket (``share_from_trainer=False``: one of them is in the chain,
    as on any host). A worker that cannot map it (another user's process)
    is put in the chain itself. With ``share_on_host=False`` every worker
    is in the chain, the workers of a host next to each other. Versions, acks and errors go over
    the store; a TCP connection per worker tells each side at once that the
    other's process ended.

    Errors are those of every scheme: a weight mismatch is refused before
    any worker is touched; a dead worker is a :class:`WorkerLostError`
    naming it (at once, not at the deadline), the others still get the
    update, and later sends form their chain without it; a stopped or
    unreachable worker is an :class:`AckTimeoutError` at the deadline; a
    worker that fails to apply is a :class:`WorkerApplyError` with its
    message. A worker that dies in the middle of a chain breaks it: the
    workers before it keep the update, and the trainer forms a new chain
    over the others (up to three chains per send, within its deadline).

    ``delta=True`` (the ``delta`` extra) sends what changed where that is
    expected to pay: each whole send may go as a lossless delta against
    the base, the last whole version sent and acked (held by the workers
    that acked it), encoded by the trainer's chain thread after staging
    (``send_async()`` still returns once the weights are staged), in 1 MiB
    chunks that each pick their encoding (unchanged, the gaps between
    changed elements and their differences, every element's difference,
    or raw when nothing is gained), pipelined with the chain. Each send
    is weighed first, from a sample of its chunks and the rates of recent
    sends: random weights, dense updates or a link faster than the codec
    go whole (:attr:`last_delta_choice` says why; ``delta="always"`` sends
    a delta whenever the workers hold a base). Each host leader passes
    the frames on as they came, rebuilds the version (on ``delta_threads``
    threads), checks each chunk against the trainer's digest before
    anything is published, and its followers copy the result. A worker without the
    base (new, restarted, one that missed a send, after a partial update,
    any doubt) or whose rebuild fails its check gets the full bytes in the
    same send, in a chain of its own: no worker ever holds weights other
    than the trainer's. Memory: the trainer keeps one more buffer of the
    model's size (the base); a worker keeps no more than its two receive
    buffers. A partial update is sent whole, and leaves the base as it was.
    """

    default_strategy = "tensordict"
    _config_class = DistributedSchemeConfig
    _config: DistributedSchemeConfig

    def __init__(
        self,
        backend: str = "gloo",
        sync: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        strategy: StrategyName | None = None,
        *,
        verify: bool = False,
        per_worker_weights: bool = False,
        share_on_host: bool = True,
        share_from_trainer: bool = True,
        wire_dtype: torch.dtype | None = None,
        delta: bool | Literal["always"] = False,
        delta_threads: int = 0,
        delta_history: int = HISTORY,
    ) -> None:
        """:raises ValueError: a ``backend`` other than ``"gloo"`` (``"nccl"``
        needs CUDA staging, which weightsync does not have and cannot test);
        a ``delta`` other than True, False or ``"always"``; negative
        ``delta_threads``.
        :raises MissingExtraError: ``delta=True`` without the ``delta``
            extra installed (the message names it)."""
        self._configure(
            strategy,
            timeout=timeout,
            verify=verify,
            per_worker_weights=per_worker_weights,
            wire_dtype=wire_dtype,
            backend=backend,
            sync=sync,
            share_on_host=share_on_host,
            share_from_trainer=share_from_trainer,
            delta=delta,
            delta_threads=delta_threads,
            delta_history=delta_history,
        )

    def _reset(self) -> None:
        super()._reset()
        # Where the trainer's store is, once init_on_sender made or found it.
        self._store_info: dict[str, Any] | None = None
        # A sharded trainer's rank: its part of the sender group; whether
        # this rank runs the group's store (made here, not torchrun's).
        self._group: SenderGroup | None = None
        self._owns_store = False
        self._group_setting: _GroupSetting | None = None
        # A sender group's rank, once the plan is made: per class of workers
        # it sends anything, its cut of this rank's part and its sender.
        self._class_senders: list[tuple[Part, WeightSender]] | None = None
        # A sender group's rank, once the plan is made: per class of workers
        # on the ranks' one host, the buffer it writes its part into (and,
        # on rank 0, the class's sender).
        self._host_buffers: list[HostBuffer] = []
        # A sender group's rank: its collective sends (get_sender()).
        self._group_sender: GroupSender | None = None
        # A tensor-parallel replica's first member: the store of its rounds.
        self._round_store: Any = None

    # Where the trainer's store is travels with the scheme, to the workers.
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["store_info"] = self._store_info
        return state

    # -- a sharded trainer: a sender group ------------------------------------------
    def _refuse_sharded(self, model: Any, side: str) -> None:
        """A trainer's DTensors are sent by every rank (a sender group); a
        worker's are its own boxes (a tensor-parallel worker), which it takes
        from a sender group (see :meth:`_want`)."""

    def get_sender(self) -> WeightSender | GroupSender:  # type: ignore[override]
        """As :meth:`WeightSyncScheme.get_sender`; on a sharded trainer's
        rank, its :class:`GroupSender`, whose ``send()``, ``send_async()``
        and ``wait_async()`` are collective (every rank calls them)."""
        if self._group_sender is not None:
            return self._group_sender
        return super().get_sender()

    def get_async_sender(self) -> AsyncWeightSender:
        """As :meth:`WeightSyncScheme.get_async_sender`.

        :raises WeightSyncStateError: on a sharded trainer's rank (see :meth:`get_sender`)."""
        self._refuse_in_group("get_async_sender()")
        return super().get_async_sender()

    def wait_for_workers(
        self, worker_ids: int | Iterable[int] | None = None, *, timeout: float | None = None
    ) -> dict[int, float]:
        """As :meth:`WeightSyncScheme.wait_for_workers`.

        :raises WeightSyncStateError: on a sharded trainer's rank, whose
            ``connect()`` waits for the workers (collectively)."""
        self._refuse_in_group("wait_for_workers()")
        return super().wait_for_workers(worker_ids, timeout=timeout)

    def remove_worker(self, worker_id: int) -> None:
        """As :meth:`WeightSyncScheme.remove_worker`.

        :raises WeightSyncStateError: on a sharded trainer's rank (its
            workers are fixed when its plan is made)."""
        self._refuse_in_group("remove_worker()")
        super().remove_worker(worker_id)

    def _refuse_in_group(self, call: str) -> None:
        if self._group is not None:
            raise WeightSyncStateError(
                f"{type(self).__name__}.{call}: this trainer is sharded, and every rank sends its own part "
                "of each version: call scheme.send() (and connect(), shutdown()) on every rank; a rank's "
                "sender alone would send its part only",
                model_id=self._model_id,
            )

    @property
    def group_rank(self) -> int | None:
        """This trainer rank's place in its sender group (None: not a sharded trainer)."""
        return None if self._group is None else self._group.rank

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._store_info = state["store_info"]

    # -- configuration (read-only) ------------------------------------------
    @property
    def backend(self) -> str:
        """``"gloo"`` (``config.backend``)."""
        return self._config.backend

    @property
    def sync(self) -> bool:
        """Whether a worker applies updates only in ``receive()`` (``config.sync``)."""
        return self._config.sync

    @property
    def share_on_host(self) -> bool:
        """Whether one worker per host is in the chain and feeds the others (``config.share_on_host``)."""
        return self._config.share_on_host

    @property
    def share_from_trainer(self) -> bool:
        """Whether the workers of the trainer's host copy each send from the
        trainer's staging buffer, with no chain (``config.share_from_trainer``;
        with ``share_on_host`` and no ``delta``)."""
        return self._config.share_from_trainer

    @property
    def delta(self) -> bool | Literal["always"]:
        """Whether each send's chain may carry a delta (``config.delta``)."""
        return self._config.delta

    @property
    def delta_threads(self) -> int:
        """The codec's threads, 0 for the default (``config.delta_threads``)."""
        return self._config.delta_threads

    @property
    def delta_history(self) -> int:
        """Older versions kept for workers that fell behind (``config.delta_history``)."""
        return self._config.delta_history

    def _chain_stagings(self) -> list[Any]:
        """The trainer's chain stagings: its one, or a sender group rank's
        one per class of workers (none on a worker)."""
        from .._transports._distributed._transport import ChainStaging

        if self._class_senders is not None:
            stagings = [sender.async_sender.staging for sender in self._group_senders()]
        else:
            stagings = [self.staging]
        return [staging for staging in stagings if isinstance(staging, ChainStaging)]

    @property
    def last_delta_choice(self) -> dict[str, Any]:
        """Why the trainer's last send went as a delta or whole (``delta=True``
        weighs each send), and of the last delta the encode and rebuild
        GB/s per core and their threads: ``{"delta": bool, "why": str,
        "rates": {...}}``; empty without ``delta`` and on a worker. (A
        sender group's rank: its first class of workers'.)"""
        choices = [staging.delta_choice for staging in self._chain_stagings()]
        return next((choice.summary() for choice in choices if choice is not None), {})

    @property
    def last_routes(self) -> list[tuple[tuple[int, ...], dict[int, tuple[int, ...]]]]:
        """How the trainer's last send went: for each chain it formed (a
        repair forms more than one; a sender group's rank one per class of
        workers), its ranks in chain order, and the ranks each host leader
        of it fed through shared memory. Empty on a worker and before the
        first send."""
        return [route for staging in self._chain_stagings() for route in staging.last_routes]

    @property
    def last_delta(self) -> list[bool]:
        """Per chain of the trainer's last send (as :attr:`last_routes`):
        whether it carried a delta (``delta=True``) or the full bytes."""
        return [delta for staging in self._chain_stagings() for delta in staging.last_delta]

    @property
    def last_wire_bytes(self) -> int:
        """The bytes the trainer put on its chains in its last send (the
        encoded frames with ``delta=True``); 0 on a worker."""
        return sum(staging.last_wire_bytes for staging in self._chain_stagings())

    def get_store_info(self) -> dict[str, Any] | None:
        """Where the trainer's store is: ``{"host": ..., "port": ...}``
        (after ``init_on_sender``; a pickled scheme carries it), or None."""
        return None if self._store_info is None else dict(self._store_info)

    # -- the trainer ------------------------------------------------------------
    def init_on_sender(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Initialise the trainer's side (rank 0); see the class docstring.
        Does not block: the workers are waited for by ``connect()`` or the
        first send.

        :raises RuntimeError: this scheme is already initialised here.
        :raises ValueError: no ``num_workers``.
        :raises OSError: the store or the liveness socket cannot listen on ``host``.
        """
        super().init_on_sender(model_id, context, **kwargs)

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], Staging | None]:

        from .._transports._chain._gloo import connect_store
        from .._transports._distributed._transport import (
            session_key,
        )

        group = kwargs.get("group")
        if group is not None or _holds_dtensors(self._model):
            return self._group_side(kwargs, group)
        if (
            "num_workers" not in kwargs
            and context is None
            and _torchrun_store()
            and "WORLD_SIZE" in os.environ
        ):
            kwargs = {**kwargs, "num_workers": int(os.environ["WORLD_SIZE"]) - 1}
        num_workers = _num_workers(context, kwargs)
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"{type(self).__name__}.init_on_sender needs num_workers=N (N >= 1)")
        store: Any = kwargs.get("store")
        if store is None and "host" not in kwargs and "port" not in kwargs and (found := _torchrun_store()):
            store = connect_store(*found, timeout=self.timeout)
        if store is not None:
            store_host = str(store.host)
            host = kwargs.get("host") or _address_towards(store_host, int(store.port))
        else:
            host = store_host = kwargs.get("host") or _default_host()
            store = self._make_store(host, int(kwargs.get("port", 0)))
        session, transports, staging = self._session(
            store, (store_host, int(store.port)), host, range(num_workers)
        )
        # Published last: a worker that sees the session finds the rest.
        store.set(session_key(self._model_id), session.encode())
        return transports, staging

    def _make_store(self, host: str, port: int) -> Any:
        """The trainer's own TCPStore on ``host``:``port`` (0: any free port)."""
        import datetime

        import torch.distributed as dist

        return dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout),
        )

    def _session(
        self, store: Any, store_address: tuple[str, int], host: str, worker_ids: Iterable[int], **chain: Any
    ) -> tuple[str, dict[int, SenderTransport], Any]:
        """A trainer's session in ``store`` (at ``store_address``): its
        liveness socket on ``host``, its staging and chain (``chain``: the
        chain's own options) and a transport per worker (``worker_ids``:
        worker i is rank i + 1); the session's name, which the caller
        publishes once all is up."""
        from .._transports._distributed._transport import (
            ChainStaging,
            DistributedSenderTransport,
            Liveness,
            session_prefix,
        )

        session = os.urandom(8).hex()
        prefix = session_prefix(self._model_id, session)
        liveness = Liveness(host)
        store.set(f"{prefix}live", pickle.dumps(liveness.address))
        self._store_info = {"host": store_address[0], "port": store_address[1]}
        staging = ChainStaging(
            self._model_id,
            store,
            store_address,
            prefix,
            liveness,
            share_on_host=self.share_on_host,
            share_from_trainer=self.share_from_trainer,
            delta=self.delta,
            delta_threads=self.delta_threads,
            delta_history=self.delta_history,
            **chain,
        )
        transports: dict[int, SenderTransport] = {
            i: DistributedSenderTransport(i + 1, i, staging, self._model_id) for i in worker_ids
        }
        return session, transports, staging

    def _group_side(
        self, kwargs: dict[str, Any], group: Any
    ) -> tuple[dict[int, SenderTransport], Staging | None]:
        """One rank of a sharded trainer: its store client, session, chain
        and part (see :class:`~.._transports._distributed._group.SenderGroup`).
        Collective over the trainer's ranks (``group``, default the world)."""

        import torch.distributed as dist

        from .._shards import parts_of
        from .._strategy import values_of
        from .._transports._chain._gloo import connect_store
        from .._transports._distributed._group import SenderGroup, new_gid

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                f"{type(self).__name__}: the trainer's weights are sharded (DTensors), so every trainer rank "
                "sends its own part: init_on_sender must be called on every rank of the trainer's process "
                "group (torch.distributed.init_process_group first, as torchrun's ranks do)"
            )
        if self._model is None or self.per_worker_weights:
            raise ValueError(
                f"{type(self).__name__}: a sharded trainer gives its model (model=...) to init_on_sender on "
                "every rank; per_worker_weights does not apply"
            )
        num_workers = kwargs.get("num_workers")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(
                f"{type(self).__name__}.init_on_sender of a sharded trainer needs num_workers=N (N >= 1): "
                "its workers are not ranks of the trainer's group"
            )
        group = group if group is not None else dist.group.WORLD
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = parts_of(values_of(self._model), size, model_id=self._model_id)
        store: Any = kwargs.get("store")
        if store is None and "host" not in kwargs and "port" not in kwargs and (found := _torchrun_store()):
            store = connect_store(*found, timeout=self.timeout)
        # Rank 0 makes the store unless one is shared, and a group id; every
        # rank learns both (one collective call).
        shared: list[Any] = [None]
        shared_store = store
        if rank == 0:
            if store is None:
                host = kwargs.get("host") or _default_host()
                store = self._make_store(host, int(kwargs.get("port", 0)))
            shared = [(str(store.host), int(store.port), new_gid())]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        store_host, port, gid = shared[0]
        self._owns_store = rank == 0 and shared_store is None
        if store is None:
            store = connect_store(store_host, port, timeout=self.timeout)
        host = _address_towards(store_host, port) if rank != 0 or "host" not in kwargs else kwargs["host"]
        self._group = SenderGroup(
            self._model_id, (store_host, port), gid, rank, size, parts, self.timeout, host
        )  # fmt: skip
        # (A scheme pickled after init_on_sender takes it to the workers.)
        self._store_info = {"host": store_host, "port": port}
        # What the plan (made at the first connect() or send, once every
        # worker said what it holds) needs: the store, this rank's address,
        # the workers, the trainer's group.
        self._group_setting = _GroupSetting(store, (store_host, port), host, num_workers, group)
        self._group_sender = GroupSender(self, self._group)
        if rank == 0:
            self._group.publish()
        # This rank's sends go through the senders of the plan (one per
        # class of workers), not the scheme's own, which has no worker.
        return {}, None

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
        """As :meth:`WeightSyncScheme.send`. On a sharded trainer (a sender
        group) it is collective: every rank calls it, each sends its own
        part of the weights (``weights``: this rank's state dict, DTensors
        as they are; None: the model given at init) to every worker, and
        every rank returns the same report or raises the same error, once
        every rank's send ended (within ``timeout`` and 2.5 s more). A worker
        applies the version only once every rank's part came (checked,
        with ``verify``): none holds a mix of two versions.

        :raises SenderGroupError: (sender group) a rank did not finish the
            send in time (it died, was stopped or interrupted), or raised;
            on every other rank, naming it.
        :raises WorkerError: as every send; in a sender group, the same on
            every rank.
        """
        if self._group is None:
            return super().send(
                weights, worker_ids, timeout=timeout, keys=keys, partial=partial, verify=verify, **unknown
            )
        assert self._group_sender is not None
        return self._group_sender.send(
            weights, worker_ids, timeout=timeout, keys=keys, partial=partial, verify=verify, **unknown
        )

    def _plan_group(self, until: float) -> None:
        """Make the plan (collective, once): rank 0 reads what every worker
        holds, waiting up to ``until`` (``time.monotonic()``); every rank
        then opens a session for each class of workers it sends anything
        (its part cut to their boxes), and rank 0 tells the workers.

        :raises WeightMismatchError: (on every rank alike) a worker's model
            does not fit the trainer's weights, or its group is not whole.
        :raises AckTimeoutError: (on every rank alike) workers that did not
            say what they hold in time, named.
        """
        import torch.distributed as dist

        from .._shards import classes_of, sub_part
        from .._transports._distributed._group import GroupPlan
        from .._transports._distributed._host_group import HostBuffer

        group, setting = self._group, self._group_setting
        assert group is not None and setting is not None
        ranks = list(range(1, setting.num_workers + 1))
        said: list[Any] = [None]
        if group.rank == 0:
            try:
                wants = group.wants(ranks, until)
                said = [(wants, _plan_refusal(wants, ranks, group.parts, self.timeout, self._model_id))]
            except Exception as exc:  # (the others hear it, and raise alike)
                said = [({}, ("WeightSyncError", f"{type(exc).__name__}: {exc}"))]
        dist.broadcast_object_list(said, src=dist.get_global_rank(setting.group, 0), group=setting.group)
        wants, refusal = said[0]
        if refusal is not None:
            kind, what = refusal
            if kind == "missing":
                raise combine_worker_errors(
                    {w: AckTimeoutError(m, worker_id=w, model_id=self._model_id) for w, m in what.items()},
                    model_id=self._model_id,
                    version=None,
                )
            if kind == "WeightMismatchError":
                raise WeightMismatchError(what, model_id=self._model_id)
            raise WeightSyncError(what, model_id=self._model_id)
        classes = classes_of(wants)
        shared = self._share_host(classes, wants)
        senders: list[tuple[Part, WeightSender]] = []
        buffers: list[HostBuffer] = []
        row: list[str | None] = []
        try:
            for index, (_, members) in enumerate(classes):
                sub = sub_part(group.part, wants[members[0]])
                if index in shared:
                    # Rank 0 sends the class all of it, from the buffer every rank writes.
                    segment, whole = shared[index]
                    shared_sender: WeightSender | None = None
                    if group.rank == 0:
                        session, shared_sender = self._class_sender(members, segment=segment)
                        row.append(session)
                    else:
                        row.append(None)
                    buffers.append(
                        HostBuffer(segment, whole, sub, wants[members[0]], group.size, shared_sender)
                    )
                    continue
                if not sub.pieces:
                    row.append(None)  # (nothing of this rank's part is theirs)
                    continue
                session, sender = self._class_sender(members)
                senders.append((sub, sender))
                row.append(session)
        except BaseException:
            for _, sender in senders:
                sender.shutdown()
            for buffer in buffers:
                if buffer.sender is not None:
                    buffer.sender.shutdown()
            for segment, _ in shared.values():
                segment.close()
            raise
        sessions: list[Any] = [None] * group.size
        dist.all_gather_object(sessions, tuple(row), group=setting.group)
        self._class_senders = senders
        self._host_buffers = buffers
        if group.rank == 0:
            one_part = tuple(index in shared for index in range(len(classes)))
            group.publish_plan(GroupPlan(classes, tuple(sessions), one_part))

    def _class_sender(self, members: tuple[int, ...], **chain: Any) -> tuple[str, WeightSender]:
        """A session of this rank's to the workers ``members`` (ranks) and
        its sender (``chain``: the staging's own options)."""
        group, setting = self._group, self._group_setting
        assert group is not None and setting is not None
        session, transports, staging = self._session(
            setting.store,
            setting.address,
            setting.host,
            [m - 1 for m in members],
            # Each rank's chain starts at another host: no NIC carries every part.
            rotate=group.rank,
            # The ranks' chains share every link: smaller frames than the
            # single sender's keep each chain's fill (a frame per hop) short.
            # (4 ranks, 64 MiB to 4 hosts at 1 Gbit/s: 1.32x S/B with 1 MiB
            # frames, 1.24-1.27x with 512 KiB, 1.26-1.34x with 256 KiB.)
            chunk=max(CHUNK_BYTES // group.size, _MIN_GROUP_CHUNK),
            **chain,
        )
        sender = WeightSender(
            AsyncWeightSender(
                model_id=self._model_id,
                strategy=self.strategy,
                transports=transports,
                staging=staging,
                context=None,
                timeout=self.timeout,
                verify=self.verify,
                wire_dtype=self.wire_dtype,
            )
        )
        return session, sender

    def _share_host(
        self, classes: tuple[tuple[Any, tuple[int, ...]], ...], wants: dict[int, Want]
    ) -> dict[int, tuple[Segment, Part]]:
        """(Collective, in the plan.) The classes whose workers and every
        trainer rank share one host, by index: each one's host buffer
        (rank 0's shared memory, mapped writable on every other rank) and
        all it takes as one part (:func:`~weightsync._shards.whole_part`).
        A class is shared only where every rank mapped its buffer, and the
        trainer shares memory with its host's workers at all
        (``share_from_trainer``, no ``delta``, no ``wire_dtype``: the ranks
        write the bytes as they are)."""
        import torch.distributed as dist

        from .._memory._segment import Segment
        from .._packet import Manifest
        from .._shards import part_signature, whole_part

        group, setting = self._group, self._group_setting
        assert group is not None and setting is not None
        hosts: list[Any] = [None] * group.size
        dist.all_gather_object(hosts, (setting.host, socket.gethostname()), group=setting.group)
        wholes: list[Part | None] = [None] * len(classes)
        if self.share_from_trainer and not self.delta and self.wire_dtype is None and len(set(hosts)) == 1:
            for index, (_, members) in enumerate(classes):
                if all(wants[m].host == hosts[0] for m in members):
                    wholes[index] = whole_part(group.parts, wants[members[0]])
        if not any(wholes):
            return {}
        mine: dict[int, Segment] = {}
        refs: list[Any] = [None]
        if group.rank == 0:
            for index, whole in enumerate(wholes):
                if whole is not None:
                    # (Out of memory or files: each rank sends its own part, as across hosts.)
                    with contextlib.suppress(Exception):
                        nbytes = Manifest.from_signature(part_signature(whole)).nbytes
                        mine[index] = Segment.create(nbytes)
            refs = [{index: segment.ref() for index, segment in mine.items()}]
        dist.broadcast_object_list(refs, src=dist.get_global_rank(setting.group, 0), group=setting.group)
        if group.rank != 0:
            for index, ref in refs[0].items():
                with contextlib.suppress(Exception):  # (not this user's, out of files: each sends its own)
                    mine[index] = Segment.attach(*ref, writable=True)
        mapped: list[Any] = [None] * group.size
        dist.all_gather_object(mapped, sorted(mine), group=setting.group)
        everywhere = set.intersection(*(set(indices) for indices in mapped))
        shared: dict[int, tuple[Segment, Part]] = {}
        for index, segment in mine.items():
            whole = wholes[index]
            if index in everywhere and whole is not None:
                shared[index] = (segment, whole)
            else:
                segment.close()
        return shared

    def _new_transport(self, worker_id: int, channel: Any, *, replaces: bool) -> SenderTransport:
        """No channel: the new worker is rank ``worker_id + 1`` of the store."""
        if self._group is not None:
            raise ValueError(
                f"{type(self).__name__}.add_worker: a sharded trainer's workers are given at init_on_sender "
                "(num_workers=N), on every rank"
            )
        from .._transports._distributed._transport import ChainStaging, DistributedSenderTransport

        staging = self.staging
        if channel is not None or not isinstance(staging, ChainStaging):
            raise ValueError(f"{type(self).__name__}.add_worker takes no channel: it finds a worker by rank")
        if replaces:
            raise ValueError(
                f"{type(self).__name__}.add_worker cannot bring back a worker under its old id; "
                "add it under a new one"
            )
        return DistributedSenderTransport(worker_id + 1, worker_id, staging, self._model_id)

    # -- a worker ---------------------------------------------------------------
    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> EndpointFactory:
        # The transport is imported here, where it is used: most programs
        # that import weightsync never use torch.distributed.
        from .._transports._distributed._group import PartsEndpoint, worker_endpoint

        rank = kwargs.get("rank", self._worker_idx)
        if rank is None and os.environ.get("RANK"):
            rank = int(os.environ["RANK"])
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(
                f"{type(self).__name__}.init_on_worker needs worker_idx=rank (1..num_workers; the trainer "
                f"is rank 0), got {rank!r}"
            )
        self._worker_idx = rank
        store = kwargs.get("store")
        info = kwargs.get("store_info") or self._store_info
        if store is None and info is None and (found := _torchrun_store()):
            info = {"host": found[0], "port": found[1]}
        if store is not None and hasattr(store, "host"):
            # A TCPStore: clients of weightsync's own (one per thread) to its address.
            info = {"host": store.host, "port": store.port}
            store = None
        if store is None and info is None:
            raise ValueError(
                f"{type(self).__name__}.init_on_worker needs where the trainer's store is: a scheme pickled "
                "after init_on_sender, store_info={'host': ..., 'port': ...}, or store=..."
            )
        address = None if info is None else (str(info["host"]), int(info["port"]))
        model_id, timeout = self._model_id, self.timeout
        # (Collective over a tensor-parallel worker's group: made now, at
        # the init every member of it calls.)
        want, rounds = self._want(rank, address)
        endpoint = worker_endpoint(model_id, rank, address, store, timeout, lambda: want, rounds)
        if want.boxes is not None and not isinstance(endpoint, PartsEndpoint):
            endpoint.close_now()
            raise InvalidWeightsError(
                f"{type(self).__name__}: this worker's model holds DTensors (its own shards: "
                f"{', '.join(name for name, _ in want.boxes[:3])}...), which it takes from a sharded trainer "
                "only, whose every rank sends its part (a sender group); this trainer sends from one "
                "process. Give the worker a model of whole tensors, or the trainer's ranks the sharded model",
                model_id=model_id,
            )
        return lambda receiver: endpoint

    def _want(self, rank: int, toward: tuple[str, int] | None) -> tuple[Want, tuple[str, int] | None]:
        """What this worker holds (its model's layout), and the workers that
        switch versions with it: for a tensor-parallel worker (DTensors over
        one 1-D mesh of its processes), every member's rank, gathered over
        the mesh's group (collective: each member calls ``init_on_worker``),
        and where the replica's rounds meet: a store that its first member
        runs, on its address towards the trainer's store (``toward``), so
        that the rounds never queue behind a send on the trainer's NIC.
        (None: no rounds, or, with no trainer's address, the trainer's store.)

        :raises InvalidWeightsError: DTensors over more than one mesh, or a
            mesh of more than one dimension.
        """
        from .._shards import Want, want_of
        from .._strategy import is_dtensor, values_of

        tensors = values_of(self._model)
        # (Where it runs: workers on the trainer ranks' one host take from one buffer.)
        where = None
        if toward is not None:
            with contextlib.suppress(OSError):
                where = (_address_towards(*toward), socket.gethostname())
        meshes = {id(t.device_mesh): t.device_mesh for t in tensors.values() if is_dtensor(t)}
        if not meshes:
            signature = tuple(
                sorted(
                    (name, str(t.dtype).removeprefix("torch."), tuple(int(n) for n in t.shape))
                    for name, t in tensors.items()
                )
            )
            return Want(signature, None, (rank,), where), None
        (mesh, *others) = meshes.values()
        if others or mesh.ndim != 1:
            raise InvalidWeightsError(
                f"{type(self).__name__}: a tensor-parallel worker's DTensors must all lie on one 1-D mesh "
                f"(its group's processes); this worker's lie on {len(meshes)} mesh(es) of "
                f"{sorted({m.ndim for m in meshes.values()})} dimension(s)",
                model_id=self._model_id,
            )
        import torch.distributed as dist

        index = mesh.get_local_rank()
        rounds = None
        if index == 0 and toward is not None:
            host = _address_towards(*toward)
            self._round_store = self._make_store(host, 0)
            rounds = (host, int(self._round_store.port))
        said: list[Any] = [None] * mesh.size()
        dist.all_gather_object(said, (rank, rounds), group=mesh.get_group())
        members = tuple(int(member) for member, _ in said)
        return dataclasses.replace(want_of(tensors, members, index), host=where), said[0][1]

    def shutdown(self) -> None:
        """As :meth:`WeightSyncScheme.shutdown`. A sharded trainer's rank
        that runs the store first waits (up to 3 s) for the other ranks'
        shutdown, so that none loses the store in the middle of a send."""
        group = self._group
        try:
            for sender in self._group_senders():
                sender.shutdown()
            for buffer in self._host_buffers:
                buffer.close()
        finally:
            if group is not None:
                group.close(owner=self._owns_store)
            super().shutdown()

    def _group_senders(self) -> list[WeightSender]:
        """A sender group's rank's senders: one per class it sends its own
        part to, and (rank 0) one per class on its host."""
        mine = [sender for _, sender in self._class_senders or ()]
        return mine + [buffer.sender for buffer in self._host_buffers if buffer.sender is not None]

    def _close_at_exit(self) -> None:
        for sender in self._group_senders():
            sender.close_at_exit()
        super()._close_at_exit()

    def connect(
        self,
        *,
        worker_idx: int | None = None,
        weights: Any = None,
        timeout: float | None = None,
        background: bool | None = None,
    ) -> SendReport | None:
        """As :meth:`WeightSyncScheme.connect`. On a worker, ``background``
        (None: chosen as below) says whether every later update is applied
        as it arrives, by the background applier, rather than by
        ``receive()``:

        - inside a torchrl collector (the context given at init is one, as
          in ``DistributedCollector``'s workers), always: the collector's
          loop never calls ``receive()``, whatever ``sync`` says;
        - else, with ``sync=False``; with ``sync=True`` the worker's own
          loop applies each update by calling ``receive()``.

        ``worker_idx`` on the sender is a worker id (rank - 1), as in
        ``send(worker_ids=...)``; on a worker it is ignored (the rank was
        given at init)."""
        if self._group is not None:
            # Every rank: its workers, then the first version, collectively.
            assert self._group_sender is not None
            report = self._group_sender._send(weights, timeout, connect=True)
            self._synchronized_on_sender = True
            return report
        if self._async_receiver is not None:
            worker_idx = None
        if background is None:
            background = not self.sync or self._loop_is_a_collectors()
        if background and self._in_a_replica():
            raise WeightSyncStateError(
                f"{type(self).__name__}.connect(): this worker is a member of a tensor-parallel replica, "
                "whose members switch versions together at receive() (every member at the same point of "
                "its loop); "
                "a background applier has no point shared by the members: use sync=True and call receive()",
                model_id=self._model_id,
            )
        return super().connect(worker_idx=worker_idx, weights=weights, timeout=timeout, background=background)

    def _in_a_replica(self) -> bool:
        """Whether this worker is a member of a tensor-parallel replica (of more than one)."""
        from .._transports._distributed._group import PartsEndpoint

        endpoint = self.receiver_transport
        return isinstance(endpoint, PartsEndpoint) and len(endpoint.want.members) > 1
