"""The torch.distributed transport: bytes along the chain (``_chain``),
control over a TCPStore, liveness over one TCP connection per worker.

The trainer's :class:`ChainStaging` copies each send once and runs its
chain on a thread of its own (a ``ChainDriver`` over the workers of the
send, told by notices in the store: ``_dist_chain``, ``_dist_protocol``);
with ``share_on_host`` one worker of each host, its host leader, is in the
chain and feeds the host's other workers through shared memory
(``_host_share``); the workers of the trainer's own host copy from its
staging buffer, in shared memory then, with no chain. A worker's
:class:`ChainEndpoint` has a relay thread
(``_dist_relay``) that takes part in every send into one of two receive
buffers, never the one its receiver holds, so ``receive()`` copies one
whole version into the model at a safe point. Liveness (``_liveness``):
the kernel closes a worker's connection to the trainer when either process
ends, so a dead worker is named at once (:class:`WorkerLostError`), a
stopped one at the deadline (``AckTimeoutError``), each with where its
chain broke when one did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing.process
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import torch

from ..._copy import usable_cores
from ..._digest import copy_out, digests
from ..._exceptions import SenderLostError, WorkerError, WorkerLostError
from ..._frames import CHUNK_BYTES
from ..._memory._pinned import DeviceCopies, PageLocks, pins, stage_from_device, staging_buffer
from ..._memory._placement import Placement
from ..._memory._segment import BROKEN, Segment
from ..._memory._views import LayoutViews
from ..._packet import Manifest, Packet
from ..._readiness import wait_readable_any
from .._base import Outgoing, SenderTransport, worker_failed, worker_lost
from .._chain._delta_base import HISTORY, DeltaBase, DeltaChoice, DeltaSetting, element_size
from .._chain._driver import ChainDriver, EncodedSend
from .._chain._gloo import connect_store
from .._chain._pipeline import short_message
from .._peer import describe_exit, exit_status, started_here
from ._chain_control import WorkerChain
from ._liveness import Liveness, TrainerLink
from ._protocol import (
    CloseNotice,
    Hello,
    SendInfo,
    SessionKeys,
    decode,
    decode_replies,
    encode,
    encode_reply,
    get_now,
    session_key,
    session_prefix,
    wait_key,
)
from ._relay import ChainUpdate, WorkerRelay

__all__ = [
    "ChainEndpoint",
    "ChainStaging",
    "ChainUpdate",
    "DistributedSenderTransport",
    "Liveness",
    "session_key",
    "session_prefix",
]

# Poll intervals (seconds): the first, and the longest (they double).
_POLL = (0.0005, 0.005)
# How often a worker's waiter for its reply checks that the worker is alive (seconds).
_ALIVE_EVERY = 0.05
# How long a send whose workers all replied waits for its chain thread to end (seconds).
_CHAIN_END_WAIT = 0.05


@dataclasses.dataclass
class _Send:
    """The current send: what its workers are told, and once its chain
    started, its workers by rank (rank -> worker id)."""

    info: SendInfo
    ranks: dict[int, int] = dataclasses.field(default_factory=dict)


class ChainStaging:
    """The trainer's staged copy of each send (one flat buffer), the chain
    that carries it to the workers of the send (a :class:`ChainDriver` over
    a :class:`WorkerChain`), and what the transports share: the store, the
    liveness socket, the workers' hellos.

    It carries each send to all its workers at once (:meth:`handle_send`):
    the chain runs on a thread of its own, which never waits on the
    caller's loop, while the replies are read from the store.
    """

    def __init__(
        self,
        model_id: str | None,
        store: Any,
        store_address: tuple[str, int],
        prefix: str,
        liveness: Liveness,
        *,
        share_on_host: bool = True,
        share_from_trainer: bool = True,
        chunk: int = CHUNK_BYTES,
        delta: DeltaSetting = False,
        delta_threads: int = 0,
        delta_history: int = HISTORY,
        rotate: int = 0,
        segment: Segment | None = None,
    ) -> None:
        self.model_id = model_id
        self._share_from_trainer = share_on_host and share_from_trainer
        # A buffer given (``segment``: a sender group's host buffer, which
        # every rank of the group writes its part into, and this staging
        # sends from: its sends' tensors are views of it, so staging copies
        # nothing) is never replaced; it is closed with the staging.
        self._given = segment is not None
        # delta=True: the base (and older ones kept for workers that fell
        # behind), the whole version each worker acked last, by rank, and
        # the last send (its version, its workers by rank, whether it was
        # whole, who acked it).
        self._delta = DeltaBase.of(delta, chunk, delta_threads, delta_history)
        self._held: dict[int, int] = {}
        self._last: tuple[int, dict[int, int], bool, frozenset[int]] | None = None
        self.store = store
        self.prefix = prefix
        self.keys = SessionKeys(prefix)
        self.liveness = liveness
        self.workers = WorkerChain(self.keys, store_address, liveness, share_on_host, rotate)
        #: What each worker said of itself (its hello), by rank.
        self.members = self.workers.members
        self.driver: ChainDriver[int] = ChainDriver(self.workers, chunk=chunk)
        self._buffer: torch.Tensor | None = None if segment is None else segment.data
        # The buffer's shared memory, while the trainer feeds the workers of
        # its own host from it (share_on_host, no delta: a delta's base
        # takes turns with the buffer).
        self._segment: Segment | None = segment
        self._views = LayoutViews()
        # With the trainer's tensors on a GPU: the buffers kept page-locked
        # (the staging buffer and the delta base, which take turns), and the
        # current send's copies into the buffer, still running.
        self._pins = PageLocks()
        self._copies: DeviceCopies | None = None
        self._manifest: Manifest | None = None
        self._send: _Send | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # The replies read so far (by rank), of send version _replies_of;
        # the bytes of its replies key read; the waiter that polls it, and
        # the event that wakes the others when a reply came.
        self._replies_of: int | None = None
        self._replies: dict[int, str | None] = {}
        self._replies_read = 0
        self._looker: int | None = None
        self._came = anyio.Event()

    @property
    def last_routes(self) -> list[tuple[tuple[int, ...], dict[int, tuple[int, ...]]]]:
        """Per send: for each chain, its ranks in order and whom each host leader fed."""
        return [(route.chain, route.fed) for route in self.driver.routes]

    @property
    def last_wire_bytes(self) -> int:
        """The bytes the trainer put on the chains of the last send."""
        return self.driver.sent_bytes

    @property
    def last_delta(self) -> list[bool]:
        """Per chain of the last send: whether it carried a delta."""
        return [route.encoded is not None for route in self.driver.routes]

    @property
    def delta_choice(self) -> DeltaChoice | None:
        """``delta=True``: why the last send went as a delta or whole, and the
        rates measured (None: no delta)."""
        return None if self._delta is None else self._delta.choice

    def why(self, rank: int) -> str | None:
        """Why worker ``rank`` did not get the current send's bytes, if a chain said so."""
        return self.driver.why(rank)

    # -- staging ---------------------------------------------------------------
    def write(
        self, packet: Packet, digest: bool, placements: Mapping[int, Placement]
    ) -> tuple[int, ...] | None:
        # The previous send's chain may still be ending (within a stall
        # limit, when it was abandoned: interrupted, or past its deadline):
        # it reads the buffer. That send is over: its chain stops at its
        # next step.
        if self._thread is not None:
            self.driver.end_send()
            self._thread.join()
        self._thread = None
        # Its copies from the GPU are all in (a chain that broke did not
        # wait for every one) before the buffer is written again or adopted.
        self._settle_copies()
        manifest = packet.manifest
        self._keep_base(manifest.nbytes)
        shared = self._share_from_trainer and self._delta is None and self.workers.any_on_own_host()
        buffer = self._buffer
        if self._given:
            assert buffer is not None and buffer.numel() >= manifest.nbytes, "the plan sized it"
        elif buffer is None or buffer.numel() < manifest.nbytes or shared != (self._segment is not None):
            self._views.forget()
            self._buffer = None
            self._let_go_of_segment()
            if shared:
                self._segment = Segment.create(manifest.nbytes)
                self._buffer = self._segment.data
            else:
                self._buffer = staging_buffer(manifest.nbytes, packet.devices)
        assert self._buffer is not None
        views = self._views.of(self._buffer.data_ptr(), manifest, self._buffer)
        # (A buffer let go, or a base the encoder dropped, is unregistered.)
        self._pins.keep_only(self._buffer, None if self._delta is None else self._delta.memory)
        segment = self._segment
        if segment is not None:
            # A follower still copying the last version sees it overwritten.
            segment.begin_fill(packet.version)
        if self._given and any(
            v.data_ptr() != t.data_ptr() for v, t in zip(views, packet.tensors, strict=True)
        ):
            # (Views of the buffer at other places: a copy would overwrite
            # bytes it has yet to read.)
            raise RuntimeError("a send from a given buffer must be of views of it, as its manifest lays out")
        if pins(packet.devices):
            sums = self._from_device(views, packet, digest)
        else:
            sums = copy_out(views, packet.tensors, digest, usable_cores())
        if segment is not None and self._copies is None:
            segment.publish(packet.version)
        # (Still copying from a GPU: published on the chain's thread once in.)
        self.workers.lead = None if segment is None else segment.ref()
        threads = max(1, usable_cores() // packet.fanout)
        info = SendInfo(packet.version, manifest.layout_id, packet.subset, None, threads, manifest.nbytes, "")
        self._manifest = manifest
        self._send = _Send(info)
        self._forget_replies(packet.version)
        self.driver.forget()
        return sums

    def _from_device(self, views: list[torch.Tensor], packet: Packet, digest: bool) -> tuple[int, ...] | None:
        """Copy ``packet``'s tensors (some on a GPU) into ``views`` of the
        buffer, page-locked once for all sends (and the buffers that take
        turns with it as a delta's base), the copies enqueued on the
        caller's stream in chunks: a send's frames leave as their chunks
        are in (:attr:`_copies`). With ``digest``, the bytes are all in,
        then digested. Blocks for the registration of a new buffer, and
        for the copies only with ``digest``."""
        assert self._buffer is not None
        copies = stage_from_device(self._pins, self._buffer, views, packet)
        if not digest:
            self._copies = copies
            return None
        copies.wait()
        return digests(views, usable_cores())

    def _let_go_of_segment(self) -> None:
        """Close the buffer's segment, if it is in one (a follower that still
        maps it keeps the memory until it lets go)."""
        segment, self._segment = self._segment, None
        self.workers.lead = None
        if segment is not None:
            segment.close()

    def _settle_copies(self) -> None:
        copies, self._copies = self._copies, None
        if copies is not None:
            copies.settle()

    def _keep_base(self, nbytes: int) -> None:
        """Before the next send (of ``nbytes``) is staged: if the last one
        was whole and acked, its staged bytes become the delta base, held by
        the workers that acked it. Those that did not (dead, cut off, late)
        still hold what they held: the old base is kept for them (see
        :meth:`DeltaBase.adopt`), else they get the full bytes next. The
        next send is staged in memory the base let go of."""
        last, self._last = self._last, None
        delta, buffer = self._delta, self._buffer
        if delta is None or last is None or buffer is None or not delta.fits(nbytes):
            return
        version, ranks, whole, done = last
        holders = [rank for rank, wid in ranks.items() if wid in done]
        if not whole or not holders:
            return
        self._held.update(dict.fromkeys(holders, version))
        previous = delta.adopt(buffer[:nbytes], version, set(self._held.values()))
        self._buffer = None if previous is None else torch.from_numpy(previous)
        self._views.forget()

    def _forget_replies(self, version: int) -> None:
        """Drop the last send's replies (and its key, for a late one's sake:
        no reader is left for it); ``version``'s are read from now on."""
        if self._replies_of is not None and self.store is not None:
            with contextlib.suppress(RuntimeError):
                self.store.delete_key(self.keys.replies(self._replies_of))
        self._replies_of, self._replies, self._replies_read = version, {}, 0

    def descriptor(self, worker_id: int) -> None:
        """Nothing: each worker is told where its bytes come from by its notice."""
        return None

    def released(self, worker_id: int, version: int, holding: Any) -> None:
        """Nothing to do: each worker holds copies of its own."""

    # -- one send ----------------------------------------------------------------
    async def handle_send(self, send: Outgoing, channels: Mapping[int, SenderTransport]) -> None:
        """Start the chain of ``send`` over its workers that are alive, and
        gather their replies (see :class:`~._base.SendHandler`)."""
        current = self._send
        assert current is not None and not current.ranks, "write() comes first, once per send"
        links: dict[int, DistributedSenderTransport] = {}
        for wid in send.worker_ids:
            link = channels[wid]
            assert isinstance(link, DistributedSenderTransport)
            try:
                link.check_alive()
            except WorkerError as exc:
                send.fail(wid, exc)
                continue
            links[wid] = link
        if send.packet.digests is not None:
            current.info = dataclasses.replace(current.info, digests=send.packet.digests)
        current.ranks = {link.rank: wid for wid, link in links.items()}
        self._start(send)

        async def answer(wid: int, link: DistributedSenderTransport) -> None:
            try:
                await link.reply(send.packet.version)
                send.ack(wid)
            except WorkerError as exc:
                send.fail(wid, exc)

        try:
            async with anyio.create_task_group() as group:
                for wid, link in links.items():
                    group.start_soon(answer, wid, link)
        finally:
            # Every worker answered (or the deadline passed): the chain has
            # nothing left to do for this send.
            self.driver.end_send()
            if self._delta is not None and current.ranks:
                # (Who acked it, taken as it ends: nothing of the send is held past it.)
                whole = current.info.subset is None
                self._last = (current.info.version, dict(current.ranks), whole, send.acked)
            send.carried(self.driver.report(None if self._delta is None else self._delta.choice))

    def _start(self, outgoing: Outgoing) -> None:
        """Start the chain of the current send over its workers (never
        waits), until ``outgoing.deadline`` (``time.monotonic()``)."""
        deadline = outgoing.deadline
        send = self._send
        if send is None or not send.ranks:
            return
        assert self._buffer is not None
        self.workers.info = send.info
        source = self._buffer[: send.info.nbytes]
        ranks = sorted(send.ranks)
        held: dict[int, int] | None = None
        if self._delta is not None:
            whole = send.info.subset is None
            manifest = self._manifest
            if whole and manifest is not None:
                if not self._delta.fit(manifest.nbytes, element_size(manifest)):
                    self._held = {}  # a new layout: the encoder starts again
                elif any(rank in self._held for rank in ranks):
                    held = {rank: self._held[rank] for rank in ranks if rank in self._held}
        self._thread = threading.Thread(
            target=self._chain, args=(source, ranks, deadline, held, self._copies), daemon=True,
            name=f"weightsync-chain-{self.model_id}",
        )  # fmt: skip
        self._thread.start()

    def _chain(
        self,
        source: torch.Tensor,
        ranks: list[int],
        deadline: float,
        held: dict[int, int] | None,
        copies: DeviceCopies | None,
    ) -> None:
        """The chain thread of one send: with ``delta=True``, whether it goes
        as a delta to the workers that hold the base, and to those ``held``
        says fell behind (samples of it are encoded here), then the
        chains, then what they measured for the next send's choice.
        ``copies``: the copies from the GPU still running into ``source``;
        each frame of the bytes leaves once its chunk is in."""
        delta = self._delta
        encoded: list[EncodedSend] = []
        # The members are told once the first frame is in (all of it, to
        # encode a delta): the caller's work enqueued before the send runs
        # first, and may take longer than a member waits for its first frame.
        first = source.numel() if delta is not None and held is not None else self.driver.chunk
        staged = copies is None or _in_time(copies, first, deadline)
        segment, send = self._segment, self._send
        if segment is not None and copies is not None and send is not None:
            # The trainer's followers copy once the whole send is in: a copy
            # from the GPU is much shorter than any chain's first frame.
            if _in_time(copies, source.numel(), deadline):
                segment.publish(send.info.version)
            else:
                segment.filled_to(BROKEN)
        if delta is not None:
            delta.choice.behind = {}
            if held is None:
                delta.choice.went, delta.choice.why = False, "full bytes: no worker of the send holds a base"
            elif not staged:
                delta.choice.went, delta.choice.why = False, "full bytes: its copy from the GPU was late"
            else:
                with contextlib.suppress(Exception):  # any doubt: the full bytes
                    encoded = delta.chains(source, held)
        self.driver.run([source], ranks, deadline, encoded, None if copies is None else copies.wait_for)
        if delta is not None:
            delta.observe(self.driver.routes, list(self.driver.rebuilds.values()))

    # -- replies -----------------------------------------------------------------
    async def reply_of(self, rank: int, version: int, check_alive: Callable[[], None]) -> str | None:
        """Worker ``rank``'s reply to ``version``: None (it applied it) or
        why it did not. Waits for it, under the caller's cancel scope.

        The replies of a send are read together: one waiter at a time (the
        looker) polls the send's one ``replies`` key and wakes the others
        when one comes, so a send to many workers costs the store one look
        per poll, not one per worker (and the loop one wakeup). Every
        waiter calls ``check_alive`` at least every
        :data:`_ALIVE_EVERY` seconds, which raises for a worker that is gone.
        """
        assert version == self._replies_of, "write() of this version comes first"
        delay = _POLL[0]
        try:
            while True:
                if rank in self._replies:
                    await self._chain_ending()
                    return self._replies[rank]
                check_alive()
                if self._looker is None:
                    self._looker = rank
                if self._looker == rank:
                    if self._look():
                        delay = _POLL[0]
                        continue
                    await anyio.sleep(delay)
                    delay = min(delay * 2, _POLL[1])
                else:
                    with anyio.move_on_after(_ALIVE_EVERY):
                        await self._came.wait()
        finally:
            if self._looker == rank:
                # Another waiter looks from now on.
                self._looker = None
                self._wake()

    async def _chain_ending(self) -> None:
        """Once every worker of the send replied, wait (up to
        :data:`_CHAIN_END_WAIT` s) for the send's chain thread to end: each
        reported its chain before it applied, so the thread ends at its
        next poll, and no thread of a send then outlives the send."""
        send, thread = self._send, self._thread
        if send is None or thread is None or not send.ranks.keys() <= self._replies.keys():
            return
        with anyio.move_on_after(_CHAIN_END_WAIT):
            while thread.is_alive():
                await anyio.sleep(0.001)

    def _look(self) -> bool:
        """Read the replies to the current send that came since the last
        look; whether any did (the waiters are then woken)."""
        store, version = self.store, self._replies_of
        if store is None or version is None:
            return False
        key = self.keys.replies(version)
        if not store.check([key]):
            return False
        data = bytes(store.get(key))
        if len(data) <= self._replies_read:
            return False
        self._replies.update(decode_replies(data[self._replies_read :]))
        self._replies_read = len(data)
        self._wake()
        return True

    def _wake(self) -> None:
        self._came.set()
        self._came = anyio.Event()

    def forget(self, rank: int, nonce: int | None) -> None:
        """Worker ``rank`` is removed, or the trainer closes: nothing of it
        is kept (the version it held, its liveness connection)."""
        self._held.pop(rank, None)
        if nonce is not None:
            self.liveness.forget(rank, nonce)

    def notify(self, rank: int, notice: CloseNotice) -> str:
        """Leave ``notice`` for worker ``rank``; its key."""
        return self.workers.notify(rank, notice)

    async def aclose(self) -> None:
        """Stop the chain, close the liveness socket (every worker hears the
        trainer gone) and let go of the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.driver.close()
        thread = self._thread
        if thread is not None:
            # A chain ends within a stall limit (at most 5 s) once closed.
            with anyio.CancelScope(shield=True):
                while thread.is_alive():
                    await anyio.sleep(0.01)
        self._thread = None
        self.driver.drop()
        self.liveness.close()
        self._settle_copies()
        self._pins.release()
        self._buffer = None
        self._let_go_of_segment()
        self._views.forget()
        self.workers.close()
        self.store = None


def _in_time(copies: DeviceCopies, nbytes: int, deadline: float) -> bool:
    """Whether the first ``nbytes`` bytes of ``copies`` are in by ``deadline``
    (False too where a copy failed: the chain then says so)."""
    try:
        return copies.wait_for(nbytes, until=deadline)
    except RuntimeError:
        return False


class DistributedSenderTransport:
    """The trainer's channel to one worker (rank ``rank``): its hello, notices
    and replies in the store, its liveness connection; the bytes go along
    the chain of ``staging``."""

    def __init__(self, rank: int, worker_id: int, staging: ChainStaging, model_id: str | None) -> None:
        self.rank = rank
        self.worker_id = worker_id
        self.model_id = model_id
        self.layout: Manifest | None = None
        self.devices: tuple[str, ...] | None = None
        #: (Its bytes come through host memory: the chain.)
        self.reach: tuple[str, ...] = ()
        self._staging = staging
        self._member: Hello | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._gone: WorkerLostError | None = None
        self._closed = False

    def _lost(self, reason: str) -> WorkerLostError:
        if self._gone is None:
            code = sig = None
            member = self._member
            if member is not None and member.hostname == socket.gethostname():
                code, sig = exit_status(member.pid, self._process)
            why = describe_exit(code, sig)
            chain = self._staging.why(self.rank)
            reason = f"{reason}; {chain}" if chain else reason
            self._gone = worker_lost(
                self.worker_id,
                self.model_id,
                f"{why}; {reason}" if why else reason,
                exit_code=code,
                exit_signal=sig,
            )
        return self._gone

    def check_alive(self) -> None:
        """:raises WorkerLostError: the worker is known to be gone."""
        if self._gone is not None:
            raise self._gone
        if self._member is not None and self._staging.liveness.state(self.rank, self._member.nonce) == "gone":
            raise self._lost(f"its connection to the trainer closed (rank {self.rank})")

    def why_late(self) -> str | None:
        return self._staging.why(self.rank)

    async def connect(self) -> Manifest | None:
        delay = _POLL[0]
        # (The store is never held in a local: a caller that keeps the
        # error would keep it, and the trainer's store, alive in its frames.)
        while self._member is None:
            value = get_now(self._staging.store, self._staging.keys.hello(self.rank))
            if value is not None:
                self._member = decode(value, Hello)
                self.layout = Manifest.from_signature(self._member.signature)
                self.devices = tuple(self._member.devices)
                # Its Process object, when multiprocessing started it here:
                # it tells how the worker ended even after the user joined it.
                self._process = started_here(self._member.pid)
                self._staging.members[self.rank] = self._member
                break
            await anyio.sleep(delay)
            delay = min(delay * 2, _POLL[1])
        # Its liveness connection was made before its hello was written.
        delay = _POLL[0]
        while self._staging.liveness.state(self.rank, self._member.nonce) == "unknown":
            await anyio.sleep(delay)
            delay = min(delay * 2, _POLL[1])
        self.check_alive()
        return self.layout

    async def reply(self, version: int) -> None:
        """Wait for the worker's reply to ``version`` (the chain of that
        send started), under the caller's cancel scope.

        :raises WorkerLostError: the worker died or its connection closed.
        :raises WorkerApplyError: the worker reported a failure.
        """
        error = await self._staging.reply_of(self.rank, version, self.check_alive)
        if error is not None:
            raise worker_failed(self.worker_id, self.model_id, version, error)

    async def aclose(self) -> None:
        """Tell the worker the trainer shut down (a clean close). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._member is None or self._gone is not None or self._staging.store is None:
                return
            with contextlib.suppress(Exception):
                key = self._staging.notify(self.rank, CloseNotice())
                # Until the worker took it (a worker reads its notices every few
                # ms): once the store is gone with the trainer, it could not.
                with anyio.move_on_after(0.5):
                    while self._staging.store is not None and self._staging.store.check([key]):
                        await anyio.sleep(0.002)
        finally:
            # Its liveness connection is closed now, not with the trainer:
            # a trainer that replaces workers keeps no descriptor per worker
            # it let go of (one cut off never closes its end).
            self._staging.forget(self.rank, None if self._member is None else self._member.nonce)


# -- the worker's side -----------------------------------------------------------


class ChainEndpoint:
    """A worker's end: its relay thread (a ``WorkerRelay``) takes part in
    every send and keeps the newest complete update for ``next_update``.

    Blocks while it is built: it connects to the store (up to ``timeout``
    seconds), waits there for the trainer's session (unless given
    ``session``: one trainer rank's of a sender group), and connects its
    liveness connection to the trainer.

    :raises SenderLostError: the trainer's store or session did not answer in time.
    """

    pushes = False

    def __init__(
        self,
        model_id: str | None,
        rank: int,
        store_address: tuple[str, int] | None,
        store: Any,
        timeout: float,
        session: str | None = None,
    ) -> None:
        self.model_id = model_id
        self.rank = rank
        deadline = time.monotonic() + timeout
        self._nonce = int.from_bytes(os.urandom(8), "little")
        try:
            # Two clients: the relay thread's store calls (among them gloo's
            # rendezvous, which waits for the other members) never delay
            # this thread's replies (a store client runs one call at a time).
            if store is None:
                assert store_address is not None
                store = connect_store(*store_address, timeout=timeout)
                relay_store = connect_store(*store_address, timeout=timeout)
            else:
                relay_store = store
            self._store = store
            if session is None:
                session = wait_key(store, session_key(model_id), deadline).decode()
            self.prefix = session_prefix(model_id, session)
            self.keys = SessionKeys(self.prefix)
            host, port = pickle.loads(wait_key(store, self.keys.live, deadline))
            self._live = TrainerLink((host, port), rank, self._nonce, max(deadline - time.monotonic(), 0.1))
        except (RuntimeError, OSError) as exc:
            raise self.lost(f"its store did not answer ({short_message(exc)})") from exc
        # The address the trainer reaches this host by: the chain binds to it.
        self.address = self._live.local_address
        self._relay = WorkerRelay(model_id, rank, self.keys, relay_store, self._live, self.address)
        self._closed = False

    def lost(self, reason: str) -> SenderLostError:
        return SenderLostError(
            f"the sender of model {self.model_id!r} is gone: {reason}", model_id=self.model_id
        )

    async def announce(self, manifest: Manifest, devices: tuple[str, ...]) -> None:
        self.say_hello(manifest, devices)

    def say_hello(self, manifest: Manifest, devices: tuple[str, ...]) -> None:
        """:meth:`announce`, from any thread (one store write)."""
        # A model on a GPU copies from page-locked buffers.
        self._relay.pin_for_gpu(pins(devices))
        hello = Hello(
            os.getpid(), socket.gethostname(), self.address, manifest.signature, self._nonce, devices
        )
        self._store.set(self.keys.hello(self.rank), encode(hello))

    @property
    def wake_fd(self) -> int:
        """Readable when :meth:`take_update` has something to say."""
        return self._relay.wake_fd

    def has_update(self) -> bool:
        """Whether :meth:`take_update` would return a new update (never blocks,
        lets go of nothing)."""
        return self._relay.has_pending()

    def take_update(self) -> ChainUpdate | None:
        """The newest complete update, or None; never blocks. Lets go of the
        update taken before (its buffer may be written again).

        :raises SenderClosedError: the trainer shut down.
        :raises SenderLostError: the trainer is gone.
        """
        return self._relay.take()

    async def next_update(self, timeout: float) -> ChainUpdate | None:
        update = self._relay.take()
        if update is not None or timeout <= 0:
            return update
        deadline = anyio.current_time() + timeout
        while update is None:
            left = deadline - anyio.current_time()
            if left <= 0:
                return None
            await wait_readable_any([self._relay.wake_fd], left)
            update = self._relay.take()
        return update

    async def reply(self, version: int, error: str | None = None) -> None:
        self.reply_now(version, error)

    def reply_now(self, version: int, error: str | None = None) -> None:
        """:meth:`reply`, from any thread (one store write).

        :raises SenderLostError: the trainer's store failed.
        """
        try:
            self._store.append(self.keys.replies(version), encode_reply(self.rank, error))
        except RuntimeError as exc:
            raise self.lost(f"its store failed ({short_message(exc)})") from exc

    def take_ready(self) -> None:
        return None  # its updates are taken in the loop (next_update)

    def try_reply(self, version: int, error: str | None = None) -> bool:
        return False  # a store write may wait on the network: the loop sends it

    def wait_ready(self, timeout: float) -> bool:
        return self._relay.wait_ready(timeout)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._relay.stop()
        # The relay thread ends within a stall limit (at most 5 s) if a chain is running.
        with anyio.CancelScope(shield=True):
            while self._relay.is_alive():
                await anyio.sleep(0.005)
        self._relay.close()
        self._live.close()
        self._store = None

    def close_now(self) -> None:
        """:meth:`aclose` from a thread with no loop (blocks as it does)."""
        if self._closed:
            return
        self._closed = True
        self._relay.stop()
        while self._relay.is_alive():
            time.sleep(0.005)
        self._relay.close()
        self._live.close()
        self._store = None
