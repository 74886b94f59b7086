"""The chain: one send's bytes along a pipelined chain of members, repaired
around the members that fail. Both cross-host transports run on it: the Ray
relay (members: one relay agent per host) and the torch.distributed
transport (members: workers; with host-local sharing, one host leader per
host).

- :class:`ChainDriver` is the trainer's side of every send: it asks the
  transport (a :class:`ChainControl`) which members make the chain, forms a
  group of its link (``_link.ChainLink``: gloo's by default) of the trainer
  (rank 0) and the chain (a new *generation*, over
  a new store prefix, whenever the chain's members change: a group with a
  dead member is dropped, never repaired), tells each member its place (a
  :class:`Link`: the generation, its neighbours, its stall limits and the
  frame size), sends the bytes to the first member and gathers one
  :class:`Report` per member. A chain that broke is re-formed over the
  members still missing the bytes, up to :data:`ATTEMPTS` chains per send,
  within the send's deadline; it records where each chain broke and why, so
  that the transport can say so in the error it raises for a worker.
- :class:`ChainMember` is a member's side: it joins the group of a
  generation once (the trainer forms a new one only when members change),
  then receives the send frame by frame and passes each frame on
  (``_pipeline.relay_chain``), and reports.

The transport owns how members are told and how they answer (Ray calls, or
notices and reports in a TCPStore), and who is in the chain; this module
owns the attempts, the stall limits, the generations and the repair.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch

from ..._copy import usable_cores
from ..._delta import HEADER_SIZE, DeltaDecoder, read_header
from ..._exceptions import DeltaFrameError
from ..._frames import CHUNK_BYTES
from ..._packet import ChainReport
from ._gloo import GLOO
from ._link import ChainLink, PeerGroup
from ._pipeline import (
    ChainBroken,
    relay_chain,
    relay_frames,
    send_chain,
    send_frames,
    short_message,
)

__all__ = [
    "ATTEMPTS",
    "ChainControl",
    "ChainDriver",
    "ChainMember",
    "Encoded",
    "EncodedSend",
    "Link",
    "Report",
    "Route",
    "joining_key",
    "stall_limit",
]

#: Chains per send: the first, then repairs around the members that failed.
ATTEMPTS = 3
# The longest a chain waits for one frame to move before it calls the hop
# broken: this fraction of the time left in the send, within these bounds.
# (At least 1.5 s: a healthy member of a 2-core host under load, its CPU
# taken by a neighbour's restart or a delta's rebuild, was seen to go
# quiet for over 1 s; at 2 s a chain broken by a stopped member was no
# longer repaired within a 5 s send, tests/test_distributed.py.)
_STALL_BOUNDS = (1.5, 5.0)
_STALL_FRACTION = 0.125
# The driver's polls of the members' reports (seconds): the first, and the longest (they double).
_POLL = (0.0005, 0.005)

M = TypeVar("M")


def stall_limit(left: float) -> float:
    """The stall limit of a chain begun with ``left`` seconds left in its send."""
    return min(max(left * _STALL_FRACTION, _STALL_BOUNDS[0]), _STALL_BOUNDS[1])


def joining_key(namespace: str, generation: str, rank: int) -> str:
    """Set by group rank ``rank`` as it joins group ``generation``: tells a
    trainer whose group did not form who never came."""
    return f"{namespace}joining/{generation}/{rank}"


@dataclass(frozen=True)
class Encoded:
    """What a chain of encoded frames carries: a delta against version
    ``base_version`` (``_delta``), ``count`` frames, the chunks cut on
    ``element_size`` bytes. A member rebuilds the send from the base it
    holds; one that does not hold it reports so, and gets the full bytes
    in a later chain."""

    base_version: int
    element_size: int
    count: int
    #: The threads a member rebuilds the chunks on (at most its usable cores).
    threads: int = 1


class EncodedSend(NamedTuple):
    """A send's first chain as encoded frames, for the members that hold its base."""

    encoded: Encoded
    #: The frames, produced as they are sent (the trainer encodes on the chain's thread).
    frames: Callable[[], Iterable[bytes]]
    #: The members believed to hold the base; the others start with the full bytes.
    eligible: Collection[Any]


@dataclass(frozen=True)
class Link:
    """A member's place in one chain: what it needs to take part (its
    transport carries it in the member's notice)."""

    #: Where the chain's keys live in the store: the group's own under
    #: ``{namespace}{generation}/``, and :func:`joining_key`.
    namespace: str
    #: The chain's group; a member keeps its group while this stays.
    generation: str
    #: This member's rank in the group (1 .. size - 1; the trainer is 0).
    rank: int
    size: int
    #: How long a hop may stall, and how long to wait for the first frame.
    stall: float
    first: float
    #: The frame size: every frame but the last is this many bytes (of an
    #: encoded chain: every chunk but the last, before encoding).
    chunk: int
    #: Encoded frames instead of the bytes themselves (None: the bytes).
    encoded: Encoded | None = None

    @property
    def src(self) -> int:
        return self.rank - 1

    @property
    def dst(self) -> int | None:
        return self.rank + 1 if self.rank + 1 < self.size else None


class Report(NamedTuple):
    """A member's word on one chain."""

    #: It holds every byte of the send.
    complete: bool
    #: Why it does not, or why the hop after it failed (it may still be complete).
    error: str | None = None
    #: It is gone (its process died, its agent was lost): not in the next chain.
    gone: bool = False
    #: Of an encoded chain: the CPU seconds its rebuild took, over its threads,
    #: and how many threads it used.
    rebuild: tuple[float, int] | None = None


@dataclass
class Route(Generic[M]):
    """One chain of a send: its generation, its members in order, whom each
    of them feeds outside the chain (host-local followers), and its limits."""

    namespace: str
    generation: str
    chain: tuple[M, ...]
    fed: dict[M, tuple[M, ...]]
    stall: float
    chunk: int
    #: Where it broke and why (None: it did not), once its reports are in.
    broke: str | None = field(default=None)
    #: It carries encoded frames (None: the bytes).
    encoded: Encoded | None = None
    #: Once it ran: the bytes the trainer put on it, and the seconds from
    #: its first frame until every member's report came (or the chain broke).
    sent: int = field(default=0)
    seconds: float = field(default=0.0)
    #: Its group was formed for it: its first frames also paid for the
    #: connections (made on first use), so its time is not the link's.
    fresh: bool = field(default=False)

    @property
    def first(self) -> float:
        """How long a member waits for its first frame: the chain may still
        be filling (and its connections are made on first use)."""
        return 2 * self.stall

    def link(self, member: M) -> Link:
        """``member``'s place in this chain (a member of :attr:`chain`)."""
        return Link(
            self.namespace, self.generation, self.chain.index(member) + 1, len(self.chain) + 1,
            self.stall, self.first, self.chunk, self.encoded,
        )  # fmt: skip

    @property
    def everyone(self) -> list[M]:
        """The members of the chain, then those they feed."""
        return [*self.chain, *(m for fed in self.fed.values() for m in fed)]


class ChainControl(Protocol[M]):
    """What a transport gives the chain driver: who can be in a chain, how
    its members are told, and how their reports come back. Called from the
    driver's thread only."""

    #: The prefix of the chain's keys in the store (see :class:`Link`).
    namespace: str
    #: The address the trainer's end of the chain binds to.
    address: str

    def group_store(self, stall: float) -> Any:
        """A client of the store the members' groups meet in."""

    def plan(self, members: list[M]) -> tuple[list[M], dict[M, tuple[M, ...]]]:
        """The chain over those of ``members`` that can take part, in chain
        order, and whom each of them feeds outside the chain."""

    def name(self, member: M) -> str:
        """``member`` as an error message names it (``"rank 3 (host h3)"``)."""

    def launch(self, route: Route[M]) -> None:
        """Tell every member of ``route`` to take part (never waits for them)."""

    def poll(self, route: Route[M], waiting: Collection[M], wait: float) -> list[tuple[M, Report]]:
        """The reports of ``waiting`` members that came, waiting up to
        ``wait`` seconds for one; a member found gone is reported as such."""

    def settle(self, route: Route[M]) -> None:
        """The driver is done with ``route``'s reports (late ones are dropped)."""


class ChainDriver(Generic[M]):
    """The trainer's side of the chain of one transport: the group, its
    generations, and each send's chains (:meth:`run`).

    ``min_chain``: the fewest members worth a chain (fewer: the transport
    serves them another way).
    """

    def __init__(
        self,
        control: ChainControl[M],
        *,
        chunk: int = CHUNK_BYTES,
        min_chain: int = 1,
        link: ChainLink = GLOO,
    ) -> None:
        self.control = control
        #: What moves the frames between two ranks of a chain.
        self.link = link
        self.chunk = chunk
        self.min_chain = min_chain
        self._group: Any = None
        self._group_members: tuple[M, ...] = ()
        self._generations = 0
        self._closed = False
        # The send of the running run() is over (its every member answered
        # the trainer, or its deadline passed): the run stops.
        self._over = False
        #: Per send: every chain that ran, in order.
        self.routes: list[Route[M]] = []
        #: Per send: member -> True (it got every byte) or why not.
        self.outcome: dict[M, bool | str] = {}
        #: Per send: the bytes the trainer put on the chains (frames with their headers).
        self.sent_bytes = 0
        #: Per send: member -> its rebuild's CPU seconds and threads (an encoded chain's).
        self.rebuilds: dict[M, tuple[float, int]] = {}
        # Per send: member -> where the chain it missed broke.
        self._broke_for: dict[M, str] = {}
        # The members whose report on the running chain has not come, and since when.
        self._silent: tuple[set[M], float] = (set(), 0.0)

    def report(self, choice: Any = None) -> ChainReport:
        """How the chains of the current send carried it, so far (``choice``:
        the delta's ``DeltaChoice``, if any)."""
        routes = self.routes
        return ChainReport(
            tuple((route.chain, dict(route.fed)) for route in routes),
            self.sent_bytes,
            tuple(route.encoded is not None for route in routes),
            tuple(route.sent for route in routes),
            {} if choice is None else choice.summary(),
        )

    def why(self, member: M) -> str | None:
        """Why ``member`` did not get the last send (None: it did, or it was
        not in it), with where its chain broke when known."""
        outcome = self.outcome.get(member)
        silent, since = self._silent
        if outcome is None and member in silent:
            # (Asked at the send's deadline, which is also the chain's.)
            return f"it had not reported on its chain after {time.monotonic() - since:.1f} s"
        if outcome is None or outcome is True:
            return None
        where = self._broke_for.get(member)
        return f"{outcome}; {where}" if where else str(outcome)

    def forget(self) -> None:
        """Forget the last send's outcome (a new send begins); its routes stay until it runs."""
        self.outcome, self._broke_for, self._silent = {}, {}, (set(), 0.0)
        self._over = False

    def run(
        self,
        sources: Sequence[torch.Tensor],
        members: Sequence[M],
        deadline: float,
        encoded: Sequence[EncodedSend] = (),
        ready: Callable[[int], object] | None = None,
    ) -> None:
        """Send the concatenation of ``sources`` (flat uint8 tensors) to
        ``members``, along chains, until each has it, each left has failed
        (:attr:`outcome` says why), or ``deadline`` (``time.monotonic()``).
        Each of ``encoded`` (deltas against different bases), in order,
        is first carried by a chain of its own to the members of the send
        that hold its base; every later chain (the others, and repairs)
        carries the bytes themselves. ``ready(n)``: returns once the first
        ``n`` bytes of the sources are there, before a frame of the bytes
        leaves (see ``_pipeline.send_chain``). Blocks; never raises (a
        failure is an outcome)."""
        self.routes, self.outcome, self._broke_for, self._silent = [], {}, {}, (set(), 0.0)
        self.sent_bytes, self.rebuilds = 0, {}
        try:
            self._chains(sources, list(members), deadline, encoded, ready)
        except Exception as exc:  # the store or gloo failed outright
            for member in members:
                self.outcome.setdefault(member, f"the chain failed: {short_message(exc)}")
            self.drop()

    def _chains(
        self,
        sources: Sequence[torch.Tensor],
        pending: list[M],
        deadline: float,
        encoded: Sequence[EncodedSend],
        ready: Callable[[int], object] | None,
    ) -> None:
        control = self.control
        nbytes = sum(s.numel() for s in sources)
        excluded: set[M] = set()
        # The encoded chains come first, one per base (each member holds at
        # most one); they are not repairs, so they do not use up attempts.
        deltas = list(encoded) if nbytes else []
        for _ in range(ATTEMPTS + max(len(deltas) - 1, 0)):
            candidates = [m for m in pending if m not in excluded]
            use: EncodedSend | None = None
            while deltas and use is None:
                use = deltas.pop(0)
                holders = [m for m in candidates if m in use.eligible]
                candidates, use = (holders, use) if holders else (candidates, None)
            chain, fed = control.plan(candidates)
            left = deadline - time.monotonic()
            if (len(chain) < self.min_chain and not fed) or left <= 0 or self._closed or self._over:
                return
            # Nothing of a chain outlives the send's deadline: its stalls are
            # cut to the time left, and its frames stop at the deadline (a
            # thread of an abandoned send would hold the next one's staging).
            stall = min(stall_limit(left), left)
            # No chain (every member of the send follows the trainer itself):
            # no group, no frames; the group kept stays for the next chain.
            chained = bool(chain)
            if chained and (self._group is None or self._group_members != tuple(chain)):
                self.drop()
                self._generations += 1
            route = Route(
                control.namespace, f"g{self._generations}", tuple(chain), fed, stall, self.chunk,
                encoded=None if use is None else use.encoded,
            )  # fmt: skip
            control.launch(route)
            if chained and self._group is None:
                route.fresh = True
                absent = self._form(route)
                if self._group is None:
                    excluded |= absent
                    continue
            self.routes.append(route)
            sent_error: str | None = None
            before, began = self.sent_bytes, time.monotonic()
            if nbytes and chained:
                try:
                    if use is not None:
                        count = use.encoded.count
                        frames = self._counted(use.frames())
                        send_frames(
                            self._group,
                            frames,
                            HEADER_SIZE,
                            1,
                            stall,
                            count,
                            until=deadline,
                            stopped=self._stopped,
                        )
                    else:
                        self.sent_bytes += nbytes
                        send_chain(
                            self._group,
                            sources,
                            self.chunk,
                            1,
                            stall,
                            ready,
                            until=deadline,
                            stopped=self._stopped,
                        )
                except RuntimeError as exc:
                    sent_error = str(exc)
                    # Without the trainer's bytes no member can complete: the
                    # group goes now, so that the members still waiting on it
                    # (one that joined late, for a frame that will not come)
                    # fail at once and report, and are in the next chain,
                    # rather than silent until their own limits, and left out.
                    self.drop()
            sending = time.monotonic() - began
            reports, waiting = self._gather(route, deadline, broken=sent_error is not None)
            route.sent, route.seconds = self.sent_bytes - before, time.monotonic() - began
            for member, report in reports.items():
                if report.rebuild is not None:
                    self.rebuilds[member] = report.rebuild
            for member, report in reports.items():
                if report.gone:
                    excluded.add(member)
                elif report.complete:
                    pending.remove(member)
            # One that never answered is stopped, cut off or dead: not in the next chain.
            excluded |= waiting
            for member in waiting:
                silence = f"it did not report on its chain within {time.monotonic() - began - sending:.1f} s"
                self.outcome.setdefault(member, silence)
            route.broke = self._where(route, reports, sent_error)
            if route.broke is not None:
                for member in route.everyone:
                    if self.outcome.get(member) is not True:
                        self._broke_for[member] = route.broke
            if route.broke is not None or waiting:
                self.drop()
            if not pending:
                return

    def _counted(self, frames: Iterable[bytes]) -> Iterator[bytes]:
        for frame in frames:
            self.sent_bytes += len(frame)
            yield frame

    def _form(self, route: Route[M]) -> set[M]:
        """Form the trainer's end of ``route``'s group (after its members
        were told). Returns the members that never came (none: it formed),
        when not every member joined within the stall limit."""
        control, chain = self.control, route.chain
        prefix = f"{route.namespace}{route.generation}/"
        try:
            self._group = self.link.form(
                control.group_store(route.stall), prefix, 0, len(chain) + 1, control.address, route.stall
            )
            self._group_members = chain
            return set()
        except RuntimeError:
            self.drop()
        store = control.group_store(route.stall)
        absent = {
            m
            for i, m in enumerate(chain)
            if not store.check([joining_key(route.namespace, route.generation, i + 1)])
        }
        names = ", ".join(control.name(m) for m in chain if m in absent) or "no member"
        route.broke = f"the chain's group did not form ({names} did not join within {route.stall:.1f} s)"
        for member in absent:
            self.outcome[member] = "it did not join the chain"
            self._broke_for[member] = route.broke
        # (Those that joined are tried again in the next chain.)
        return absent

    def _gather(self, route: Route[M], deadline: float, *, broken: bool) -> tuple[dict[M, Report], set[M]]:
        """Every member's report of ``route``, or, once the chain broke,
        those that answer within a stall limit more (the others' own waits
        give up within one); the members that did not answer."""
        control, chain = self.control, route.chain
        waiting = set(route.everyone)
        self._silent = (waiting, time.monotonic())
        reports: dict[M, Report] = {}

        def give_up_soon() -> float:
            return min(deadline, time.monotonic() + route.stall + 1.0)

        patience = give_up_soon() if broken else deadline
        delay = _POLL[0]
        try:
            while waiting and time.monotonic() < patience and not self._closed and not self._over:
                came = control.poll(route, waiting, min(delay, max(patience - time.monotonic(), 0.0)))
                delay = min(delay * 2, _POLL[1])
                for member, report in came:
                    waiting.discard(member)
                    reports[member] = report
                    if report.gone:
                        self.outcome[member] = report.error or "it died during the chain"
                        # Dead: it will never answer, and the chain broke at it.
                        broken = broken or member in chain
                        continue
                    if report.complete:
                        self.outcome[member] = True
                    else:
                        self.outcome[member] = f"the chain broke before it got every byte ({report.error})"
                    # (A follower's failure leaves the chain as it was.)
                    if (not report.complete or report.error is not None) and not broken and member in chain:
                        broken = True
                        patience = min(patience, give_up_soon())
        finally:
            control.settle(route)
            self._silent = (set(), 0.0)
        return reports, waiting

    def _where(self, route: Route[M], reports: dict[M, Report], sent_error: str | None) -> str | None:
        """Where ``route`` broke and why (None: it did not). A stall spreads
        back along the chain (a member that cannot pass a frame on stops
        taking frames in), so the break is put at the first member that
        went silent or died, else at the first that did not get every
        byte; the why is the word of the hop into it (the stall seen by the
        member before it), else of the hop out of it, else its own."""
        chain = route.chain

        def error(i: int) -> str | None:
            if i < 0:
                return sent_error
            report = reports.get(chain[i]) if i < len(chain) else None
            return None if report is None else report.error

        lost = [i for i, m in enumerate(chain) if m not in reports or reports[m].gone]
        short = [i for i, m in enumerate(chain) if m in reports and not reports[m].complete]
        if not lost and not short:
            return None
        i = (lost or short)[0]
        report = reports.get(chain[i])
        if report is None:
            detail = error(i - 1) or error(i + 1) or "it did not report"
        elif report.gone:
            detail = report.error or "it died"
        else:
            detail = error(i - 1) or report.error or "it did not get every byte"
        return f"the chain broke at {self.control.name(chain[i])}: {detail}"

    def _stopped(self) -> bool:
        return self._over or self._closed

    def end_send(self) -> None:
        """The send of the running :meth:`run` is over for the trainer (every
        member answered, or its deadline passed): the run ends at its next
        step (a wait for the members' reports, a chain to begin), not at the
        deadline, so that the next send's staging never waits for it."""
        self._over = True

    def drop(self) -> None:
        """Let go of the group: the next chain forms a new one."""
        self._group, self._group_members = None, ()

    def close(self) -> None:
        """Stop: a running :meth:`run` ends within a stall limit. Idempotent."""
        self._closed = True
        self.drop()


class ChainMember:
    """A member's side of the chains it is told to take part in: its end of
    the group of the current generation (bound to ``address``), and the
    relay of one send (:meth:`relay`). Its calls may come from several
    threads; one send at a time is relayed into a given buffer."""

    def __init__(self, address: str, link: ChainLink = GLOO) -> None:
        self.address = address
        #: What moves the frames (the trainer's driver uses the same kind).
        self.link = link
        self._group: PeerGroup | None = None
        self._generation: tuple[str, str] | None = None

    def relay(
        self,
        store: Callable[[float], Any],
        link: Link,
        buffer: torch.Tensor,
        progress: Callable[[int], None] | None = None,
        base: torch.Tensor | None = None,
    ) -> Report:
        """Take part in the chain of ``link``: join its group if it is a new
        generation (``store(timeout)`` gives a client of the store it meets
        in), receive ``buffer`` frame by frame and pass each frame on. Blocks
        until the send ended here, or a hop failed (within ``link``'s stall
        limits). ``progress``: called with the leading bytes in, after each
        frame. Never raises for a failed hop or group: it is in the report.

        Of an encoded chain (``link.encoded``), the frames are passed on as
        they came and rebuilt here into ``buffer`` against ``base`` (the
        base version's bytes, ``buffer`` itself or another buffer; None:
        this member does not hold it), each chunk checked against the
        trainer's digest; one that cannot be rebuilt makes the report
        incomplete (the buffer no longer holds a base), and the member gets
        the full bytes in a later chain."""
        generation = (link.namespace, link.generation)
        group = self._group if self._generation == generation else None
        if group is None:
            self.leave()
            try:
                client = store(link.stall)
                client.set(joining_key(link.namespace, link.generation, link.rank), b"1")
                group = self.link.form(
                    client,
                    f"{link.namespace}{link.generation}/",
                    link.rank,
                    link.size,
                    self.address,
                    link.stall,
                )
            except RuntimeError as exc:
                return Report(False, f"no group: {short_message(exc)}")
            self._group, self._generation = group, generation
        rebuilt: str | None = None
        if link.encoded is None:
            complete, error = relay_chain(
                group, buffer, link.chunk, link.src, link.dst, link.stall, link.first, progress
            )
        else:
            rebuild = _Rebuild(buffer, base, link, progress)
            try:
                complete, error = relay_frames(
                    group, link.encoded.count, HEADER_SIZE, rebuild.payload_length, link.src, link.dst,
                    link.stall, link.first, rebuild.feed,
                )  # fmt: skip
            finally:
                rebuild.finish()
            rebuilt = rebuild.error
        if error is not None and self._generation == generation:
            self.leave()
        if rebuilt is not None:
            # The chain itself is whole: the frames went on to the next member.
            return Report(False, f"it could not rebuild the delta: {rebuilt}")
        return Report(complete, error, rebuild=None if link.encoded is None else rebuild.cost)

    def leave(self) -> None:
        """Let go of the group (the next generation forms a new one)."""
        self._group, self._generation = None, None


class _Rebuild:
    """A member's rebuilding of an encoded chain's frames into its buffer,
    frame by frame as they arrive (each passed on first), its chunks
    rebuilt off the relay's thread, in parallel on ``link.encoded.threads``
    threads (at most its usable cores); the first failure stops it (later
    frames are still passed on) and is kept in :attr:`error`."""

    def __init__(
        self,
        buffer: torch.Tensor,
        base: torch.Tensor | None,
        link: Link,
        progress: Callable[[int], None] | None,
    ) -> None:
        assert link.encoded is not None
        self.progress = progress
        self.error: str | None = None
        self.base_version = link.encoded.base_version
        self._holds_base = base is not None
        self.threads = max(1, min(link.encoded.threads, usable_cores()))
        self._decoder = DeltaDecoder(
            buffer,
            link.encoded.element_size,
            chunk_bytes=link.chunk,
            base=None if base is None or base.data_ptr() == buffer.data_ptr() else base,
            threads=self.threads,
            # Off the relay's thread, which then posts the next frame's
            # receive at once (the frames' transfer overlaps the rebuild).
            background=True,
        )
        if len(self._decoder.spans) != link.encoded.count:
            self.error = f"{link.encoded.count} frames for {len(self._decoder.spans)} chunks"

    @property
    def cost(self) -> tuple[float, int]:
        """The rebuild's CPU seconds, over its threads, and its threads."""
        return self._decoder.cpu, self.threads

    @staticmethod
    def payload_length(header: torch.Tensor) -> int:
        """A frame's payload length from its header.

        :raises ChainBroken: not a frame header (the chain is out of step).
        """
        try:
            return read_header(header.numpy()).payload_length
        except DeltaFrameError as exc:
            raise ChainBroken(f"a damaged frame header: {exc}") from exc

    def feed(self, index: int, frame: torch.Tensor) -> None:
        if self.error is not None:
            return
        try:
            data = frame.numpy()
            if not self._holds_base and read_header(data).mode.needs_base:
                raise DeltaFrameError(f"it does not hold version {self.base_version}, the delta's base")
            self._decoder.feed(data)
            decoded = self._decoder.decoded
        except DeltaFrameError as exc:
            self._fail(exc)
            return
        if self.progress is not None and decoded:
            self.progress(decoded)

    def finish(self) -> None:
        """Wait for the chunks still being rebuilt (the threads end)."""
        try:
            self._decoder.finish()
        except DeltaFrameError as exc:
            self._fail(exc)
            return
        if self.error is None and self.progress is not None and self._decoder.done:
            self.progress(self._decoder.decoded)

    def _fail(self, exc: DeltaFrameError) -> None:
        if self.error is None:
            self.error = str(exc)
        self._decoder.finish_quietly()
