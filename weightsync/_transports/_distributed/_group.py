"""A sender group: the ranks of a sharded trainer, each sending its own part
of every version (``_shards``) over a session of its own, and its workers,
which put the parts of one version together before anything is applied.

Keys (beside each rank's session, ``_protocol``)::

    weightsync/<model>/session            rank 0: b"group:<gid>" (a worker
                                          that reads it takes every part)
    weightsync/<model>/group/<gid>        rank 0: a :class:`GroupRecord`
    .../<gid>/outcome/<seq>/<rank>        each rank: its :class:`Outcome` of send seq

Trainer side (:class:`SenderGroup`): every rank sends its part as the same
version (the group's send count), then publishes its outcome and reads the
others', up to the send's deadline and :data:`GRACE` more; every rank then
returns the same report, or raises the same error (:func:`merge`). A rank
that published nothing by then (it died, was stopped, or was interrupted)
is named on every other rank (:class:`SenderGroupError`).

Worker side (:class:`PartsEndpoint`): one ``ChainEndpoint`` per trainer
rank, each taking part in its rank's chains with its own relay thread and
receive buffers; :meth:`PartsEndpoint.next_update` hands the receiver a
:class:`PartsUpdate` only once every part holds the same version (each
checked against its rank's digests, with ``verify``), and the receiver
writes all of it at its safe point, or nothing. Its ack goes to every rank.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import select
import time
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from ..._digest import mismatched
from ..._exceptions import (
    SenderLostError,
    WeightMismatchError,
)
from ..._packet import Manifest, Signature
from ..._shards import Part, part_signature, pieces_misfit, place
from .._chain._gloo import connect_store
from .._chain._pipeline import short_message
from ._protocol import get_now, session_key, wait_key
from ._relay import ChainUpdate
from ._transport import ChainEndpoint

__all__ = [
    "GRACE",
    "GROUP_MARK",
    "GroupRecord",
    "PartsEndpoint",
    "PartsUpdate",
    "SenderGroup",
    "worker_endpoint",
]

#: What a worker finds under the model's session key when a sender group sends it.
GROUP_MARK = b"group:"
#: How long past a send's deadline a rank waits for the others' outcomes (s).
GRACE = 3.0
# Polls of the others' outcomes (seconds): the first, and the longest.
_POLL = (0.0005, 0.002)


def group_key(model_id: str | None, gid: str) -> str:
    return f"weightsync/{model_id}/group/{gid}"


@dataclasses.dataclass(frozen=True)
class GroupRecord:
    """What a worker needs to take a sender group's sends: each rank's
    session and part, by trainer rank."""

    gid: str
    sessions: tuple[str, ...]
    parts: tuple[Part, ...]


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

    @property
    def part(self) -> Part:
        return self.parts[self.rank]

    def publish(self, sessions: Sequence[str]) -> None:
        """(Rank 0, once every rank's session is up.) Tell the workers."""
        record = GroupRecord(self.gid, tuple(sessions), self.parts)
        self._store.set(self._prefix, pickle.dumps(record))
        self._store.set(session_key(self.model_id), GROUP_MARK + self.gid.encode())

    def _outcome_key(self, seq: int, rank: int) -> str:
        return f"{self._prefix}/outcome/{seq}/{rank}"

    def exchange(self, seq: int, outcome: Any, until: float) -> dict[int, Any]:
        """Publish this rank's ``outcome`` of send ``seq`` (anything that
        pickles) and read every other rank's, until ``until``
        (``time.monotonic()``); those that came, by rank."""
        got = {self.rank: outcome}
        try:
            self._store.set(self._outcome_key(seq, self.rank), pickle.dumps(outcome))
            delay = _POLL[0]
            while len(got) < self.size:
                for rank in range(self.size):
                    if rank in got:
                        continue
                    value = get_now(self._store, self._outcome_key(seq, rank))
                    if value is not None:
                        got[rank] = pickle.loads(value)
                if len(got) == self.size or time.monotonic() >= until:
                    break
                time.sleep(delay)
                delay = min(delay * 2, _POLL[1])
            if seq > 1:
                # Every rank read this rank's outcome of the send before: each
                # published this one's, which it does only after reading them.
                self._store.delete_key(self._outcome_key(seq - 1, self.rank))
        except RuntimeError:
            # The store is gone (its rank died or shut down): the ranks not
            # heard from are named as such.
            pass
        return got

    def close(self, owner: bool) -> None:
        """Sign off; the rank that runs the store (``owner``) first waits,
        up to :data:`GRACE` s, for every other rank to sign off: each has
        read every outcome it waits for, so none loses the store in the
        middle of an exchange. Idempotent."""
        store, self._store = self._store, None
        if store is None:
            return
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
    relay: written into the model's whole tensors, each piece into its box."""

    version: int
    layout_id: str
    threads: int
    parts: tuple[Part, ...]
    manifests: tuple[Manifest, ...]
    updates: tuple[ChainUpdate, ...]
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
        with torch.no_grad():
            for part, part_manifest, update in zip(self.parts, self.manifests, self.updates, strict=True):
                place(by_name, part, part_manifest.views(update.buffer))


class PartsEndpoint:
    """A worker's end of a sender group: a ``ChainEndpoint`` per trainer
    rank (built at once: each waits for its rank's liveness address, up to
    ``timeout``), and the assembly of their updates."""

    pushes = False

    def __init__(
        self,
        model_id: str | None,
        rank: int,
        record: GroupRecord,
        store_address: tuple[str, int],
        timeout: float,
    ) -> None:
        self.model_id = model_id
        self.rank = rank
        self.record = record
        self.ends: list[ChainEndpoint] = []
        try:
            for session in record.sessions:
                self.ends.append(ChainEndpoint(model_id, rank, store_address, None, timeout, session=session))
        except BaseException:
            for end in self.ends:
                end.close_now()
            raise
        self._manifests = tuple(Manifest.from_signature(part_signature(p)) for p in record.parts)
        # The update each part holds, until all hold one version (by trainer rank).
        self._held: dict[int, ChainUpdate] = {}
        self._layout_id: str | None = None

    async def announce(self, manifest: Manifest, devices: tuple[str, ...]) -> None:
        """Say hello to every rank, as the layout of its part. A model that
        cannot take the parts says hello with its own layout (so every rank
        names the mismatch at once) and raises here.

        :raises WeightMismatchError: the model cannot take the parts.
        """
        misfit = pieces_misfit(manifest, self.record.parts)
        for end, part_manifest in zip(self.ends, self._manifests, strict=True):
            await end.announce(manifest if misfit else part_manifest, devices)
        if misfit is not None:
            raise WeightMismatchError(misfit, model_id=self.model_id)
        self._layout_id = manifest.layout_id

    def _take(self) -> PartsUpdate | None:
        """Take what the parts' relays hold, and the whole version once
        every part holds it (None before). Never blocks.

        :raises SenderLostError: a rank is gone (its relay says so).
        """
        held = self._held
        newest = max((u.version for u in held.values()), default=0)
        for i, end in enumerate(self.ends):
            if i in held and held[i].version >= newest:
                continue  # (not taken again: that would let its buffer go)
            try:
                update = end.take_update()
            except SenderLostError as exc:
                # Without this rank's parts no version can be whole again.
                raise type(exc)(
                    f"{exc} (trainer rank {i} of a sender group of {len(self.ends)})", model_id=self.model_id
                ) from exc
            if update is not None:
                held[i] = update
                newest = max(newest, update.version)
        if len(held) < len(self.ends) or any(u.version != newest for u in held.values()):
            return None
        updates = tuple(held[i] for i in range(len(self.ends)))
        self._held = {}
        assert self._layout_id is not None
        threads = max(u.threads for u in updates)
        return PartsUpdate(newest, self._layout_id, threads, self.record.parts, self._manifests, updates)

    def _corrupt(self, update: PartsUpdate) -> str | None:
        """Why a verified update's parts are not what their ranks digested (None: they are)."""
        bad: list[str] = []
        for rank, (manifest, part) in enumerate(zip(update.manifests, update.updates, strict=True)):
            if part.digests is not None:
                names = mismatched(manifest.names, manifest.views(part.buffer), part.digests, part.threads)
                bad += [f"{name} (trainer rank {rank}'s part)" for name in names]
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

    async def next_update(self, timeout: float) -> PartsUpdate | None:
        from ..._readiness import wait_readable_any

        deadline = anyio.current_time() + max(timeout, 0.0)
        while True:
            update = self._take()
            if update is not None:
                why = self._corrupt(update)
                if why is None:
                    return update
                await self.reply(update.version, why)
                continue
            left = deadline - anyio.current_time()
            if left <= 0:
                return None
            await wait_readable_any(self._waiting_fds(), left)

    async def reply(self, version: int, error: str | None = None) -> None:
        for end in self.ends:
            await end.reply(version, error)

    def take_ready(self) -> None:
        return None  # its updates are put together in the loop (next_update)

    def try_reply(self, version: int, error: str | None = None) -> bool:
        return False

    def wait_ready(self, timeout: float) -> bool:
        fds = self._waiting_fds()
        if not fds:
            return True
        ready, _, _ = select.select(fds, [], [], max(timeout, 0.0))
        return bool(ready)

    async def aclose(self) -> None:
        for end in self.ends:
            await end.aclose()


def worker_endpoint(
    model_id: str | None, rank: int, store_address: tuple[str, int] | None, store: Any, timeout: float
) -> ChainEndpoint | PartsEndpoint:
    """Worker ``rank``'s end: of a sender group (the model's session key
    holds :data:`GROUP_MARK`), one per rank; else the one trainer's.

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
    return PartsEndpoint(model_id, rank, record, store_address, left)


def new_gid() -> str:
    return os.urandom(8).hex()
