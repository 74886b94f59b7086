"""Host-local sharing for the torch.distributed transport: one worker of
each host (its *host leader*) is in the chain and receives into shared
memory of its own (a memfd segment), from which the host's other workers
(its *followers*) copy each part as soon as it is there. The bytes cross
the host's NIC once and its memory bus once per worker, instead of once per
worker through the host's loopback. On the trainer's own host the trainer
leads: it stages each send in a segment, and its host's workers copy from
there, with no chain and no socket between them.

The trainer picks the leaders (:func:`plan_hosts`); a worker keeps two
receive buffers (:class:`ReceiveBuffers`), in shared memory while it leads
its host; a follower copies with :func:`follow`. A worker that cannot map
its leader's memory (another user's process) reports :data:`UNMAPPED`, and
the trainer puts it in the chain itself from then on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ..._copy import CopyPlan, PlanCache, copy_tensors
from ..._memory._pinned import PageLocks, host_buffer
from ..._memory._segment import BROKEN, AttachedSegments, Segment
from ..._memory._views import LayoutViews
from ..._packet import Manifest
from ..._readiness import ProcessWatch
from .._chain._driver import Report
from .._chain._pipeline import short_message
from ._protocol import TRAINER, FollowNotice, Lead, SessionKeys, decode, get_now

__all__ = ["UNMAPPED", "BufferReads", "ReceiveBuffers", "fill_segment", "follow", "plan_hosts"]

#: How a follower's report starts when it cannot map its host leader's memory.
UNMAPPED = "it cannot map its host leader's memory"
# A follower's waits for its leader to say where (seconds): the first, and the longest.
_POLL = (0.0005, 0.005)
# A follower's polls of its host leader's progress: a chunk arrives every ~8 ms at 1 Gbit/s.
_FOLLOW_POLL = (0.002, 0.008)


def plan_hosts(
    ordered: list[int],
    host_of: Callable[[int], Hashable | None],
    direct: set[int],
    own: Hashable | None = None,
) -> tuple[list[int], dict[int, tuple[int, ...]]]:
    """The chain over ``ordered`` (ranks in chain order, a host's next to
    each other) with one worker per host, its host leader (the first of its
    host), and the ranks each leader feeds. ``host_of``: a rank's host (None:
    unknown, in the chain itself); ranks in ``direct`` are in the chain
    themselves. ``own``: the trainer's host, whose workers the trainer
    feeds from its staging buffer (they follow :data:`TRAINER`, and none
    of them is in the chain); None: the trainer feeds none."""
    chain: list[int] = []
    fed: dict[int, list[int]] = {}
    leaders: dict[Hashable, int] = {} if own is None else {own: TRAINER}
    for rank in ordered:
        host = host_of(rank)
        if host is None or rank in direct:
            chain.append(rank)
            continue
        leader = leaders.setdefault(host, rank)
        if leader == rank:
            chain.append(rank)
        else:
            fed.setdefault(leader, []).append(rank)
    return chain, {leader: tuple(ranks) for leader, ranks in fed.items()}


class BufferReads:
    """What the receiver derives from one receive buffer, made once for as
    long as the buffer stays (its relay makes a new one with each new
    buffer): the layout's views over it and the copy plan out of them into
    the model. Only the receiver's thread uses it, and only while it holds
    the buffer, which the relay thread then leaves alone."""

    def __init__(self) -> None:
        self._views = LayoutViews()
        self._plans = PlanCache()

    def views(self, buffer: torch.Tensor, manifest: Manifest) -> list[torch.Tensor]:
        """``manifest``'s views over ``buffer`` (this buffer, or a slice of
        it from its start): the same list for as long as the layout stays."""
        return self._views.of(None, manifest, buffer)

    def plan(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> CopyPlan:
        """The copy of ``sources`` (:meth:`views`) into ``targets``: made
        again for other lists, or a target whose data moved."""
        return self._plans.plan(targets, sources)


class ReceiveBuffers:
    """A worker's two receive buffers: the receiver holds at most one, the
    relay thread fills the other. One is in shared memory (a segment its
    followers map) when the worker leads its host."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.segments: list[Segment | None] = [None, None]
        #: The whole version each buffer holds, complete (None: none, or
        #: being written): a delta's base is looked up here.
        self.versions: list[int | None] = [None, None]
        #: What the receiver derives from each buffer (a new one with each
        #: new buffer: nothing made for the one before is kept).
        self.reads: list[BufferReads] = [BufferReads(), BufferReads()]
        #: The worker's model is on a GPU: each buffer is page-locked once,
        #: so that the copy into the model runs at the bus's speed.
        self.pin = False
        self._pins = PageLocks()  # (the buffers not in shared memory; a segment pins itself)

    def holding(self, version: int) -> int | None:
        """The buffer that holds whole version ``version``, if one does."""
        return self.versions.index(version) if version in self.versions else None

    def get(self, slot: int, nbytes: int, shared: bool) -> tuple[torch.Tensor, Segment | None]:
        """Buffer ``slot``, at least ``nbytes`` long, in shared memory if
        ``shared``, and its segment if it is in one."""
        buffer, segment = self.buffers[slot], self.segments[slot]
        if buffer is None or buffer.numel() < nbytes or (shared and segment is None):
            self.buffers[slot] = None
            self.reads[slot] = BufferReads()
            if segment is not None:
                # Mapped by followers, it is unmapped when the last of them lets go.
                segment.close()
                self.segments[slot] = segment = None
            if shared:
                segment = self.segments[slot] = Segment.create(nbytes)
                assert segment.data is not None
                buffer = self.buffers[slot] = segment.data
            elif self.pin:
                buffer = self.buffers[slot] = host_buffer(nbytes)  # (memory of its own to page-lock)
            else:
                buffer = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
            # (The buffer replaced is unregistered: nothing copies from it.)
            private = [b for b, seg in zip(self.buffers, self.segments, strict=True) if seg is None]
            self._pins.keep_only(*private)
        if self.pin:
            if segment is not None:
                segment.pin()
            else:
                self._pins.lock(buffer)
        return buffer, segment

    def close(self) -> None:
        self._pins.release()
        self.versions = [None, None]
        self.buffers = [None, None]
        self.reads = [BufferReads(), BufferReads()]
        for segment in self.segments:
            if segment is not None:
                segment.close()
        self.segments = [None, None]


def fill_segment(segment: Segment | None, version: int, fill: Callable[[], Report]) -> Report:
    """Receive ``version`` by ``fill`` into a buffer of ``segment`` (if
    any), marking it there for followers: being filled, then published
    when whole or broken when not. Blocks while ``fill`` runs."""
    if segment is None:
        return fill()
    # Followers of this send, or a late one of an earlier send, may read it.
    segment.begin_fill(version)
    report = Report(False)
    try:
        report = fill()
    finally:
        if report.complete:
            segment.publish(version)
        else:
            segment.filled_to(BROKEN)
    return report


def follow(
    store: Any,
    keys: SessionKeys,
    mapped: AttachedSegments,
    view: torch.Tensor,
    notice: FollowNotice,
    stop: threading.Event,
) -> Report:
    """Copy the send of ``notice`` into ``view`` from its host leader's
    segment, each part as soon as it is there. Blocks until done, or up to
    ``notice.stall`` seconds for the leader to say where (it does before it
    joins the chain), ``notice.first`` for the first part and
    ``notice.stall`` for each part after. Never raises: a failure is in the report."""
    version, generation = notice.send.version, notice.send.generation
    # (A killed leader is a zombie until its launcher reaps it: dead already.)
    with contextlib.closing(ProcessWatch(notice.leader_pid)) as watch:
        who = "the trainer" if notice.leader == TRAINER else f"its host leader (rank {notice.leader})"
        deadline = time.monotonic() + notice.stall
        delay = _POLL[0]
        while True:
            value = get_now(store, keys.lead(notice.leader))
            if value is not None:
                said = decode(value, Lead)
                if (said.generation, said.version) == (generation, version):
                    break
            if not watch.alive():
                return Report(False, f"{who} died")
            if time.monotonic() > deadline or stop.is_set():
                return Report(False, f"{who} did not start")
            time.sleep(delay)
            delay = min(delay * 2, _POLL[1])
        try:
            source = mapped.segment(said.segment)
        except Exception as exc:  # not this user's, another host after all, out of files...
            return Report(False, f"{UNMAPPED} (rank {notice.leader}): {short_message(exc)}")
        assert source.data is not None
        nbytes = view.numel()
        done, last, limit = 0, time.monotonic(), notice.first
        delay = _FOLLOW_POLL[0]
        while done < nbytes:
            published, writing, filled = source.progress()
            if published == version:
                filled = nbytes
            elif writing != version:
                return Report(False, f"{who} moved on to another version")
            elif filled == BROKEN:
                return Report(False, f"{who} did not get every byte")
            if filled > done:
                # A memmove on this thread: torch's copy_ would wake its
                # intra-op pool, whose cores belong to the worker's own work.
                copy_tensors([view[done:filled]], [source.data[done:filled]])
                done, last, limit, delay = filled, time.monotonic(), notice.stall, _FOLLOW_POLL[0]
                continue
            if time.monotonic() - last > limit or stop.is_set():
                return Report(False, f"{who} stalled {time.monotonic() - last:.1f} s")
            if not watch.alive():
                return Report(False, f"{who} died")
            time.sleep(delay)
            delay = min(delay * 2, _FOLLOW_POLL[1])
        # Not overwritten by another version while it was copied (see Segment.begin_fill).
        if source.progress()[1] != version:
            return Report(False, f"{who} moved on to another version while this worker copied")
        return Report(True)
