"""The Ray transport: one object-store put per send, one actor call per worker.

Sender side: :class:`RayStaging` puts the packet's bytes into Ray's object
store once per send, as numpy byte arrays (Ray stores those without pickling
and hands them to actors on the same node as read-only views of shared
memory; actors on other nodes get one copy per node, pulled by Ray).
:class:`RaySenderTransport` then calls each actor through Ray's
``__ray_call__``, so the user's actor class needs no weightsync method or base
class (or through the method of ``RayWeightSyncMixin``, when the class has
it), and the call's result is the ack. The stored object is
``(header, arrays)``: the header (model id, sender token, version, layout,
copy threads) is the same for every actor, so each call carries only the
function and the object's reference.

Worker side: :class:`RayEndpoint`, built with the actor's receiver, registers
it under its ``model_id`` in this process (a push endpoint). The call from the
sender hands the receiver a :class:`RayUpdate`, which copies the bytes into
the model in place:

- on a plain actor, the call is one more method call, so it runs between the
  actor's other method calls;
- on an async actor, Ray runs ``__ray_call__`` on a thread of its own; the
  copy is handed to the actor's event loop, so it runs between two awaits of
  the actor's coroutines, never during one of its steps.

Replies travel as small tuples::

    ("ack", version)          applied (or a newer version was already there)
    ("error", version, msg)   not applied, and why (the model is untouched)
    ("absent", msg)           nothing registered under that model id
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ..._copy import byte_view, copy_tensors, usable_cores
from ..._digest import digests
from ..._exceptions import (
    SenderLostError,
    WeightMismatchError,
    WeightSyncStateError,
    WorkerApplyError,
    WorkerError,
    WorkerLostError,
    import_extra,
)
from ..._memory._pinned import PageLocks, pins, stage_from_device, staging_buffer
from ..._memory._placement import Placement
from ..._memory._views import LayoutViews
from ..._offload import inline_allowed
from ..._packet import Manifest, Packet, Signature
from .._base import Applier, Outgoing, SenderTransport, worker_failed, worker_lost
from .._chain._delta_base import HISTORY, DeltaSetting
from ._host_copy import HostCopy, HostCopyError, HostReader, UnmappedError
from ._relay import HostRelay, SendKind

# This module is imported only where Ray is used (schemes/_ray.py imports it
# inside the calls that need it), so Ray is imported here, with the error
# that names the extra when it is missing.
try:
    import ray
    import ray.exceptions
except ImportError:
    import_extra("ray", extra="ray", needed_by="RayWeightSyncScheme")
    raise

if TYPE_CHECKING:
    import numpy as np

__all__ = ["RayEndpoint", "RaySenderTransport", "RayStaging", "RayUpdate", "apply_on_actor"]

# How long connect() waits between asking an actor whether its model is
# registered yet (it doubles up to the maximum).
_CONNECT_POLL = (0.02, 0.5)


def _tensor_views(arrays: Sequence[np.ndarray], manifest: Manifest) -> list[torch.Tensor]:
    """Typed tensors over (read-only) byte arrays, in manifest order, without
    a copy."""
    with warnings.catch_warnings():
        # The arrays are read-only views of the object store; they are only
        # ever read from, which torch cannot know. (One filter per update:
        # entering catch_warnings costs microseconds.)
        warnings.simplefilter("ignore", UserWarning)
        flat = [torch.from_numpy(array) for array in arrays]
    return [t.view(spec.dtype).view(spec.shape) for t, spec in zip(flat, manifest.specs, strict=True)]


def _element_size(tensors: Sequence[torch.Tensor]) -> int:
    """The element size of the dtype that holds most of ``tensors``' bytes:
    a delta's byte planes are split by it."""
    share: dict[int, int] = {}
    for tensor in tensors:
        size = tensor.element_size()
        share[size] = share.get(size, 0) + tensor.numel() * size
    return max(share, key=lambda size: share[size]) if share else 1


class RayStaging:
    """Puts each send's bytes into the object store, once for all actors, and
    keeps the calls of the send in flight.

    When the actors live on two or more nodes besides the trainer's, the
    actors of those nodes are fed through a :class:`HostRelay` (a pipelined
    chain of the nodes, each getting the bytes once, into shared memory its
    actors map: ``_host_copy``); the trainer's node reads the trainer's
    object, as with one node.

    ``delta=True``: the relay's chain carries what changed since the last
    whole relayed send that its actors acked (see
    ``_ray_relay.RelayDelta``); the object store's own path (one node, or
    the trainer's) carries the bytes as ever."""

    def __init__(
        self,
        model_id: str | None,
        relay: bool = True,
        *,
        delta: DeltaSetting = False,
        delta_threads: int = 0,
        delta_history: int = HISTORY,
    ) -> None:
        self.model_id = model_id
        self.delta = delta
        self.delta_threads = delta_threads
        self.delta_history = delta_history
        self.ref: ray.ObjectRef | None = None
        self.header: tuple[Any, ...] = ()
        # Each actor's node (learned when it is connected: add_node), the
        # trainer's, whether the actors span two or more other nodes (None:
        # to be worked out again), and the relay (None: never, or not yet,
        # needed).
        self.node_of: dict[int, str] = {}
        self._node = ""
        self._spread: bool | None = None
        self._relay_allowed = relay
        self.relay: HostRelay | None = None
        # The actors of the current send whose call waits for their node's
        # copy, and the node copies (futures) once the chain started.
        self.deferred: set[int] = set()
        self._routes: dict[str, concurrent.futures.Future[Any]] | None = None
        self.version = 0
        # Names this sender's versions on the actors: a new sender (a
        # restarted trainer) starts again at version 1 and must not be
        # taken for an old, late one.
        self.token = os.urandom(8).hex()
        # The actor calls of the current send, and the replies collected
        # by wait_all(), by worker id.
        self.calls: dict[int, ray.ObjectRef] = {}
        self.replies: dict[int, Any] = {}
        self.failed: dict[int, ray.exceptions.RayError] = {}
        self._finished: set[int] = set()
        # Whether an actor the relay fed acked the current send (taken as
        # it ends: nothing of the send is held past it), and what a delta
        # needs to know of it.
        self._relay_acked = False
        self._kind: SendKind | None = None
        # Of a trainer on a GPU: the host buffer each send is copied into
        # before it is put (page-locked), and its views for the last layout.
        self._host: torch.Tensor | None = None
        self._host_views = LayoutViews()
        self._pins = PageLocks()

    @property
    def last_delta(self) -> list[bool]:
        """Per chain of the relay in the last send: whether it carried a
        delta (empty: the send did not use the relay)."""
        return self.relay.last_delta if self.relay is not None and self._routes else []

    @property
    def last_wire_bytes(self) -> int:
        """The bytes the trainer put on the relay's chains in the last send
        (0: the send did not use the relay)."""
        return self.relay.last_wire_bytes if self.relay is not None and self._routes else 0

    def _settle(self) -> None:
        """Before the next send: tell the relay whether an actor it fed in
        the current one acked it (a whole relayed send then becomes its
        base, held by the agents that say so; the others, which missed it,
        go on holding what they held)."""
        if self.relay is not None and self.version:
            self.relay.settle(self.version, self._relay_acked)

    def _on_host(self, packet: Packet) -> Sequence[torch.Tensor]:
        """``packet``'s tensors in host memory: as they are, or, where some
        are on a GPU, copied (on the caller's stream) into a buffer of the
        staging's, page-locked once for all sends of its size. Blocks for
        the copies."""
        if not pins(packet.devices):
            return packet.tensors
        manifest = packet.manifest
        if self._host is None or self._host.numel() < manifest.nbytes:
            self._host_views.forget()
            self._host = None
            self._host = staging_buffer(manifest.nbytes, packet.devices)
            self._pins.keep_only(self._host)  # (the smaller one it replaces is unregistered)
        views = self._host_views.of(self._host.data_ptr(), manifest, self._host)
        stage_from_device(self._pins, self._host, views, packet).wait()
        return views

    def _put(self, packet: Packet, model_id: str | None, digest: bool) -> tuple[int, ...] | None:
        self.ref = None  # (if the previous send was abandoned)
        tensors = self._on_host(packet)
        # The digests travel in the stored object's header: taken first, in
        # a pass of their own (ray.put's copy cannot digest as it goes).
        sums = digests(tensors, usable_cores()) if digest else None
        self._settle()
        self.calls, self.replies, self.failed, self._finished = {}, {}, {}, set()
        self._relay_acked = False
        threads = max(1, usable_cores() // packet.fanout)
        # Everything an actor needs is in the one stored object, the same for
        # all actors: each call then has just two arguments (the function
        # and this), and Ray's cost per call grows with each argument.
        header = (
            model_id,
            self.token,
            packet.version,
            packet.manifest.layout_id,
            threads,
            packet.subset,
            sums,
        )
        self.ref = ray.put((header, tuple(byte_view(t) for t in tensors)))
        self.header = header
        self.version = packet.version
        self.deferred, self._routes = set(), None
        if self.delta:
            self._kind = SendKind(packet.version, packet.subset is None, _element_size(packet.tensors))
        return sums

    def write(
        self, packet: Packet, digest: bool, placements: Mapping[int, Placement]
    ) -> tuple[int, ...] | None:
        # (A put is one memcpy into shared memory, which blocks.)
        return self._put(packet, self.model_id, digest)

    def descriptor(self, worker_id: int) -> ray.ObjectRef | None:
        """The object worker ``worker_id`` reads, or None when it waits for
        its node's copy from the relay (see :meth:`route`)."""
        assert self.ref is not None, "write() comes first"
        if self._relayed(worker_id):
            self.deferred.add(worker_id)
            return None
        return self.ref

    def add_node(self, worker_id: int, node: str) -> None:
        """Worker ``worker_id``'s actor runs on ``node``."""
        self.node_of[worker_id] = node
        self._spread = None

    def _relayed(self, worker_id: int) -> bool:
        if not self._relay_allowed:
            return False
        if not self._node:
            self._node = ray.get_runtime_context().get_node_id()
        node = self.node_of.get(worker_id)
        if node is None or node == self._node:
            return False
        if self._spread is None:  # once per change of membership, not per actor and send
            self._spread = len({n for n in self.node_of.values() if n != self._node}) >= 2
        return self._spread

    async def route(self, worker_id: int) -> Any:
        """What worker ``worker_id``'s apply call carries: its node's copy
        once the relay brought it (started by :meth:`handle_send`, for
        every deferred worker of the send), or the trainer's own object
        where the relay is not used or could not reach the node."""
        assert self.ref is not None, "write() comes first"
        future = (self._routes or {}).get(self.node_of[worker_id])
        if future is None:
            return self.ref
        routed = await asyncio.wrap_future(future)
        if isinstance(routed, HostCopy):
            # The actor maps its host's copy; the trainer's object rides
            # along, unresolved (inside a list), for an actor that cannot.
            return (self.header, routed, [self.ref])
        return routed

    def _start_routes(self, deadline: float) -> dict[str, concurrent.futures.Future[Any]]:
        """Start the relay for the deferred workers' nodes (once per send;
        never waits), until the send's ``deadline`` (``time.monotonic()``)."""
        if self._routes is None:
            assert self.ref is not None, "write() comes first"
            nodes = list(dict.fromkeys(self.node_of[w] for w in sorted(self.deferred)))
            if len(nodes) < 2:
                self._routes = {}
            else:
                if self.relay is None:
                    self.relay = HostRelay(
                        self.model_id,
                        delta=self.delta,
                        delta_threads=self.delta_threads,
                        delta_history=self.delta_history,
                    )
                self._routes = self.relay.start(self.ref, self.header, nodes, deadline, self._kind)
        return self._routes

    async def handle_send(self, send: Outgoing, channels: Mapping[int, SenderTransport]) -> None:
        """Call every actor of ``send``: at once where the trainer's object
        reaches it, once its node's copy is there where the relay feeds it;
        and gather their replies (see :class:`~._base.SendHandler`)."""
        assert self.ref is not None and self.version == send.packet.version, "write() comes first"
        version = send.packet.version
        links: dict[int, RaySenderTransport] = {}
        failed: set[int] = set()
        for wid in send.worker_ids:
            link = channels[wid]
            assert isinstance(link, RaySenderTransport)
            links[wid] = link
            if self._relayed(wid):
                self.deferred.add(wid)  # called once its node's copy is there
                continue
            try:
                # The ObjectRef is a top-level argument, so Ray resolves it on
                # the actor's node before the call runs: the actor sees numpy views.
                self.calls[wid] = link.apply_call(self.ref)
            except WorkerError as exc:
                send.fail(wid, exc)
                failed.add(wid)
                self.released(wid, version)
        if self.deferred:
            self._start_routes(send.deadline)  # the chain runs while the other actors' calls are waited for
        elif inline_allowed():
            self.wait_all(send.deadline)

        async def answer(wid: int, link: RaySenderTransport) -> None:
            try:
                if wid in self.deferred:
                    self.calls[wid] = link.apply_call(await self.route(wid))
                failure = self.failed.get(wid)
                if failure is not None:
                    raise link.error_of(failure, version) from failure
                reply = self.replies.get(wid)
                if reply is None:
                    reply = await link.result(self.calls[wid], version)
                link.check_reply(reply, version)
                send.ack(wid)
            except WorkerError as exc:
                send.fail(wid, exc)
            finally:
                self.released(wid, version)

        try:
            async with anyio.create_task_group() as group:
                for wid, link in links.items():
                    if wid not in failed:
                        group.start_soon(answer, wid, link)
        finally:
            # Every actor answered (or the deadline passed): the relay's chain
            # has nothing left to do for this send, and stops at its next step.
            if self.relay is not None:
                self.relay.end_send()
            self._relay_acked = bool(self.deferred & send.acked)
            if self._routes:
                assert self.relay is not None
                send.carried(self.relay.report())

    def why(self, worker_id: int) -> str | None:
        """Why the relay did not bring worker ``worker_id``'s node its copy
        of the current send (None: it did, or the worker is not relayed)."""
        if self.relay is None or worker_id not in self.deferred:
            return None
        return self.relay.why(self.node_of[worker_id])

    def wait_all(self, deadline: float) -> None:
        """Block until every call of the current send returned, or until the
        send's ``deadline`` (``time.monotonic()``), and collect each
        returned call's reply, or its error (:attr:`failed`).

        Only for a caller that is blocked anyway, and a send with no relayed
        actor: one ``ray.wait`` and one ``ray.get`` for all the actors cost
        far less than one asyncio future per actor, and a dead actor's call
        returns at once, so deaths are still seen promptly. (A relayed
        actor's call is made on this loop when its node's copy arrives:
        blocking the loop would hold it back until every call made so far
        returned. Measured, 64 MiB relayed to 5 hosts: each host's apply
        began only after the previous host's ended, about 20 ms each.)
        """
        pending = [w for w in self.calls if w not in self.replies and w not in self.failed]
        if not pending:
            return
        timeout = max(deadline - time.monotonic(), 0.0)
        refs = [self.calls[w] for w in pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
        done = set(ready)
        returned = [w for w in pending if self.calls[w] in done]
        try:
            values = ray.get([self.calls[w] for w in returned])
        except ray.exceptions.RayError:
            # One of them failed: look at each, so that the failure is its
            # own and every other reply still counts.
            for w in returned:
                try:
                    self.replies[w] = ray.get(self.calls[w])
                except ray.exceptions.RayError as exc:
                    self.failed[w] = exc
            return
        self.replies.update(zip(returned, values, strict=True))

    def released(self, worker_id: int, version: int = 0, holding: Any = None) -> None:
        """Worker ``worker_id`` is done with the current send (acked, failed
        or abandoned at the deadline). Once all are, the stored object is let
        go at once: Ray frees it asynchronously, and an object still held
        when the next send puts its own makes Ray take fresh memory for that
        one (measured: 16 MiB to one actor, 23.4 ms a send and +321 MiB
        resident, against 16.5 ms and +32 MiB when let go here)."""
        self._finished.add(worker_id)
        if self._finished >= self.calls.keys() | self.deferred:
            self.ref = None

    async def aclose(self) -> None:
        self.ref = None
        if self.relay is not None:
            relay, self.relay = self.relay, None
            await anyio.to_thread.run_sync(relay.close)
        self.calls, self.replies, self.failed, self._finished = {}, {}, {}, set()
        # (Each send's copies were waited for before its put.)
        self._pins.release()
        self._host = None
        self._host_views.forget()


class RaySenderTransport:
    """The sender's channel to one Ray actor."""

    def __init__(self, actor: Any, worker_id: int, staging: RayStaging, model_id: str | None) -> None:
        self.actor = actor
        self.worker_id = worker_id
        self.model_id = model_id
        self._staging = staging
        self.layout: Manifest | None = None
        self.devices: tuple[str, ...] | None = None
        #: (Its actor reads host memory: Ray's object store.)
        self.reach: tuple[str, ...] = ()
        # Whether the actor's class has RayWeightSyncMixin's method.
        self._has_method: bool | None = None
        self._closed = False

    def _lost(self, reason: str) -> WorkerLostError:
        why = self._staging.why(self.worker_id)
        return worker_lost(self.worker_id, self.model_id, f"{reason}; {why}" if why else reason)

    def why_late(self) -> str | None:
        return self._staging.why(self.worker_id)

    def _failed(self, version: int, message: str) -> WorkerApplyError:
        return worker_failed(self.worker_id, self.model_id, version, message)

    def _invoke(self, method: Any, *args: Any) -> ray.ObjectRef:
        """Start ``method.remote(*args)`` on the actor, without waiting."""
        if self._closed:
            raise self._lost("the sender shut down this channel")
        try:
            return method.remote(*args)
        except ray.exceptions.RayError as exc:
            raise self._lost(f"{type(exc).__name__}: {exc}") from exc

    def apply_call(self, payload: Any) -> ray.ObjectRef:
        """Start the actor's apply call of ``payload``, without waiting.

        :raises WorkerLostError: the actor cannot be called.
        """
        if self._has_method is None:
            # An actor handle lists the methods of its class.
            self._has_method = hasattr(self.actor, "weightsync_apply")
        if self._has_method:
            return self._invoke(self.actor.weightsync_apply, payload)
        return self._invoke(self.actor.__ray_call__, apply_on_actor, payload)

    async def result(self, ref: ray.ObjectRef, version: int) -> Any:
        """The call's result, with every Ray error turned into weightsync's."""
        try:
            return await asyncio.wrap_future(ref.future())
        except ray.exceptions.RayError as exc:
            raise self.error_of(exc, version) from exc

    def error_of(self, exc: ray.exceptions.RayError, version: int) -> WorkerLostError | WorkerApplyError:
        """weightsync's error for a Ray error of a call for ``version``."""
        if isinstance(exc, ray.exceptions.RayActorError):
            # The actor died, was killed, or cannot be reached.
            return self._lost(f"the Ray actor died ({type(exc).__name__}: {_first_line(exc)})")
        if isinstance(exc, ray.exceptions.RayTaskError):
            return self._failed(version, f"{type(exc.cause).__name__}: {exc.cause}")
        return self._failed(version, f"{type(exc).__name__}: {_first_line(exc)}")

    async def connect(self) -> Manifest | None:
        if self.layout is not None:
            return self.layout
        pause, most = _CONNECT_POLL
        while True:
            described = await self.result(
                self._invoke(self.actor.__ray_call__, _describe_on_actor, self.model_id), 0
            )
            if described is not None:
                signature, node, devices = described
                self._staging.add_node(self.worker_id, node)
                self.devices = tuple(devices)
                self.layout = Manifest.from_signature(signature)
                return self.layout
            # The actor exists but has not registered its model yet (its
            # init_on_worker has not run): ask again until the deadline.
            await anyio.sleep(pause)
            pause = min(pause * 2, most)

    def check_reply(self, reply: tuple[Any, ...], version: int) -> None:
        """Check the actor's reply to its apply call for ``version``.

        :raises WorkerApplyError: it failed to apply it.
        :raises WorkerLostError: its model is gone.
        """
        kind = reply[0]
        if kind == "ack":
            # The version applied, or a newer one of the same sender that
            # was already there (only a late call of an abandoned send can
            # find that).
            return
        if kind == "error":
            raise self._failed(version, reply[2])
        if kind == "absent":
            raise self._lost(reply[1])
        raise self._failed(version, f"unexpected reply {reply!r}")

    async def aclose(self) -> None:
        self._closed = True


def _in_async_actor() -> bool:
    """Whether this process is an async Ray actor (False when unsure)."""
    try:
        # Not public API: Ray has used it internally since 1.x. Should it go,
        # the check is skipped, never failed.
        worker = ray._private.worker.global_worker
        return bool(getattr(worker, "core_worker").current_actor_is_asyncio())  # noqa: B009
    except Exception:
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- the worker side -------------------------------------------------------

# The endpoints of this process (a Ray actor), by model id.
_ENDPOINTS: dict[str | None, RayEndpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()


def _describe_on_actor(actor: Any, model_id: str | None) -> tuple[Signature, str, tuple[str, ...]] | None:
    """Runs on the actor (through ``__ray_call__``): the layout of the model
    registered under ``model_id``, the actor's node and the model's devices,
    or None."""
    endpoint = _ENDPOINTS.get(model_id)
    if endpoint is None:
        return None
    return endpoint.signature, ray.get_runtime_context().get_node_id(), endpoint.devices


def apply_on_actor(actor: Any, update: tuple[Any, ...]) -> tuple[Any, ...]:
    """Runs on the actor (through ``__ray_call__``): apply one update to the
    model registered under its header's model id. ``update``: (header, byte
    arrays) from the object store, or (header, host copy, [the trainer's
    object]) for an actor fed by its host's relay agent."""
    model_id, sender, version, layout_id, threads, subset, digests = update[0]
    endpoint = _ENDPOINTS.get(model_id)
    if endpoint is None:
        return (
            "absent",
            f"no model {model_id!r} is registered in this actor: call "
            f"RayWeightSyncScheme.init_on_worker({model_id!r}, model=...) inside the actor",
        )

    def apply(arrays: Sequence[np.ndarray]) -> tuple[Any, ...]:
        return endpoint.run(sender, RayUpdate(version, layout_id, arrays, threads, subset, digests))

    if len(update) == 2:
        return apply(update[1])
    copy, (fallback,) = update[1], update[2]
    try:
        with endpoint.host.lease(copy) as arrays:
            return apply(arrays)
    except UnmappedError:
        # Not this host's memory after all, or not this user's: the object store.
        return apply(ray.get(fallback)[1])
    except HostCopyError as exc:
        # A late call of an abandoned send: the model is as it was.
        return ("error", version, f"version {version} was not applied: {exc}")


@dataclass(eq=False)
class RayUpdate:
    """An update that arrived as a call: its bytes are read-only arrays of
    Ray's object store, which never change once put."""

    version: int
    layout_id: str
    arrays: Sequence[np.ndarray]
    threads: int
    subset: Signature | None = None
    digests: tuple[int, ...] | None = None

    #: Each worker digests a verified update's bytes itself.
    checked_on_host = False

    def check_mapping(self, manifest: Manifest) -> str | None:
        return None

    def is_current(self) -> bool:
        return True

    def sources(self, manifest: Manifest) -> list[torch.Tensor]:
        return _tensor_views(self.arrays, manifest)

    def apply(self, model: Any, targets: list[torch.Tensor], manifest: Manifest) -> None:
        if len(self.arrays) != len(manifest.specs):
            raise WeightMismatchError(
                f"version {self.version} carries {len(self.arrays)} tensors, the model has "
                f"{len(manifest.specs)}"
            )
        copy_tensors(targets, _tensor_views(self.arrays, manifest), threads=self.threads)


class RayEndpoint:
    """A Ray actor's endpoint for one model: a push endpoint, which hands each
    update to ``receiver`` as it arrives.

    Built inside the actor, it registers itself at once, so the sender can
    ask for the model's layout. ``on_update``, if given, is called on the
    actor with each version right after it is applied.

    :raises WeightSyncStateError: built off the event loop of an async actor.
    """

    pushes = True

    def __init__(
        self, model_id: str | None, receiver: Applier, on_update: Callable[[int], Any] | None = None
    ) -> None:
        self.model_id = model_id
        self.on_update = on_update
        self._receiver = receiver
        # The newest (sender, version) applied.
        self._sender = ""
        self._version = 0
        self._closed = False
        # On an async actor, updates are applied on its event loop.
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
            if _in_async_actor():
                # Called off the loop of an async actor (a thread of the
                # user's, or ``__ray_call__``, which Ray runs on a thread of
                # its own): the actor's loop cannot be found from here, and
                # updates would be applied while its coroutines run.
                raise WeightSyncStateError(
                    "init_on_worker was called off the event loop of an async Ray actor; call it from "
                    "the actor's __init__ or one of its methods, which run on that loop",
                    model_id=model_id,
                ) from None
        self._loop_thread = threading.get_ident()
        #: This actor's mappings of its host's relayed copies (page-locked
        #: for a model on a GPU).
        self.host = HostReader()
        self.signature: Signature = receiver.manifest().signature
        self.devices: tuple[str, ...] = receiver.devices()
        self.host.pin = pins(self.devices)
        with _ENDPOINTS_LOCK:
            _ENDPOINTS[model_id] = self

    # -- called by the sender, through Ray ----------------------------------
    def run(self, sender: str, update: RayUpdate) -> tuple[Any, ...]:
        """Apply ``update`` of ``sender`` (a token naming the sending
        scheme); the reply for the sender."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread or loop.is_closed():
            return self._run(sender, update)
        done: concurrent.futures.Future[tuple[Any, ...]] = concurrent.futures.Future()

        def step() -> None:
            try:
                done.set_result(self._run(sender, update))
            except BaseException as exc:
                done.set_exception(exc)

        try:
            loop.call_soon_threadsafe(step)
        except RuntimeError:  # the loop closed meanwhile
            return self._run(sender, update)
        return done.result()

    def _run(self, sender: str, update: RayUpdate) -> tuple[Any, ...]:
        if self._closed:
            return ("absent", f"the receiver of model {self.model_id!r} on this actor is shut down")
        if sender == self._sender and update.version <= self._version:
            return ("ack", self._version)
        try:
            self._receiver.apply(update)
        except WeightMismatchError as exc:
            return ("error", update.version, str(exc))
        self._sender, self._version = sender, update.version
        if self.on_update is not None:
            try:
                self.on_update(update.version)
            except Exception as exc:
                return (
                    "error",
                    update.version,
                    f"version {update.version} was applied, but on_update raised {type(exc).__name__}: {exc}",
                )
        return ("ack", update.version)

    # -- the WorkerEndpoint interface ---------------------------------------------
    async def announce(self, manifest: Manifest, devices: tuple[str, ...]) -> None:
        """Nothing to send: the sender asks the actor (see ``connect``)."""
        self.signature, self.devices = manifest.signature, devices
        self.host.pin = pins(devices)

    async def next_update(self, timeout: float) -> None:
        """Never an update to pull (they are applied as they arrive); never waits.

        :raises SenderLostError: the endpoint is closed.
        """
        if self._closed:
            raise SenderLostError(f"the receiver of model {self.model_id!r} is shut down")
        return None

    async def reply(self, version: int, error: str | None = None) -> None:
        """Nothing to send: the reply is the result of the sender's call."""

    def take_ready(self) -> None:
        """Never an update to pull; a closed endpoint is reported by ``next_update``."""
        return None

    def try_reply(self, version: int, error: str | None = None) -> bool:
        return True  # nothing to send: the reply is the result of the sender's call

    def wait_ready(self, timeout: float) -> bool:
        return self._closed

    async def aclose(self) -> None:
        self._closed = True
        with _ENDPOINTS_LOCK:
            if _ENDPOINTS.get(self.model_id) is self:
                del _ENDPOINTS[self.model_id]
        self.host.close()
