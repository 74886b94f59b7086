"""A sender group: the ranks of a sharded trainer, each sending its own part
of every version (``_shards``) over a session of its own, and its workers,
which put the parts of one version together before anything is applied.

Keys (beside each session's, ``_protocol``)::

    weightsync/<model>/session            rank 0: b"group:<gid>" (a worker
                                          that reads it takes every part)
    weightsync/<model>/group/<gid>        rank 0: a :class:`GroupRecord`
    .../<gid>/want/<worker rank>          each worker: its :class:`Want`
    .../<gid>/plan                        rank 0: a :class:`GroupPlan`
    .../<gid>/outcome/<seq>/<rank>        each rank: its :class:`Outcome` of send seq
    .../<gid>/commit/<group>/<round>/<worker rank>
                                          a tensor-parallel group's members:
                                          the version each holds whole

The plan is made once, at the group's first ``connect()`` or send, from
every worker's want: the workers that hold the same boxes are a class
(``_shards.classes_of``), and every rank opens one session per class it
has bytes for, whose chain carries that class's cut of its part only.

Trainer side (:class:`SenderGroup`): every rank sends its part as the same
version (the group's send count), then publishes its outcome and reads the
others', up to the send's deadline and :data:`GRACE` more; every rank then
returns the same report, or raises the same error (:func:`merge`). A rank
that published nothing by then (it died, was stopped, or was interrupted)
is named on every other rank (:class:`SenderGroupError`).

Worker side (:class:`PartsEndpoint`): it says what it holds (its want),
then, once the plan is out, one ``ChainEndpoint`` per trainer rank that
sends its class anything, each taking part in its rank's chains with its
own relay thread and receive buffers; :meth:`PartsEndpoint.next_update`
hands the receiver a :class:`PartsUpdate` only once every part holds the
same version (each checked against its rank's digests, with ``verify``),
and the receiver writes all of it at its safe point, or nothing. Its ack
goes to every rank it takes from.

The members of a tensor-parallel group (workers whose model's DTensors
share one mesh) switch versions together (:class:`Commit`): every
``receive()`` of theirs is one round, in which each says which version it
holds whole, and each applies a version only where every member holds it.
Their ``receive()`` calls are collective, as their forward calls are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch

from ..._digest import mismatched
from ..._exceptions import (
    SenderClosedError,
    SenderGroupError,
    SenderLostError,
    WaitTimeoutError,
    WeightMismatchError,
)
from ..._packet import Manifest, Signature
from ..._shards import Boxes, Part, Want, part_signature, pieces_misfit, place, sub_part, whole_part
from .._chain._gloo import connect_store
from .._chain._pipeline import short_message
from ._protocol import get_now, session_key, wait_key
from ._relay import ChainUpdate
from ._transport import ChainEndpoint

__all__ = [
    "GRACE",
    "GROUP_MARK",
    "Commit",
    "GroupPlan",
    "GroupRecord",
    "PartsEndpoint",
    "PartsUpdate",
    "SenderGroup",
    "worker_endpoint",
]

#: What a worker finds under the model's session key when a sender group sends it.
GROUP_MARK = b"group:"
#: How long past a send's deadline a rank waits for the others' outcomes
#: (s): their calls may have begun a little later than its own; a rank that
#: is silent is named within the deadline and 3 s, this and the merge.
GRACE = 2.5
# A member's word in its group's round when the sender group shut down,
# or is gone (the lower wins).
_CLOSED, _LOST = -1, -2
# Polls of the others' outcomes (seconds): the first, and the longest.
_POLL = (0.0005, 0.002)
# How often a rank whose outcome has not come is looked at (its beacon), and
# how long a look may take (s).
_PROBE = 0.25
_PROBE_WAIT = 0.25


def _read_all(
    store: Any,
    keys: dict[int, str],
    until: float,
    longest: float,
    dead: Callable[[int], bool] | None = None,
) -> tuple[dict[int, bytes], set[int]]:
    """The values of ``keys`` (by label), polled (every ``_POLL[0]`` s,
    doubling up to ``longest``) until all are set or ``until``
    (``time.monotonic()``): those set by then; and the labels whose
    ``dead(label)`` said, at one of its looks (every :data:`_PROBE` s), that
    no value will ever come (they are waited for no more)."""
    got: dict[int, bytes] = {}
    gone: set[int] = set()
    delay = _POLL[0]
    probe = time.monotonic() + _PROBE
    while True:
        for label, key in keys.items():
            if label not in got and label not in gone and (value := get_now(store, key)) is not None:
                got[label] = value
        if len(got) + len(gone) == len(keys) or time.monotonic() >= until:
            return got, gone
        if dead is not None and time.monotonic() >= probe:
            for label, key in keys.items():
                # (Read once more after the look: it may have said its value
                # and ended since the read above.)
                if label not in got and label not in gone and dead(label):
                    value = get_now(store, key)
                    if value is not None:
                        got[label] = value
                    else:
                        gone.add(label)
            probe = time.monotonic() + _PROBE
            continue
        time.sleep(delay)
        delay = min(delay * 2, longest)


def group_key(model_id: str | None, gid: str) -> str:
    return f"weightsync/{model_id}/group/{gid}"


@dataclasses.dataclass(frozen=True)
class GroupRecord:
    """What a worker reads of a sender group at init: its id, and each
    rank's part, by trainer rank."""

    gid: str
    parts: tuple[Part, ...]


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """Who takes what: the classes (the boxes their workers hold, None for
    whole tensors, and their worker ranks), and each rank's session for
    each class (``sessions[rank][class]``; None: the rank sends that class
    nothing)."""

    classes: tuple[tuple[Boxes | None, tuple[int, ...]], ...]
    sessions: tuple[tuple[str | None, ...], ...]
    #: Per class: its bytes come from rank 0 alone, out of the host buffer
    #: every rank writes its part into (``_host_group``): its workers take
    #: one part, :func:`~weightsync._shards.whole_part`.
    shared: tuple[bool, ...]

    def class_of(self, rank: int) -> int:
        return next(i for i, (_, ranks) in enumerate(self.classes) if rank in ranks)


class SenderGroup:
    """One trainer rank's side of a sender group: its rank and the group's
    size, the parts, and the exchange of outcomes over the store."""

    def __init__(
        self,
        model_id: str | None,
        store_address: tuple[str, int],
        gid: str,
        rank: int,
        size: int,
        parts: tuple[Part, ...],
        timeout: float,
        host: str,
    ) -> None:
        self.model_id = model_id
        self.gid = gid
        self.rank = rank
        self.size = size
        self.parts = parts
        #: Sends made (each rank counts its own calls: the same on all).
        self.seq = 0
        # A client of its own: the exchange never waits behind the chain's calls.
        self._store: Any = connect_store(*store_address, timeout=timeout)
        self._prefix = group_key(model_id, gid)
        # This rank's beacon: a listening socket nobody talks to. While the
        # process lives a connect to it succeeds (a stopped process's too:
        # the kernel answers); once it died the kernel refuses, and the
        # other ranks name it at once, not at the send's deadline.
        self._beacon = socket.create_server((host, 0))
        self._beacon.setblocking(False)
        where = self._beacon.getsockname()
        if where[0] not in ("0.0.0.0", "::"):
            # (A wildcard address names no host the others could look at:
            # such a rank is waited for until the deadline, as one stopped.)
            self._store.set(self._beacon_key(rank), f"{where[0]}:{where[1]}".encode())
        self._beacons: dict[int, tuple[str, int]] = {}

    @property
    def part(self) -> Part:
        return self.parts[self.rank]

    def publish(self) -> None:
        """(Rank 0, at init.) Tell the workers the group and its parts."""
        self._store.set(self._prefix, pickle.dumps(GroupRecord(self.gid, self.parts)))
        self._store.set(session_key(self.model_id), GROUP_MARK + self.gid.encode())

    def wants(self, ranks: Sequence[int], until: float) -> dict[int, Want]:
        """(Rank 0.) What each worker (``ranks``) holds, as each said at its
        init, polled until ``until`` (``time.monotonic()``): those that said."""
        said, _ = _read_all(self._store, {r: f"{self._prefix}/want/{r}" for r in ranks}, until, 0.05)
        return {rank: pickle.loads(value) for rank, value in said.items()}

    def publish_plan(self, plan: GroupPlan) -> None:
        """(Rank 0, once every rank's sessions are up.) Tell the workers."""
        self._store.set(f"{self._prefix}/plan", pickle.dumps(plan))

    def _outcome_key(self, seq: int, rank: int) -> str:
        return f"{self._prefix}/outcome/{seq}/{rank}"

    def _staged_key(self, seq: int, rank: int) -> str:
        return f"{self._prefix}/staged/{seq}/{rank}"

    def staged(self, seq: int, error: BaseException | None) -> None:
        """(A rank other than 0, of a group that shares host buffers,
        ``_host_group``.) Say that this rank's part of send ``seq`` is in
        them, or why not (``error``)."""
        said = b"" if error is None else f"{type(error).__name__}: {error}".encode()
        with contextlib.suppress(RuntimeError):  # (the store is gone: rank 0 is named then)
            self._store.set(self._staged_key(seq, self.rank), said)

    def wait_staged(self, seq: int, until: float) -> None:
        """(Rank 0.) Wait until every other rank said its part of send
        ``seq`` is in the host buffers, up to ``until`` (``time.monotonic()``).

        :raises SenderGroupError: a rank could not write its part (what it
            raised), died, or did not say in time (stopped, or slow): none
            of the version is published.
        """
        others = {r: self._staged_key(seq, r) for r in range(1, self.size)}
        said, dead = _read_all(self._store, others, until, _POLL[1], self._dead)
        for key in (others[r] for r in said):
            self._store.delete_key(key)
        reasons = {r: value.decode() for r, value in said.items() if value}
        reasons.update({r: "died (its process is gone)" for r in dead})
        reasons.update({r: "did not say in time" for r in others if r not in said and r not in dead})
        if reasons:
            raise SenderGroupError(
                f"send {seq}: rank(s) {', '.join(map(str, sorted(reasons)))} did not write their part into "
                f"the host's buffer ({'; '.join(f'rank {r}: {why}' for r, why in sorted(reasons.items()))}); "
                "no worker was told of this version",
                ranks=tuple(sorted(reasons)),
                reasons=reasons,
                model_id=self.model_id,
            )

    def _beacon_key(self, rank: int) -> str:
        return f"{self._prefix}/beacon/{rank}"

    def _dead(self, rank: int) -> bool:
        """Whether rank ``rank``'s process is gone: its beacon refused a
        connection. (No answer in time, an unreachable host: not known, so
        not dead.)"""
        where = self._beacons.get(rank)
        if where is None:
            value = get_now(self._store, self._beacon_key(rank))
            if value is None:
                return False
            host, _, port = value.decode().rpartition(":")
            where = self._beacons[rank] = (host, int(port))
        try:
            socket.create_connection(where, timeout=_PROBE_WAIT).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return False

    def _drain(self) -> None:
        """Let go of the other ranks' looks at this rank's beacon."""
        while True:
            try:
                conn, _ = self._beacon.accept()
            except OSError:
                return
            conn.close()

    def exchange(self, seq: int, outcome: Any, until: float) -> tuple[dict[int, Any], set[int]]:
        """Publish this rank's ``outcome`` of send ``seq`` (anything that
        pickles) and read every other rank's, until ``until``
        (``time.monotonic()``); those that came, by rank, and the ranks
        found dead meanwhile (their process is gone: none will come)."""
        got = {self.rank: outcome}
        dead: set[int] = set()
        try:
            self._drain()
            self._store.set(self._outcome_key(seq, self.rank), pickle.dumps(outcome))
            others = {r: self._outcome_key(seq, r) for r in range(self.size) if r != self.rank}
            said, dead = _read_all(self._store, others, until, _POLL[1], self._dead)
            got.update({rank: pickle.loads(value) for rank, value in said.items()})
            if seq > 1:
                # Every rank read this rank's outcome of the send before: each
                # published this one's, which it does only after reading them.
                self._store.delete_key(self._outcome_key(seq - 1, self.rank))
        except RuntimeError:
            # The store is gone (its rank died or shut down): the ranks not
            # heard from are named as such.
            pass
        return got, dead

    def close(self, owner: bool) -> None:
        """Sign off; the rank that runs the store (``owner``) first waits,
        up to :data:`GRACE` s, for every other rank to sign off: each has
        read every outcome it waits for, so none loses the store in the
        middle of an exchange. Idempotent."""
        store, self._store = self._store, None
        if store is None:
            return
        self._beacon.close()
        try:
            store.set(f"{self._prefix}/closed/{self.rank}", b"1")
            until = time.monotonic() + GRACE
            others = [f"{self._prefix}/closed/{r}" for r in range(self.size) if r != self.rank]
            while owner and others and time.monotonic() < until:
                others = [key for key in others if not store.check([key])]
                time.sleep(0.01)
        except RuntimeError:
            pass  # (the store is gone already: nothing to wait for)


# -- a worker's side ------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class PartsUpdate:
    """Every part of one version, each in a receive buffer of its rank's
    relay: written into the model's tensors, each piece into its box (of
    the whole tensor, or of the box the worker holds)."""

    version: int
    layout_id: str
    threads: int
    parts: tuple[Part, ...]
    manifests: tuple[Manifest, ...]
    updates: tuple[ChainUpdate, ...]
    want: Want
    subset: Signature | None = None
    #: Each part was checked against its rank's digests as it was put together.
    digests: tuple[int, ...] | None = None
    checked_on_host = False

    def check_mapping(self, manifest: Manifest) -> str | None:
        return None

    def is_current(self) -> bool:
        # Its buffers are never rewritten while the receiver holds them.
        return True

    def sources(self, manifest: Manifest) -> list[torch.Tensor]:
        return []  # (no digests: each part was checked as it came)

    def apply(self, model: Any, targets: list[torch.Tensor], manifest: Manifest) -> None:
        by_name = dict(zip(manifest.names, targets, strict=True))
        parts = [
            (part, update.sources(part_manifest))
            for part, part_manifest, update in zip(self.parts, self.manifests, self.updates, strict=True)
        ]
        with torch.no_grad():
            place(by_name, parts, self.want, threads=self.threads)


class Commit:
    """A tensor-parallel group's agreement on the version its members apply.

    Each member's ``receive()`` is one round: it says the newest version it
    holds whole (0: none), waits for every other member's word of the same
    round, and applies only the oldest of them, and only if that is the one
    it holds: every member decides alike, at the same call, so none runs a
    forward on a version the others do not have. A member that missed a
    version holds the group back from it, never into a mix. Rounds are
    counted by each member, so a member's ``receive()`` calls must match the
    others' one for one (as their forward calls do)."""

    def __init__(self, store: Any, prefix: str, members: tuple[int, ...], rank: int, wait: float) -> None:
        self._store = store
        self._prefix = f"{prefix}/commit/{members[0]}"
        self.members = members
        self.rank = rank
        self.wait = wait
        self.round = 0

    def _key(self, round_: int, rank: int) -> str:
        return f"{self._prefix}/{round_}/{rank}"

    async def agree(self, holds: int) -> int:
        """This round's version: the oldest the members hold whole.

        :raises WaitTimeoutError: a member did not come to this round within
            the scheme's timeout (it died, hangs, or calls ``receive()`` at
            other points than this one).
        :raises SenderLostError: the trainer's store is gone.
        """
        try:
            return await self._agree(holds)
        except (RuntimeError, OSError) as exc:  # (the store's errors)
            raise SenderLostError(
                f"the store of this worker's tensor-parallel group {list(self.members)} is gone "
                f"({short_message(exc)}; its first member, or the trainer, ended): the group cannot "
                "agree on a version",
            ) from exc

    async def _agree(self, holds: int) -> int:
        self.round += 1
        store, round_ = self._store, self.round
        store.set(self._key(round_, self.rank), str(holds).encode())
        waiting = [m for m in self.members if m != self.rank]
        words = [holds]
        until = time.monotonic() + self.wait
        delay = _POLL[0]
        while waiting:
            for member in list(waiting):
                value = get_now(store, self._key(round_, member))
                if value is not None:
                    words.append(int(value))
                    waiting.remove(member)
            if not waiting:
                break
            if time.monotonic() >= until:
                raise WaitTimeoutError(
                    f"worker rank {self.rank}'s tensor-parallel group {list(self.members)} did not agree "
                    f"on a version: rank(s) {waiting} did not reach receive() round {round_} within "
                    f"{self.wait:g} s (the members of a group call receive() at the same points)"
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, _POLL[1])
        if round_ > 1:
            # Every member read this one's word of the round before: each
            # said its word of this round only after reading it.
            store.delete_key(self._key(round_ - 1, self.rank))
        return min(words)


class PartsEndpoint:
    """A worker's end of a sender group. It says what it holds (``want``)
    at once; a thread of its own waits for the group's plan, then builds a
    ``ChainEndpoint`` for each trainer rank that sends its class anything
    and says hello on each, and the endpoint assembles their updates."""

    pushes = False

    def __init__(
        self,
        model_id: str | None,
        rank: int,
        record: GroupRecord,
        store_address: tuple[str, int],
        timeout: float,
        want: Want,
        rounds: tuple[str, int] | None = None,
    ) -> None:
        self.model_id = model_id
        self.rank = rank
        self.record = record
        self.want = want
        self._address = store_address
        self._timeout = timeout
        prefix = group_key(model_id, record.gid)
        self._prefix = prefix
        self._store = connect_store(*store_address, timeout=timeout)
        self._store.set(f"{prefix}/want/{rank}", pickle.dumps(want))
        self._commit = None
        if len(want.members) > 1:
            store = self._store if rounds is None else connect_store(*rounds, timeout=timeout)
            self._commit = Commit(store, prefix, want.members, rank, timeout)
        # Filled by the joining thread once the plan is out: the trainer
        # ranks this worker takes from, its cut of each one's part, and an
        # end per rank.
        self.ranks: tuple[int, ...] = ()
        self.parts: tuple[Part, ...] = ()
        self._manifests: tuple[Manifest, ...] = ()
        self.ends: list[ChainEndpoint] = []
        self._joined = threading.Event()
        self._join_error: BaseException | None = None
        self._hello: tuple[Manifest, tuple[str, ...]] | None = None
        self._hello_lock = threading.Lock()
        self._closing = threading.Event()
        self._joiner = threading.Thread(target=self._join, name="weightsync-group-join", daemon=True)
        self._joiner.start()
        # The update each part holds, until all hold one version (by index of self.ranks).
        self._held: dict[int, ChainUpdate] = {}
        self._checked = 0
        self._layout_id: str | None = None
        # The ranks were told that no version can be applied here any more (once).
        self._told = False

    # -- joining the plan --------------------------------------------------------
    def _join(self) -> None:
        """(The joining thread.) Wait for the plan, build the ends, say
        hello on each once the receiver has announced itself."""
        key = f"{self._prefix}/plan"
        try:
            store = connect_store(*self._address, timeout=self._timeout)
            value = None
            while value is None and not self._closing.is_set():
                value = get_now(store, key)
                if value is None:
                    self._closing.wait(0.02)
            if value is None:
                return
            plan: GroupPlan = pickle.loads(value)
            index = plan.class_of(self.rank)
            sessions = [row[index] for row in plan.sessions]
            ranks = tuple(r for r, session in enumerate(sessions) if session is not None)
            if plan.shared[index]:
                # (Rank 0 sends all of it, as the plan found that it fills
                # the class's boxes; the same parts say the same here.)
                whole = whole_part(self.record.parts, self.want)
                assert whole is not None and ranks == (0,)
                parts: tuple[Part, ...] = (whole,)
            else:
                parts = tuple(sub_part(self.record.parts[r], self.want) for r in ranks)
            ends: list[ChainEndpoint] = []
            try:
                for r in ranks:
                    session = sessions[r]
                    assert session is not None
                    ends.append(
                        ChainEndpoint(
                            self.model_id, self.rank, self._address, None, self._timeout, session=session
                        )
                    )
            except BaseException:
                for end in ends:
                    end.close_now()
                raise
            self.ranks, self.parts, self.ends = ranks, parts, ends
            self._manifests = tuple(Manifest.from_signature(part_signature(p)) for p in parts)
            with self._hello_lock:
                self._joined.set()
                if self._hello is not None:
                    self._say_hello(*self._hello)
        except BaseException as exc:  # (told to the receiver at its next call)
            self._join_error = exc
            self._joined.set()

    def _say_hello(self, manifest: Manifest, devices: tuple[str, ...]) -> None:
        for end, part_manifest in zip(self.ends, self._manifests, strict=True):
            end.say_hello(part_manifest, devices)

    async def announce(self, manifest: Manifest, devices: tuple[str, ...]) -> None:
        """Check the model against the trainer's parts (its want said what
        it is, so every rank names a misfit at once), and say hello on every
        rank's session, now or once the plan is out. Never waits for the plan.

        :raises WeightMismatchError: the model cannot take the parts.
        """
        misfit = pieces_misfit(Manifest.from_signature(self.want.signature), self.record.parts)
        if misfit is not None:
            raise WeightMismatchError(misfit, model_id=self.model_id)
        self._layout_id = manifest.layout_id
        with self._hello_lock:
            self._hello = (manifest, devices)
            if self._joined.is_set() and self._join_error is None:
                self._say_hello(manifest, devices)

    def _joined_ends(self) -> bool:
        """Whether the ends are up (the plan is out).

        :raises SenderLostError: joining failed (the trainer's store or a
            rank's session did not answer).
        """
        if not self._joined.is_set():
            return False
        if self._join_error is not None:
            error = self._join_error
            if isinstance(error, SenderLostError):
                raise error
            raise SenderLostError(
                f"the sender group of model {self.model_id!r} could not be joined: {short_message(error)}",
                model_id=self.model_id,
            ) from error
        return True

    # -- updates ------------------------------------------------------------------
    def _take(self) -> PartsUpdate | None:
        """Take what the parts' relays hold, and the whole version once
        every part holds it (None before). Never blocks.

        :raises SenderLostError: a rank is gone (its relay says so).
        """
        if not self._joined_ends():
            return None
        held = self._held
        newest = max((u.version for u in held.values()), default=0)
        for i, end in enumerate(self.ends):
            if i in held and held[i].version >= newest and not end.has_update():
                continue  # (not taken again: that would let its buffer go)
            try:
                update = end.take_update()
            except SenderLostError as exc:
                # Without this rank's parts no version can be whole again.
                # (A group that shut down has no version in flight.)
                if not isinstance(exc, SenderClosedError):
                    self._refuse_next(f"trainer rank {self.ranks[i]} of its sender group is gone", skip=i)
                raise type(exc)(
                    f"{exc} (trainer rank {self.ranks[i]} of a sender group of {len(self.record.parts)})",
                    model_id=self.model_id,
                ) from exc
            if update is not None:
                held[i] = update
                newest = max(newest, update.version)
        if len(held) < len(self.ends) or any(u.version != newest for u in held.values()):
            return None
        updates = tuple(held[i] for i in range(len(self.ends)))
        assert self._layout_id is not None
        threads = max(u.threads for u in updates)
        return PartsUpdate(newest, self._layout_id, threads, self.parts, self._manifests, updates, self.want)

    def _refuse_next(self, why: str, skip: int | None = None) -> None:
        """No version after the last one taken whole can be applied here
        (``why``): each rank's send of the version in flight ends for this
        worker now, with the reason, not at its deadline. Not to end
        ``skip`` (the rank that is gone). Once; best effort (their stores
        may be gone too)."""
        if self._told:
            return
        self._told = True
        # The newest version a part holds (a replica's member may hold one
        # whole that its group never applied), and the one after the last
        # taken whole: one of them is in flight.
        newest = max((u.version for u in self._held.values()), default=0)
        for version in sorted({newest, self._checked + 1} - {0}):
            for j, end in enumerate(self.ends):
                if j != skip:
                    # (Best effort: that rank's store may be gone, or its end closing.)
                    with contextlib.suppress(Exception):
                        end.reply_now(version, f"{why}: version {version} cannot be applied on this worker")

    def _corrupt(self, update: PartsUpdate) -> str | None:
        """Why a verified update's parts are not what their ranks digested (None: they are)."""
        bad: list[str] = []
        for i, (manifest, part) in enumerate(zip(update.manifests, update.updates, strict=True)):
            if part.digests is not None:
                names = mismatched(manifest.names, part.sources(manifest), part.digests, part.threads)
                bad += [f"{name} (trainer rank {self.ranks[i]}'s part)" for name in names]
        if not bad:
            return None
        shown = ", ".join(bad[:5]) + (f", ... ({len(bad)} in all)" if len(bad) > 5 else "")
        return (
            f"version {update.version} failed its integrity check: the bytes of {shown} differ from what "
            "the sender sent; the model was left as it was"
        )

    def _waiting_fds(self) -> list[int]:
        newest = max((u.version for u in self._held.values()), default=0)
        return [
            end.wake_fd
            for i, end in enumerate(self.ends)
            if i not in self._held or self._held[i].version < newest
        ]

    async def _whole(self, timeout: float) -> PartsUpdate | None:
        """The next whole version, checked, waiting up to ``timeout``."""
        from ..._readiness import wait_readable_any

        deadline = anyio.current_time() + max(timeout, 0.0)
        while True:
            update = self._take()
            if update is not None:
                # (A version held back by its group's round was checked already.)
                why = None if update.version == self._checked else self._corrupt(update)
                if why is None:
                    self._checked = update.version
                    return update
                self._held = {}
                await self.reply(update.version, why)
                continue
            left = deadline - anyio.current_time()
            if left <= 0:
                return None
            if self._joined.is_set():
                await wait_readable_any(self._waiting_fds(), left)
            else:
                await anyio.sleep(min(left, 0.02))

    async def next_update(self, timeout: float) -> PartsUpdate | None:
        if self._commit is None:
            update = await self._whole(timeout)
        else:
            try:
                update = await self._whole(timeout)
            except SenderLostError as exc:
                # The others hear it in this round, and end with this one.
                await self._commit.agree(_CLOSED if isinstance(exc, SenderClosedError) else _LOST)
                raise
            # The group's round: apply only what every member holds.
            agreed = await self._commit.agree(0 if update is None else update.version)
            if agreed in (_LOST, _CLOSED):
                if agreed == _LOST:
                    # (Its ranks wait for this member's ack of a version the
                    # group will never apply.)
                    self._refuse_next(
                        f"a member of this worker's tensor-parallel group {list(self.want.members)} lost a "
                        "trainer rank of the sender group"
                    )
                kind = SenderClosedError if agreed == _CLOSED else SenderLostError
                raise kind(
                    f"the sender group of model {self.model_id!r} is "
                    f"{'shut down' if agreed == _CLOSED else 'gone'}: a member of this worker's "
                    f"tensor-parallel group {list(self.want.members)} heard so",
                    model_id=self.model_id,
                )
            if update is None or agreed != update.version:
                return None  # (kept: the next round may agree on it)
        if update is not None:
            self._held = {}  # (the receiver holds its buffers now)
        return update

    async def reply(self, version: int, error: str | None = None) -> None:
        for end in self.ends:
            await end.reply(version, error)

    def take_ready(self) -> None:
        return None  # its updates are put together in the loop (next_update)

    def try_reply(self, version: int, error: str | None = None) -> bool:
        return False

    def wait_ready(self, timeout: float) -> bool:
        if not self._joined.is_set():
            ready = self._joined.wait(max(timeout, 0.0)) and self.wait_ready(0.0)
        else:
            fds = self._waiting_fds()
            ready = not fds or bool(select.select(fds, [], [], max(timeout, 0.0))[0])
        # A tensor-parallel group's member takes part in every round, with
        # or without a new version: its receive() always runs.
        return ready or self._commit is not None

    def _stop_joining(self) -> None:
        self._closing.set()
        self._joiner.join()

    async def aclose(self) -> None:
        self._stop_joining()
        for end in self.ends:
            await end.aclose()

    def close_now(self) -> None:
        self._stop_joining()
        for end in self.ends:
            end.close_now()


def worker_endpoint(
    model_id: str | None,
    rank: int,
    store_address: tuple[str, int] | None,
    store: Any,
    timeout: float,
    want: Callable[[], Want],
    rounds: tuple[str, int] | None = None,
) -> ChainEndpoint | PartsEndpoint:
    """Worker ``rank``'s end: of a sender group (the model's session key
    holds :data:`GROUP_MARK`), taking what ``want()`` says it holds (its
    replica's rounds at ``rounds``, else in the trainer's store); else the
    one trainer's.

    :raises SenderLostError: the trainer's store or session did not answer in time.
    """
    deadline = time.monotonic() + timeout
    if store_address is None:
        return ChainEndpoint(model_id, rank, store_address, store, timeout)
    try:
        client = connect_store(*store_address, timeout=timeout)
        session = wait_key(client, session_key(model_id), deadline)
        record = None
        if session.startswith(GROUP_MARK):
            gid = session[len(GROUP_MARK) :].decode()
            record = pickle.loads(wait_key(client, group_key(model_id, gid), deadline))
    except (RuntimeError, OSError) as exc:
        raise SenderLostError(
            f"the sender of model {model_id!r} is gone: its store did not answer ({short_message(exc)})",
            model_id=model_id,
        ) from exc
    left = max(deadline - time.monotonic(), 0.1)
    if record is None:
        return ChainEndpoint(model_id, rank, store_address, None, left, session=session.decode())
    assert isinstance(record, GroupRecord)
    return PartsEndpoint(model_id, rank, record, store_address, left, want(), rounds)


def new_gid() -> str:
    return os.urandom(8).hex()
