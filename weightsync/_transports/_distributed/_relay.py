"""A torch.distributed worker's relay thread: it reads the trainer's notices
from the store and takes part in every send, whatever the worker's own code
is doing: in the chain (a ``ChainMember``, and, as its host leader, into
shared memory for the host's followers), or as a follower of its host
leader. The bytes land in one of two receive buffers, never the one the
receiver holds; the newest complete update waits for the receiver
(:meth:`WorkerRelay.take`), and every update is reported to the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import select
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..._exceptions import SenderClosedError, SenderLostError
from ..._memory._segment import AttachedSegments, Segment
from ..._packet import Manifest
from .._base import BufferUpdate
from .._chain._driver import ChainMember, Report
from .._chain._pipeline import short_message
from ._host_share import BufferReads, ReceiveBuffers, fill_segment, follow
from ._liveness import TrainerLink
from ._protocol import (
    CloseNotice,
    FollowNotice,
    Lead,
    SendInfo,
    SessionKeys,
    UpdateNotice,
    decode_notice,
    encode,
    get_now,
)

__all__ = ["ChainUpdate", "WorkerRelay"]

#: How an update comes into a receive buffer: (the buffer's view, its
#: segment if shared, the buffer holding a delta's base) -> the report.
Fill = Callable[[torch.Tensor, Segment | None, torch.Tensor | None], Report]

# An idle relay thread waits for the trainer's bell (``_liveness``), and
# looks at the store for its next notice this often all the same (seconds).
# Not a wait in the store: on torch 2.13's TCPStore, once a ``wait()`` timed
# out, a later ``set`` of its key leaves a stale answer on the connection,
# which the client's next call on that key reads (a probe: ``check()``
# said False for a key that was there in 46 of 200 tries).
_IDLE_LOOK = 1.0


@dataclasses.dataclass(eq=False)
class ChainUpdate(BufferUpdate):
    """An update whose bytes are in one of the worker's receive buffers
    (``slot``), which the relay thread does not write while the receiver
    holds it. Its views and copy plan are the buffer's (``reads``), made
    once per buffer, layout and model, not once per update."""

    slot: int
    reads: BufferReads

    def sources(self, manifest: Manifest) -> list[torch.Tensor]:
        return self.reads.views(self.buffer, manifest)

    def apply(self, model: Any, targets: list[torch.Tensor], manifest: Manifest) -> None:
        self.reads.plan(targets, self.sources(manifest)).run(self.threads)


class WorkerRelay:
    """The relay thread of worker ``rank`` (started at once) and what it
    leaves for the receiver. ``store``: a store client of its own (gloo's
    rendezvous waits on it); ``live``: its liveness connection, which tells
    a trainer that shut down from one that died."""

    def __init__(
        self, model_id: str | None, rank: int, keys: SessionKeys, store: Any, live: TrainerLink, address: str
    ) -> None:
        self.model_id = model_id
        self.rank = rank
        self.keys = keys
        self._store = store
        self._live = live
        self._member = ChainMember(address)
        self._buffers = ReceiveBuffers()
        # Host leaders' segments this worker copied from: a leader has two at
        # a time, and a new pair when it grows them or the leader changes.
        self._mapped = AttachedSegments(keep=4)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()
        self._pending: ChainUpdate | None = None
        self._taken: int | None = None
        self._ended: Exception | None = None
        self._stop = threading.Event()
        # Readable once stop() is asked: wakes the thread's idle wait.
        self._stop_r, self._stop_w = socket.socketpair()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"weightsync-relay-{model_id}")
        self._thread.start()

    @property
    def wake_fd(self) -> int:
        """Readable when an update (or the trainer's end) is there to :meth:`take`."""
        return self._wake_r.fileno()

    def pin_for_gpu(self, on: bool) -> None:
        """Whether the worker's model is on a GPU: its receive buffers are
        then page-locked (each once, from the next update on)."""
        self._buffers.pin = on

    def lost(self, reason: str) -> SenderLostError:
        return SenderLostError(
            f"the sender of model {self.model_id!r} is gone: {reason}", model_id=self.model_id
        )

    # -- the receiver's side -----------------------------------------------------
    def take(self) -> ChainUpdate | None:
        """The newest complete update (the receiver holds its buffer until
        its next call), or None; never blocks.

        :raises SenderClosedError: the trainer shut down.
        :raises SenderLostError: the trainer is gone.
        """
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass
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

    def has_pending(self) -> bool:
        """Whether a complete update waits to be taken."""
        with self._lock:
            return self._pending is not None

    def wait_ready(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until :meth:`take` has something to say."""
        with self._lock:
            if self._pending is not None or self._ended is not None:
                return True
        ready, _, _ = select.select([self._wake_r], [], [], max(timeout, 0.0))
        return bool(ready)

    def stop(self) -> None:
        """Ask the thread to end (within a stall limit, at most 5 s, if a chain runs)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._stop_w.send(b"x")

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Let go of the buffers and descriptors, once the thread ended. Idempotent."""
        self._member.leave()
        self._buffers.close()
        self._mapped.close()
        self._pending = None
        self._wake_r.close()
        self._wake_w.close()
        self._stop_r.close()
        self._stop_w.close()
        self._store = None

    # -- the thread ----------------------------------------------------------------
    def _closed_error(self) -> SenderClosedError:
        return SenderClosedError(f"the sender of model {self.model_id!r} shut down", model_id=self.model_id)

    def _end(self, error: Exception) -> None:
        with self._lock:
            if self._ended is None:
                self._ended = error
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _loop(self) -> None:
        store = self._store
        n = 0
        try:
            while not self._stop.is_set():
                key = self.keys.notice(self.rank, n + 1)
                # The bells are read before the store is: one rung after
                # this look wakes the wait below.
                state = self._live.state()
                if state == "closed":
                    self._end(self._closed_error())
                    return
                if state == "gone":
                    self._end(self.lost("its connection to this worker closed"))
                    return
                value = get_now(store, key)
                if value is None:
                    # Until the trainer rings (or ends), or stop(): no CPU
                    # here or in the trainer's store while idle. The store
                    # is looked at again after a while all the same.
                    select.select([self._live.fileno(), self._stop_r.fileno()], [], [], _IDLE_LOOK)
                    continue
                n += 1
                store.delete_key(key)
                notice = decode_notice(value)
                if isinstance(notice, CloseNotice):
                    self._end(self._closed_error())
                    return
                # A newer notice means the trainer is done with this one (it
                # writes the next only once a chain ended): a worker that was
                # stopped catches up without joining chains long gone.
                if get_now(store, self.keys.notice(self.rank, n + 1)) is not None:
                    continue
                if isinstance(notice, UpdateNotice):
                    encoded = notice.link.encoded
                    base = None if encoded is None else encoded.base_version
                    self._take_in(store, notice.send, notice.feeds, self._chained(store, notice), base)
                else:
                    self._take_in(store, notice.send, False, self._follower(store, notice))
        except Exception as exc:  # the store is gone with the trainer
            if not self._stop.is_set():
                # A trainer that shut down said so on the liveness connection first.
                if self._live.state(wait=0.5) == "closed":
                    self._end(self._closed_error())
                else:
                    self._end(self.lost(f"its store failed ({short_message(exc)})"))
        finally:
            self._member.leave()

    def _chained(self, store: Any, notice: UpdateNotice) -> Fill:
        """How a chain member fills its buffer: from the chain, passing it on
        (and, as its host leader, saying first where its followers copy from);
        of a delta, rebuilt against ``base``, the buffer holding its base."""
        send = notice.send

        def fill(view: torch.Tensor, segment: Segment | None, base: torch.Tensor | None) -> Report:
            if notice.feeds:
                assert segment is not None
                lead = Lead(send.generation, send.version, segment.ref())
                store.set(self.keys.lead(self.rank), encode(lead))
            progress = None if segment is None else segment.filled_to
            return self._member.relay(lambda _: store, notice.link, view, progress, base)

        return fill

    def _follower(self, store: Any, notice: FollowNotice) -> Fill:
        """How a follower fills its buffer: copied from its host leader's shared memory."""
        return lambda view, _, __: follow(store, self.keys, self._mapped, view, notice, self._stop)

    def _take_in(self, store: Any, send: SendInfo, shared: bool, fill: Fill, base: int | None = None) -> None:
        """Receive one update into a free receive buffer (by ``fill``), keep
        it for the receiver if it is whole, and report to the trainer.
        ``base``: the version a delta is taken against, whose buffer is
        kept (and read) while the other is filled."""
        with self._lock:
            # A buffer the receiver does not hold, nor the delta's base; an
            # update pending in it is dropped (the one about to arrive
            # supersedes it).
            base_slot = None if base is None else self._buffers.holding(base)
            free = [s for s in (0, 1) if s != self._taken and s != base_slot]
            if not free:
                # The receiver holds the other buffer: the base cannot be
                # kept, and the member asks for the full bytes.
                assert self._taken is not None
                base_slot, free = None, [1 - self._taken]
            versions = self._buffers.versions
            if len(free) == 1:
                slot = free[0]
            elif self._pending is not None:
                slot = 1 - self._pending.slot
            else:
                # Keep the newer whole version: a later delta's base.
                slot = min(free, key=lambda s: versions[s] or -1)
            if self._pending is not None and self._pending.slot == slot:
                self._pending = None
        base_view = None
        if base_slot is not None:
            held = self._buffers.buffers[base_slot]
            base_view = None if held is None or held.numel() < send.nbytes else held[: send.nbytes]
        self._buffers.versions[slot] = None
        buffer, segment = self._buffers.get(slot, send.nbytes, shared)
        view = buffer[: send.nbytes]
        report = fill_segment(segment, send.version, lambda: fill(view, segment, base_view))
        if report.complete:
            # A partial update is no base for a later delta.
            self._buffers.versions[slot] = send.version if send.subset is None else None
            update = ChainUpdate(
                send.version,
                send.layout_id,
                send.subset,
                send.digests,
                send.threads,
                view,
                slot,
                self._buffers.reads[slot],
            )
            with self._lock:
                self._pending = update
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
        store.set(self.keys.got(send.generation, send.version, self.rank), encode(report))
        store.add(self.keys.got(send.generation, send.version, "count"), 1)
