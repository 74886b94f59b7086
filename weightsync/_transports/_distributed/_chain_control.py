"""The torch.distributed transport's part of the chain (the trainer's
``ChainControl`` over worker ranks): who is in a chain and in what order,
how each worker is told (a notice in the store) and how its report comes
back (a key in the store, counted so that one store call per poll tells
whether any came). The attempts, stall limits, generations and repair are
the chain driver's (``_chain``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Collection
from typing import Any

from ..._memory._segment import SegmentRef
from .._chain._driver import Report, Route
from .._chain._gloo import connect_store
from ._host_share import UNMAPPED, plan_hosts
from ._liveness import Liveness
from ._protocol import (
    TRAINER,
    CloseNotice,
    FollowNotice,
    Hello,
    Lead,
    SendInfo,
    SessionKeys,
    UpdateNotice,
    decode,
    encode,
    get_now,
)

__all__ = ["WorkerChain"]


class WorkerChain:
    """The workers a trainer's chains run over: their hellos (by rank),
    their liveness, their notices. ``share_on_host``: one host leader per
    host in the chain, the host's other workers fed by it (``_host_share``).
    :attr:`info` is what the workers of the current send are told of it."""

    def __init__(
        self,
        keys: SessionKeys,
        store_address: tuple[str, int],
        liveness: Liveness,
        share_on_host: bool,
        rotate: int = 0,
    ) -> None:
        self.keys = keys
        #: The other hosts' order in the chain turns by this many: the ranks
        #: of a sender group each start their chain at another host.
        self.rotate = rotate
        self.namespace = keys.prefix
        self.liveness = liveness
        self.address = liveness.address[0]
        self.share_on_host = share_on_host
        self.info: SendInfo | None = None
        #: What each worker said of itself (its hello), by rank.
        self.members: dict[int, Hello] = {}
        self._store_address = store_address
        self._store: Any = None
        #: How many notices each worker (by rank) was left.
        self.notices: dict[int, int] = {}
        self._counted = 0
        # Workers that could not map their host leader's memory: in the chain themselves.
        self._direct: set[int] = set()
        #: Where the current send is staged, when the trainer feeds the
        #: workers of its own host from there (None: it feeds none; the
        #: staging sets it per send).
        self.lead: SegmentRef | None = None
        self._host = (self.address, socket.gethostname())

    def alive(self, rank: int) -> bool:
        """Whether worker ``rank`` said hello and its liveness connection is not closed."""
        member = self.members.get(rank)
        return member is not None and self.liveness.state(rank, member.nonce) != "gone"

    def any_on_own_host(self) -> bool:
        """Whether a worker that said hello runs on the trainer's host."""
        return any((m.address, m.hostname) == self._host for m in self.members.values())

    def group_store(self, stall: float = 0.0) -> Any:
        """The store client of the notices and the chain, made on first use
        (blocks up to 10 s for it)."""
        if self._store is None:
            self._store = connect_store(*self._store_address, timeout=10.0)
        return self._store

    def notify(self, rank: int, notice: UpdateNotice | FollowNotice | CloseNotice) -> str:
        """Leave ``notice`` for worker ``rank``; its key."""
        n = self.notices.get(rank, 0) + 1
        self.notices[rank] = n
        key = self.keys.notice(rank, n)
        self.group_store().set(key, encode(notice))
        member = self.members.get(rank)
        if member is not None:
            self.liveness.ring(rank, member.nonce)
        return key

    def close(self) -> None:
        self._store = None

    # -- ChainControl ----------------------------------------------------------
    def plan(self, ranks: list[int]) -> tuple[list[int], dict[int, tuple[int, ...]]]:
        """The chain over the live workers of ``ranks``: the workers of the
        trainer's host first, then host by host, by rank within a host. The
        workers of a host are neighbours in the chain, so the bytes cross
        each host's NIC once in and once out, however the ranks were spread
        over the hosts; with ``share_on_host`` only its host leader is in it,
        and with :attr:`lead` the trainer's host has none in it: the trainer
        feeds them (as :data:`TRAINER`). The other hosts come in the order
        of their addresses, turned by :attr:`rotate`."""

        def address(rank: int) -> str:
            member = self.members.get(rank)
            return member.address if member is not None else ""

        live = [r for r in ranks if self.alive(r)]
        others = sorted({address(r) for r in live} - {self.address})
        turn = self.rotate % len(others) if others else 0
        place = {a: i for i, a in enumerate(others[turn:] + others[:turn])}

        def key(rank: int) -> tuple[bool, int, int]:
            a = address(rank)
            return (a != self.address, place.get(a, -1), rank)

        ordered = sorted(live, key=key)
        if not self.share_on_host:
            return ordered, {}

        def host_of(rank: int) -> tuple[str, str] | None:
            member = self.members.get(rank)
            return None if member is None else (member.address, member.hostname)

        return plan_hosts(ordered, host_of, self._direct, None if self.lead is None else self._host)

    def name(self, rank: int) -> str:
        member = self.members.get(rank)
        return f"rank {rank}" + (f" (host {member.hostname}, {member.address})" if member is not None else "")

    def launch(self, route: Route[int]) -> None:
        assert self.info is not None
        info = dataclasses.replace(self.info, generation=route.generation)
        for rank in route.chain:
            self.notify(rank, UpdateNotice(info, route.link(rank), rank in route.fed))
        for leader, followers in route.fed.items():
            if leader == TRAINER:
                # Before the followers are told: they look here first.
                assert self.lead is not None
                lead = Lead(route.generation, info.version, self.lead)
                self.group_store().set(self.keys.lead(TRAINER), encode(lead))
                pid = os.getpid()
            else:
                pid = self.members[leader].pid
            for rank in followers:
                self.notify(rank, FollowNotice(info, leader, pid, route.stall, route.first))
        self._counted = 0

    def poll(self, route: Route[int], waiting: Collection[int], wait: float) -> list[tuple[int, Report]]:
        assert self.info is not None
        store, version = self.group_store(), self.info.version
        # Each report also counts itself: one store call per poll tells
        # whether any came, however many workers there are.
        reported = int(store.add(self.keys.got(route.generation, version, "count"), 0))
        fresh, self._counted = reported > self._counted, reported
        came: list[tuple[int, Report]] = []
        for rank in list(waiting):
            key = self.keys.got(route.generation, version, rank)
            value = get_now(store, key) if fresh else None
            if value is None:
                if not self.alive(rank):
                    # Dead: it will never answer.
                    came.append((rank, Report(False, "it died during the chain", gone=True)))
                continue
            store.delete_key(key)
            report = decode(value, Report)
            if not report.complete and str(report.error).startswith(UNMAPPED):
                self._direct.add(rank)
            came.append((rank, report))
        if not came:
            time.sleep(wait)
        return came

    def settle(self, route: Route[int]) -> None:
        assert self.info is not None
        self.group_store().delete_key(self.keys.got(route.generation, self.info.version, "count"))
