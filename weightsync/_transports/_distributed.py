"""The torch.distributed transport: bytes along a pipelined gloo chain, control
over a TCPStore, liveness over one TCP connection per worker.

Who does what:

- **Data: a gloo chain.** The trainer (group rank 0) and the workers of a
  send form a ``ProcessGroupGloo`` of weightsync's own (over a
  ``PrefixStore`` of the store: no ``init_process_group``, no global state),
  the workers of a host next to each other (see :meth:`ChainStaging._order`).
  The trainer sends its staged copy of the packet, in 1 MiB chunks, to the
  first worker, which passes each chunk on to the next as soon as it has it
  (``_gloo_chain``): every worker's NIC carries the bytes about once each
  way, and the last one finishes about (workers - 1) chunks after the
  first. A thread of each worker (its relay thread) takes part in every
  chain at once, whatever the worker's own code is doing; the bytes land in
  one of two receive buffers of the worker, never the one its receiver
  holds, so ``receive()`` copies one whole version into the model (no torn
  reads), at a safe point, as under the multiprocess scheme.
- **Control: the store.** Keys under ``weightsync/<model>/<session>/``::

      hello/<rank>                 worker:  (pid, host name, address, signature, nonce)
      in/<rank>/<n>                trainer: n-th notice to a worker: ("update", ...) or ("close",)
      joining/<generation>/<rank>  worker:  it is joining that group
      got/<generation>/<v>/<rank>  worker:  (complete, gloo error) of the chain of version v
      reply/<rank>/<v>             worker:  None (applied, the ack) or the reason it did not

  Each side polls with ``check()`` (tens of microseconds on a store of the
  same host), never ``wait()``, so every wait has the caller's deadline.
- **Liveness: a TCP connection per worker** to a listening socket of the
  trainer, held open for the worker's life; nothing is written on it but
  the worker's rank at first and, at a clean shutdown, one byte from the
  trainer. The kernel closes it when either process ends, however it ends,
  so the trainer names a dead worker at once (a :class:`WorkerLostError`)
  and a worker tells a trainer that died (a :class:`SenderLostError`) from
  one that shut down (a :class:`SenderClosedError`); a stopped process
  keeps it open, and is reported at the deadline (:class:`AckTimeoutError`),
  as under the other schemes.

Faults. A worker that dies breaks the gloo group: its neighbours' waits end
within a stall limit (a fraction of the send's deadline, 1 to 5 s). The
workers that got every byte keep their update; the trainer drops the group
and forms a new one (a new prefix) over the workers still missing the bytes
whose liveness connection is open and who answered, and sends again, up to
three chains per send, within the send's deadline. Later sends form their
group without the dead worker: they work as before, and name it at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import pickle
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from .._copy import copy_tensors, usable_cores
from .._digest import copy_out
from .._exceptions import SenderClosedError, SenderLostError, WorkerLostError
from .._offload import run_blocking
from .._packet import Manifest, Packet, Signature
from .._segment import BROKEN, AttachedSegments, Segment
from ._base import worker_failed, worker_lost
from ._channel import ProcessWatch, _wait_readable_any, describe_exit, exit_status, started_here
from ._gloo_chain import (
    CHUNK_BYTES,
    connect_store,
    gloo_group,
    relay_chain,
    send_chain,
    short_message,
)

__all__ = [
    "ChainEndpoint",
    "ChainStaging",
    "ChainUpdate",
    "DistributedSenderTransport",
    "Liveness",
    "session_key",
    "session_prefix",
]

# Stall limit of a chain: this fraction of the time left in the send, within these bounds.
_STALL_BOUNDS = (1.0, 5.0)
_STALL_FRACTION = 0.125
# Chains per send: the first, then repairs around workers that failed.
_ATTEMPTS = 3
# Poll intervals (seconds): the first, and the longest (they double).
_POLL = (0.0005, 0.005)
_IDLE_POLL = (0.001, 0.01)
# A follower's polls of its host leader's progress: a chunk arrives every ~8 ms at 1 Gbit/s.
_FOLLOW_POLL = (0.002, 0.008)
_HELLO = struct.Struct("!4sIQ")
_MAGIC = b"WSL1"
_CLOSING = b"C"
#: How a follower's report starts when it cannot map its host leader's memory.
UNMAPPED = "it cannot map its host leader's memory"


def session_prefix(model_id: str | None, session: str) -> str:
    """The prefix of every key of one trainer's session."""
    return f"weightsync/{model_id}/{session}/"


def session_key(model_id: str | None) -> str:
    """Where the trainer publishes its session (each init_on_sender a new one)."""
    return f"weightsync/{model_id}/session"


def _get_now(store: Any, key: str) -> bytes | None:
    """The value of ``key`` if it is set, else None; never waits."""
    if not store.check([key]):
        return None
    return bytes(store.get(key))


# -- the trainer's side ---------------------------------------------------------


class Liveness:
    """The trainer's listening socket for the workers' liveness connections.

    Never blocks: connections are accepted, and their first bytes (worker
    rank and nonce) read, when a worker's state is asked for.
    """

    def __init__(self, host: str) -> None:
        self._listener = socket.create_server((host, 0), backlog=256)
        self._listener.setblocking(False)
        self.address = (host, self._listener.getsockname()[1])
        self._unread: list[socket.socket] = []
        self._known: dict[tuple[int, int], socket.socket] = {}
        self._closed = False
        # The chain's thread and the sender's loop both ask.
        self._lock = threading.Lock()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, OSError):
                break
            conn.setblocking(False)
            self._unread.append(conn)
        still: list[socket.socket] = []
        for conn in self._unread:
            try:
                head = conn.recv(_HELLO.size, socket.MSG_PEEK)
            except BlockingIOError:
                still.append(conn)
                continue
            except OSError:
                conn.close()
                continue
            if len(head) < _HELLO.size:
                if head:
                    still.append(conn)
                else:
                    conn.close()
                continue
            conn.recv(_HELLO.size)
            magic, rank, nonce = _HELLO.unpack(head)
            if magic != _MAGIC:
                conn.close()
                continue
            old = self._known.pop((rank, nonce), None)
            if old is not None:
                old.close()
            self._known[(rank, nonce)] = conn
        self._unread = still

    def state(self, rank: int, nonce: int) -> str:
        """``"alive"``, ``"gone"`` (its connection closed: the worker ended),
        or ``"unknown"`` (not connected yet)."""
        with self._lock:
            if self._closed:
                return "unknown"
            conn = self._known.get((rank, nonce))
            if conn is None:
                self._accept()
                conn = self._known.get((rank, nonce))
                if conn is None:
                    return "unknown"
            try:
                data = conn.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return "alive"
            except OSError:
                return "gone"
            return "alive" if data else "gone"

    def close(self) -> None:
        """Close every connection: each worker hears the trainer gone. Idempotent."""
        with self._lock:
            self._closed = True
            for conn in self._known.values():
                # One byte before the end: a clean shutdown, which a worker
                # then tells from a trainer that died (its end closes bare).
                with contextlib.suppress(OSError):
                    conn.send(_CLOSING)
            for conn in [*self._unread, *self._known.values()]:
                conn.close()
            self._unread, self._known = [], {}
            self._listener.close()


@dataclass
class _Send:
    """What the workers of one send are told of it."""

    version: int
    nbytes: int
    layout_id: str
    subset: Signature | None
    threads: int
    #: The tensors' digests (verify=True), known once the send is staged.
    digests: tuple[int, ...] | None = None


@dataclass
class _Member:
    """What the trainer knows of one worker, from its hello."""

    rank: int
    pid: int
    hostname: str
    nonce: int
    #: The address the trainer reaches it by (its host's).
    address: str = ""


class ChainStaging:
    """The trainer's staged copy of each send (one flat buffer), the chain
    that carries it to the workers of the send, and what the transports
    share: the store, the liveness socket, the workers' hellos.

    :meth:`start` (called by the first ``deliver()`` of a send) runs the
    chain on a thread of its own; it never waits on the caller's loop.
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
        chunk: int = CHUNK_BYTES,
    ) -> None:
        self.model_id = model_id
        self.store = store
        self.prefix = prefix
        self.liveness = liveness
        self.share_on_host = share_on_host
        self.chunk = chunk
        self._store_address = store_address
        self._buffer: torch.Tensor | None = None
        self._views: tuple[str, list[torch.Tensor]] | None = None
        self._send: _Send | None = None
        self.members: dict[int, _Member] = {}
        self._enlisted: list[int] = []
        self._started = False
        #: Per send: rank -> True (got every byte) or why not (a string).
        self.outcome: dict[int, bool | str] = {}
        self._thread: threading.Thread | None = None
        self._chain_store: Any = None
        self._group: Any = None
        self._group_ranks: tuple[int, ...] = ()
        self._generations = 0
        self._notices: dict[int, int] = {}
        self._closed = False
        #: Per send: for each chain, its ranks in order and whom each host leader fed.
        self.last_routes: list[tuple[tuple[int, ...], dict[int, tuple[int, ...]]]] = []
        # Workers that could not map their host leader's memory: in the chain themselves.
        self._direct: set[int] = set()

    # -- staging ---------------------------------------------------------------
    async def stage(self, packet: Packet, digest: bool = False) -> tuple[int, ...] | None:
        # The previous send's chain may still be ending (within a stall
        # limit, when it was abandoned): it reads the buffer.
        while self._thread is not None and self._thread.is_alive():
            await anyio.sleep(0.005)
        self._thread = None
        manifest = packet.manifest
        if self._buffer is None or self._buffer.numel() < manifest.nbytes:
            self._views = None
            self._buffer = None
            self._buffer = torch.empty(manifest.nbytes, dtype=torch.uint8)
        if self._views is None or self._views[0] != manifest.layout_id:
            self._views = (manifest.layout_id, manifest.views(self._buffer))
        views = self._views[1]
        sums = await run_blocking(packet.nbytes, copy_out, views, packet.tensors, digest, usable_cores())
        threads = max(1, usable_cores() // packet.fanout)
        self._send = _Send(packet.version, manifest.nbytes, manifest.layout_id, packet.subset, threads)
        self._enlisted, self._started, self.outcome = [], False, {}
        return sums

    def descriptor(self, worker_id: int) -> None:
        """Nothing: each worker is told where its bytes come from by its notice."""
        return None

    def released(self, worker_id: int, version: int, holding: Any) -> None:
        """Nothing to do: each worker holds copies of its own."""

    # -- one send ----------------------------------------------------------------
    def enlist(self, rank: int, digests: tuple[int, ...] | None) -> None:
        """Add ``rank`` to the current send's chain (before :meth:`start`)."""
        assert self._send is not None, "stage() comes first"
        if digests is not None:
            self._send.digests = digests
        if rank not in self._enlisted and not self._started:
            self._enlisted.append(rank)

    def start(self, deadline: float) -> None:
        """Start the chain of the current send over the enlisted workers
        (once per send; never waits). ``deadline``: ``time.monotonic()``."""
        if self._started:
            return
        self._started = True
        ranks = sorted(self._enlisted)
        if not ranks or self._send is None:
            return
        self._thread = threading.Thread(
            target=self._run, args=(self._send, ranks, deadline), daemon=True,
            name=f"weightsync-chain-{self.model_id}",
        )  # fmt: skip
        self._thread.start()

    def _order(self, ranks: list[int]) -> list[int]:
        """``ranks`` in chain order: the workers of the trainer's host first,
        then host by host, by rank within a host. The workers of a host are
        neighbours in the chain, so the bytes cross each host's NIC once in
        and once out, however many workers it has and however the ranks
        were spread over the hosts (the hops between them stay on the host)."""
        here = self.liveness.address[0]

        def key(rank: int) -> tuple[bool, str, int]:
            member = self.members.get(rank)
            address = member.address if member is not None else ""
            return (address != here, address, rank)

        return sorted(ranks, key=key)

    def _plan(self, ranks: list[int]) -> tuple[list[int], dict[int, tuple[int, ...]]]:
        """The chain over ``ranks`` and whom each of its workers feeds.

        With ``share_on_host``, one worker of each host (its host leader,
        the first in chain order) is in the chain, and writes what it
        receives into shared memory of its own, from which the host's other
        workers copy it as it arrives: the bytes cross the host's NIC once
        and its memory bus once per worker, instead of once per worker
        through the host's loopback. Otherwise every worker is in the chain."""
        ordered = self._order(ranks)
        if not self.share_on_host:
            return ordered, {}
        chain: list[int] = []
        fed: dict[int, list[int]] = {}
        leaders: dict[tuple[str, str], int] = {}
        for rank in ordered:
            member = self.members.get(rank)
            if member is None or rank in self._direct:
                chain.append(rank)
                continue
            leader = leaders.setdefault((member.address, member.hostname), rank)
            if leader == rank:
                chain.append(rank)
            else:
                fed.setdefault(leader, []).append(rank)
        return chain, {leader: tuple(ranks) for leader, ranks in fed.items()}

    def _alive(self, rank: int) -> bool:
        member = self.members.get(rank)
        return member is not None and self.liveness.state(rank, member.nonce) != "gone"

    def _client(self) -> Any:
        """The store client of the notices and the chain, made on first use."""
        if self._chain_store is None:
            self._chain_store = connect_store(*self._store_address, timeout=10.0)
        return self._chain_store

    def notify(self, rank: int, notice: tuple[Any, ...]) -> str:
        """Leave ``notice`` for worker ``rank``; its key."""
        n = self._notices.get(rank, 0) + 1
        self._notices[rank] = n
        key = f"{self.prefix}in/{rank}/{n}"
        self._client().set(key, pickle.dumps(notice))
        return key

    def _run(self, send: _Send, ranks: list[int], deadline: float) -> None:
        try:
            self._chains(send, ranks, deadline)
        except Exception as exc:  # never leave a deliver() without an answer
            for rank in ranks:
                self.outcome.setdefault(rank, f"the chain failed: {short_message(exc)}")
            self._drop()

    def _chains(self, send: _Send, ranks: list[int], deadline: float) -> None:
        version, nbytes = send.version, send.nbytes
        store = self._client()
        assert self._buffer is not None
        source = self._buffer[:nbytes]
        pending = list(ranks)
        excluded: set[int] = set()
        self.last_routes = []
        for _ in range(_ATTEMPTS):
            chain, fed = self._plan([r for r in pending if r not in excluded and self._alive(r)])
            left = deadline - time.monotonic()
            if not chain or left <= 0 or self._closed:
                break
            stall = min(max(left * _STALL_FRACTION, _STALL_BOUNDS[0]), _STALL_BOUNDS[1])
            if self._group is None or self._group_ranks != tuple(chain):
                self._drop()
                self._generations += 1
            generation = f"g{self._generations}"
            what = (version, send.layout_id, send.subset, send.digests, send.threads, nbytes, generation)
            for i, rank in enumerate(chain):
                dst = i + 2 if i + 1 < len(chain) else None
                self.notify(rank, ("update", *what, tuple(chain), i, dst, stall, 2 * stall, rank in fed))
            for leader, followers in fed.items():
                for rank in followers:
                    self.notify(rank, ("follow", *what, leader, self.members[leader].pid, stall, 2 * stall))
            if self._group is None:
                try:
                    self._group = gloo_group(
                        store,
                        f"{self.prefix}{generation}/",
                        0,
                        len(chain) + 1,
                        self.liveness.address[0],
                        stall,
                    )
                    self._group_ranks = tuple(chain)
                except RuntimeError:
                    self._drop()
                    joined = {r for r in chain if store.check([f"{self.prefix}joining/{generation}/{r}"])}
                    excluded |= set(chain) - joined
                    continue
            self.last_routes.append((tuple(chain), fed))
            broken = False
            if nbytes:
                try:
                    send_chain(self._group, [source], self.chunk, 1, stall)
                except RuntimeError:
                    broken = True
            # Every worker of the send reports whether it got every byte.
            everyone = chain + [rank for followers in fed.values() for rank in followers]
            waiting = {rank: f"{self.prefix}got/{generation}/{version}/{rank}" for rank in everyone}
            # Each report also counts itself here: one store call per poll
            # tells whether any came, however many workers there are.
            counter, counted = f"{self.prefix}got/{generation}/{version}/count", 0
            patience = deadline if not broken else min(deadline, time.monotonic() + stall + 1.0)
            delay = _POLL[0]
            while waiting and time.monotonic() < patience and not self._closed:
                reported = int(store.add(counter, 0))
                fresh, counted = reported > counted, reported
                for rank, key in list(waiting.items()):
                    value = _get_now(store, key) if fresh else None
                    if value is None:
                        if not self._alive(rank):
                            # Dead: it will never answer, and the chain broke at it.
                            del waiting[rank]
                            excluded.add(rank)
                            self.outcome[rank] = "it died during the chain"
                            broken = broken or rank in chain
                        continue
                    store.delete_key(key)
                    del waiting[rank]
                    complete, error = pickle.loads(value)
                    if complete:
                        self.outcome[rank] = True
                        pending.remove(rank)
                    else:
                        self.outcome[rank] = f"the chain broke before it got every byte ({error})"
                        if str(error).startswith(UNMAPPED):
                            self._direct.add(rank)
                    # (A follower's failure leaves the chain as it was.)
                    if (not complete or error is not None) and not broken and rank in chain:
                        broken = True
                        patience = min(patience, time.monotonic() + stall + 1.0)
                if waiting:
                    time.sleep(delay)
                    delay = min(delay * 2, _POLL[1])
            store.delete_key(counter)
            # One that never answered is stopped, cut off or dead: not in the next chain.
            excluded |= set(waiting)
            for rank in waiting:
                self.outcome.setdefault(rank, "it did not take part in the chain")
            if broken or waiting:
                self._drop()
            if not pending:
                return

    def _drop(self) -> None:
        self._group, self._group_ranks = None, ()

    async def aclose(self) -> None:
        """Stop the chain, close the liveness socket (every worker hears the
        trainer gone) and let go of the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None:
            # A chain ends within a stall limit (at most 5 s) once closed.
            with anyio.CancelScope(shield=True):
                while thread.is_alive():
                    await anyio.sleep(0.01)
        self._thread = None
        self._drop()
        self.liveness.close()
        self._buffer, self._views = None, None
        self._chain_store = None
        self.store = None


class DistributedSenderTransport:
    """The trainer's channel to one worker (rank ``rank``): its hello, notices
    and replies in the store, its liveness connection; the bytes go along
    the chain of ``staging``."""

    def __init__(self, rank: int, worker_id: int, staging: ChainStaging, model_id: str | None) -> None:
        self.rank = rank
        self.worker_id = worker_id
        self.model_id = model_id
        self.layout: Manifest | None = None
        self._staging = staging
        self._member: _Member | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._gone: WorkerLostError | None = None
        self._closed = False

    def _key(self, name: str) -> str:
        return f"{self._staging.prefix}{name}"

    def _lost(self, reason: str) -> WorkerLostError:
        if self._gone is None:
            code = sig = None
            member = self._member
            if member is not None and member.hostname == socket.gethostname():
                code, sig = exit_status(member.pid, self._process)
            why = describe_exit(code, sig)
            self._gone = worker_lost(
                self.worker_id,
                self.model_id,
                f"{why}; {reason}" if why else reason,
                exit_code=code,
                exit_signal=sig,
            )
        return self._gone

    def _check_alive(self) -> None:
        if self._gone is not None:
            raise self._gone
        if self._member is not None and self._staging.liveness.state(self.rank, self._member.nonce) == "gone":
            raise self._lost(f"its connection to the trainer closed (rank {self.rank})")

    async def connect(self) -> Manifest | None:
        delay = _POLL[0]
        # (The store is never held in a local: a caller that keeps the
        # error would keep it, and the trainer's store, alive in its frames.)
        while self._member is None:
            value = _get_now(self._staging.store, self._key(f"hello/{self.rank}"))
            if value is not None:
                pid, hostname, address, signature, nonce = pickle.loads(value)
                self.layout = Manifest.from_signature(signature)
                self._member = _Member(self.rank, int(pid), str(hostname), int(nonce), str(address))
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
        self._check_alive()
        return self.layout

    def post(self, packet: Packet) -> bool:
        self._check_alive()
        self._staging.enlist(self.rank, packet.digests)
        return True

    async def deliver(self, packet: Packet) -> None:
        self._check_alive()
        self._staging.enlist(self.rank, packet.digests)
        deadline = anyio.current_effective_deadline()
        left = 3600.0 if deadline == float("inf") else deadline - anyio.current_time()
        self._staging.start(time.monotonic() + left)
        key = self._key(f"reply/{self.rank}/{packet.version}")
        delay = _POLL[0]
        while True:
            value = _get_now(self._staging.store, key)
            if value is not None:
                self._staging.store.delete_key(key)
                error = pickle.loads(value)
                if error is None:
                    return
                raise worker_failed(self.worker_id, self.model_id, packet.version, str(error))
            self._check_alive()
            await anyio.sleep(delay)
            delay = min(delay * 2, _POLL[1])

    async def aclose(self) -> None:
        """Tell the worker the trainer shut down (a clean close). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._member is None or self._gone is not None or self._staging.store is None:
            return
        with contextlib.suppress(Exception):
            key = self._staging.notify(self.rank, ("close",))
            # Until the worker took it (a worker reads its notices every few
            # ms): once the store is gone with the trainer, it could not.
            with anyio.move_on_after(0.5):
                while self._staging.store is not None and self._staging.store.check([key]):
                    await anyio.sleep(0.002)


# -- the worker's side -----------------------------------------------------------


@dataclass(eq=False)
class ChainUpdate:
    """An update whose bytes are in one of the worker's receive buffers
    (``slot``), which the relay thread does not write while the receiver
    holds it."""

    version: int
    layout_id: str
    subset: Signature | None
    digests: tuple[int, ...] | None
    threads: int
    buffer: torch.Tensor
    slot: int

    #: Each worker digests a verified update's bytes itself.
    checked_on_host = False

    def check_mapping(self, manifest: Manifest) -> str | None:
        return None

    def is_current(self) -> bool:
        # Its buffer is never rewritten while the receiver holds it.
        return True

    def sources(self, manifest: Manifest) -> list[torch.Tensor]:
        return manifest.views(self.buffer)

    def apply(self, model: Any, targets: list[torch.Tensor], manifest: Manifest) -> None:
        copy_tensors(targets, manifest.views(self.buffer), threads=self.threads)


class ChainEndpoint:
    """A worker's end: a relay thread that takes part in every chain and
    keeps the newest complete update for ``next_update``.

    Blocks while it is built: it connects to the store (up to ``timeout``
    seconds), waits there for the trainer's session, and connects its
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
    ) -> None:
        self.model_id = model_id
        self.rank = rank
        deadline = time.monotonic() + timeout
        try:
            # Two clients: the relay thread's store calls (among them gloo's
            # rendezvous, which waits for the other members) never delay
            # this thread's replies (a store client runs one call at a time).
            if store is None:
                assert store_address is not None
                store = connect_store(*store_address, timeout=timeout)
                self._relay_store = connect_store(*store_address, timeout=timeout)
            else:
                self._relay_store = store
            self._store = store
            session = self._wait_key(store, session_key(model_id), deadline)
            self.prefix = session_prefix(model_id, session.decode())
            host, port = pickle.loads(self._wait_key(store, f"{self.prefix}live", deadline))
            self._live = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.1))
        except (RuntimeError, OSError) as exc:
            raise self.lost(f"its store did not answer ({short_message(exc)})") from exc
        self._nonce = int.from_bytes(os.urandom(8), "little")
        self._live.sendall(_HELLO.pack(_MAGIC, rank, self._nonce))
        self._live.setblocking(False)
        # The address the trainer reaches this host by: the chain binds to it.
        self.address = self._live.getsockname()[0]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor | None] = [None, None]
        # A receive buffer in shared memory (when this worker leads its host) or None.
        self._segments: list[Segment | None] = [None, None]
        # Host leaders' segments this worker copied from: a leader has two at
        # a time, and a new pair when it grows them or the leader changes.
        self._mapped = AttachedSegments(keep=4)
        self._pending: ChainUpdate | None = None
        self._taken: int | None = None
        self._ended: Exception | None = None
        self._stop = threading.Event()
        self._group: Any = None
        self._generation = ""
        self._closed = False
        self._thread = threading.Thread(
            target=self._relay_loop, daemon=True, name=f"weightsync-relay-{model_id}"
        )
        self._thread.start()

    def lost(self, reason: str) -> SenderLostError:
        return SenderLostError(
            f"the sender of model {self.model_id!r} is gone: {reason}", model_id=self.model_id
        )

    @staticmethod
    def _wait_key(store: Any, key: str, deadline: float) -> bytes:
        delay = _IDLE_POLL[0]
        while True:
            value = _get_now(store, key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {key!r} in the store")
            time.sleep(delay)
            delay = min(delay * 2, _IDLE_POLL[1])

    # -- the relay thread ------------------------------------------------------------
    def _trainer_state(self, wait: float = 0.0) -> str:
        """``"alive"``, ``"closed"`` (it shut down cleanly) or ``"gone"``
        (it died), from the liveness connection; waits up to ``wait``
        seconds for it to tell."""
        if wait > 0:
            select.select([self._live], [], [], wait)
        try:
            data = self._live.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return "alive"
        except OSError:
            return "gone"
        return "closed" if data == _CLOSING else "gone" if not data else "alive"

    def _closed_error(self) -> SenderClosedError:
        return SenderClosedError(f"the sender of model {self.model_id!r} shut down", model_id=self.model_id)

    def _end(self, error: Exception) -> None:
        with self._lock:
            if self._ended is None:
                self._ended = error
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _relay_loop(self) -> None:
        store = self._relay_store
        n = 0
        delay = _IDLE_POLL[0]
        try:
            while not self._stop.is_set():
                key = f"{self.prefix}in/{self.rank}/{n + 1}"
                value = _get_now(store, key)
                if value is None:
                    state = self._trainer_state()
                    if state == "closed":
                        self._end(self._closed_error())
                        return
                    if state == "gone":
                        self._end(self.lost("its connection to this worker closed"))
                        return
                    self._stop.wait(delay)
                    delay = min(delay * 2, _IDLE_POLL[1])
                    continue
                delay = _IDLE_POLL[0]
                n += 1
                store.delete_key(key)
                notice = pickle.loads(value)
                if notice[0] == "close":
                    self._end(self._closed_error())
                    return
                # A newer notice means the trainer is done with this one (it
                # writes the next only once a chain ended): a worker that was
                # stopped catches up without joining chains long gone.
                if _get_now(store, f"{self.prefix}in/{self.rank}/{n + 1}") is not None:
                    continue
                if notice[0] == "update":
                    self._relay(store, notice)
                elif notice[0] == "follow":
                    self._follow(store, notice)
        except Exception as exc:  # the store is gone with the trainer
            if not self._stop.is_set():
                # A trainer that shut down said so on the liveness connection first.
                if self._trainer_state(wait=0.5) == "closed":
                    self._end(self._closed_error())
                else:
                    self._end(self.lost(f"its store failed ({short_message(exc)})"))
        finally:
            self._group = None

    def _slot_for(self, nbytes: int, shared: bool) -> tuple[int, torch.Tensor, Segment | None]:
        """A receive buffer that the receiver does not hold, in shared
        memory if ``shared``, and its segment if it is in one; an update
        pending in it is dropped (the one about to arrive supersedes it)."""
        with self._lock:
            if self._taken is not None:
                slot = 1 - self._taken
            elif self._pending is not None:
                slot = 1 - self._pending.slot
            else:
                slot = 0
            if self._pending is not None and self._pending.slot == slot:
                self._pending = None
        buffer, segment = self._buffers[slot], self._segments[slot]
        if buffer is None or buffer.numel() < nbytes or (shared and segment is None):
            self._buffers[slot] = None
            if segment is not None:
                # Mapped by followers, it is unmapped when the last of them lets go.
                segment.close()
                self._segments[slot] = segment = None
            if shared:
                segment = self._segments[slot] = Segment.create(nbytes)
                assert segment.data is not None
                buffer = self._buffers[slot] = segment.data
            else:
                buffer = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return slot, buffer, segment

    def _relay(self, store: Any, notice: tuple[Any, ...]) -> None:
        """Take part in a chain: receive the update and pass it on (and, as
        its host leader, write it where the host's other workers copy it from)."""
        _, *what, chain, src, dst, stall, first, feeds = notice
        version, generation = what[0], what[6]

        def fill(view: torch.Tensor, segment: Segment | None) -> tuple[bool, str | None]:
            if feeds:
                assert segment is not None
                lead = (generation, version, segment.ref())
                store.set(f"{self.prefix}lead/{self.rank}", pickle.dumps(lead))
            return self._chain(store, view, generation, chain, src, dst, stall, first, segment)

        self._take_in(store, what, feeds, fill)

    def _follow(self, store: Any, notice: tuple[Any, ...]) -> None:
        """Copy an update from this host leader's shared memory, as it arrives there."""
        _, *what, leader, pid, stall, first = notice
        version, generation = what[0], what[6]

        def fill(view: torch.Tensor, segment: Segment | None) -> tuple[bool, str | None]:
            return self._copy_from(store, view, version, generation, (leader, pid), stall, first)

        self._take_in(store, what, False, fill)

    def _take_in(
        self,
        store: Any,
        what: list[Any],
        shared: bool,
        fill: Callable[[torch.Tensor, Segment | None], tuple[bool, str | None]],
    ) -> None:
        """Receive one update into a free receive buffer (by ``fill``), keep
        it for the receiver if it is whole, and report to the trainer."""
        version, layout_id, subset, digests, threads, nbytes, generation = what
        slot, buffer, segment = self._slot_for(nbytes, shared)
        view = buffer[:nbytes]
        if segment is not None:
            # Followers of this send, or a late one of an earlier send, may read it.
            segment.begin_fill(version)
        complete, error = False, None
        try:
            complete, error = fill(view, segment)
        finally:
            if segment is not None:
                if complete:
                    segment.publish(version)
                else:
                    segment.filled_to(BROKEN)
        if complete:
            with self._lock:
                self._pending = ChainUpdate(version, layout_id, subset, digests, threads, view, slot)
            self._wake()
        report = f"{self.prefix}got/{generation}/{version}/"
        store.set(f"{report}{self.rank}", pickle.dumps((complete, error)))
        store.add(f"{report}count", 1)

    def _chain(
        self,
        store: Any,
        view: torch.Tensor,
        generation: str,
        chain: tuple[int, ...],
        src: int,
        dst: int | None,
        stall: float,
        first: float,
        segment: Segment | None,
    ) -> tuple[bool, str | None]:
        """Take part in the chain of ``generation``: receive ``view`` and pass it on."""
        if self._generation != generation:
            self._group, self._generation = None, ""
            store.set(f"{self.prefix}joining/{generation}/{self.rank}", b"1")
            try:
                self._group = gloo_group(
                    store, f"{self.prefix}{generation}/", chain.index(self.rank) + 1, len(chain) + 1,
                    self.address, stall,
                )  # fmt: skip
            except RuntimeError as exc:
                return False, f"no group: {short_message(exc)}"
            self._generation = generation
        progress = None if segment is None else segment.filled_to
        complete, error = relay_chain(self._group, view, CHUNK_BYTES, src, dst, stall, first, progress)
        if error is not None:
            self._group, self._generation = None, ""
        return complete, error

    def _copy_from(
        self,
        store: Any,
        view: torch.Tensor,
        version: int,
        generation: str,
        leader: tuple[int, int],
        stall: float,
        first: float,
    ) -> tuple[bool, str | None]:
        """Copy ``version`` into ``view`` from the segment of host leader
        ``leader`` (rank, pid), each part as soon as it is there; (whether
        it was all copied, why not). Waits up to ``stall`` seconds for the
        leader to say where (it does before it joins the chain), ``first``
        for the first part and ``stall`` for each part after."""
        # (A killed leader is a zombie until its launcher reaps it: dead already.)
        with contextlib.closing(ProcessWatch(leader[1])) as watch:
            who = f"its host leader (rank {leader[0]})"
            deadline = time.monotonic() + stall
            delay = _POLL[0]
            while True:
                value = _get_now(store, f"{self.prefix}lead/{leader[0]}")
                if value is not None:
                    lead_generation, lead_version, ref = pickle.loads(value)
                    if (lead_generation, lead_version) == (generation, version):
                        break
                if not watch.alive():
                    return False, f"{who} died"
                if time.monotonic() > deadline or self._stop.is_set():
                    return False, f"{who} did not start"
                time.sleep(delay)
                delay = min(delay * 2, _POLL[1])
            try:
                source = self._mapped.segment(ref)
            except Exception as exc:  # not this user's, another host after all, out of files...
                return False, f"{UNMAPPED} (rank {leader[0]}): {short_message(exc)}"
            assert source.data is not None
            nbytes = view.numel()
            done, last, limit = 0, time.monotonic(), first
            delay = _FOLLOW_POLL[0]
            while done < nbytes:
                published, writing, filled = source.progress()
                if published == version:
                    filled = nbytes
                elif writing != version:
                    return False, f"{who} moved on to another version"
                elif filled == BROKEN:
                    return False, f"{who} did not get every byte"
                if filled > done:
                    view[done:filled].copy_(source.data[done:filled])
                    done, last, limit, delay = filled, time.monotonic(), stall, _FOLLOW_POLL[0]
                    continue
                if time.monotonic() - last > limit or self._stop.is_set():
                    return False, f"{who} stalled"
                if not watch.alive():
                    return False, f"{who} died"
                time.sleep(delay)
                delay = min(delay * 2, _FOLLOW_POLL[1])
            # Not overwritten by another version while it was copied (see Segment.begin_fill).
            if source.progress()[1] != version:
                return False, f"{who} moved on to another version while this worker copied"
            return True, None

    # -- the receiver's calls --------------------------------------------------------
    async def announce(self, manifest: Manifest) -> None:
        hello = (os.getpid(), socket.gethostname(), self.address, manifest.signature, self._nonce)
        self._store.set(f"{self.prefix}hello/{self.rank}", pickle.dumps(hello))

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass

    def _take(self) -> ChainUpdate | None:
        self._drain_wake()
        with self._lock:
            # The receiver is done with the update it took before.
            self._taken = None
            update, self._pending = self._pending, None
            if update is not None:
                self._taken = update.slot
                return update
            if self._ended is not None:
                raise self._ended
        return None

    async def next_update(self, timeout: float) -> ChainUpdate | None:
        update = self._take()
        if update is not None or timeout <= 0:
            return update
        deadline = anyio.current_time() + timeout
        while update is None:
            left = deadline - anyio.current_time()
            if left <= 0:
                return None
            await _wait_readable_any([self._wake_r.fileno()], left)
            update = self._take()
        return update

    async def reply(self, version: int, error: str | None = None) -> None:
        try:
            self._store.set(f"{self.prefix}reply/{self.rank}/{version}", pickle.dumps(error))
        except RuntimeError as exc:
            raise self.lost(f"its store failed ({short_message(exc)})") from exc

    def wait_ready(self, timeout: float) -> bool:
        with self._lock:
            if self._pending is not None or self._ended is not None:
                return True
        ready, _, _ = select.select([self._wake_r], [], [], max(timeout, 0.0))
        return bool(ready)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        # The relay thread ends within a stall limit (at most 5 s) if a chain is running.
        with anyio.CancelScope(shield=True):
            while self._thread.is_alive():
                await anyio.sleep(0.005)
        self._group = None
        self._buffers = [None, None]
        for segment in self._segments:
            if segment is not None:
                segment.close()
        self._segments = [None, None]
        self._mapped.close()
        self._pending = None
        self._live.close()
        self._wake_r.close()
        self._wake_w.close()
        self._store = self._relay_store = None
