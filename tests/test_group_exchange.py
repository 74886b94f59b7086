"""A sender group's ranks end a send by exchanging their outcomes through
the trainer's store (``SenderGroup.exchange``). A rank whose process is
gone is named at once, not at the send's deadline: each rank's beacon (a
listening socket) refuses connections once its process died, which the
others look at while they wait. A rank that is alive but silent (stopped,
slow) is waited for until the deadline. A real TCPStore and real sockets,
the ranks' two ends in one process (a rank's death is its beacon closed,
as the kernel closes it when the process dies)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from weightsync import SenderGroupError
from weightsync._sender_group import Outcome, merge
from weightsync._transports._distributed._group import SenderGroup


def _pair() -> tuple[SenderGroup, SenderGroup, object]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))  # fmt: skip
    address = ("127.0.0.1", int(store.port))
    ranks = tuple(SenderGroup("policy", address, "g1", r, 2, (), 10.0, "127.0.0.1") for r in (0, 1))
    return ranks[0], ranks[1], store


def test_a_rank_whose_process_is_gone_is_named_at_once() -> None:
    first, second, store = _pair()
    try:
        second._beacon.close()  # (what the kernel does when its process dies)
        started = time.monotonic()
        outcomes, dead = first.exchange(1, Outcome(0, 1), time.monotonic() + 8.0)
        waited = time.monotonic() - started
        assert dead == {1} and set(outcomes) == {0}, (outcomes, dead)
        assert waited < 2.0, waited  # (its beacon is looked at every 0.25 s)
        with pytest.raises(SenderGroupError, match=r"rank 1 died during it \(its process is gone\)") as err:
            merge(outcomes, 2, 1, "policy", dead)
        assert err.value.ranks == (1,)
    finally:
        second.close(owner=False)
        first.close(owner=True)
        del store


def test_a_rank_alive_but_silent_is_waited_for_until_the_deadline() -> None:
    first, second, store = _pair()
    try:
        started = time.monotonic()
        outcomes, dead = first.exchange(1, Outcome(0, 1), time.monotonic() + 1.5)
        waited = time.monotonic() - started
        assert dead == set() and set(outcomes) == {0}, (outcomes, dead)
        assert waited >= 1.5, waited
        with pytest.raises(SenderGroupError, match="rank 1 did not finish it in time"):
            merge(outcomes, 2, 1, "policy", dead)
        # Once it says its outcome, the next exchange has both.
        second.exchange(2, Outcome(1, 2), time.monotonic())
        outcomes, dead = first.exchange(2, Outcome(0, 2), time.monotonic() + 5.0)
        assert set(outcomes) == {0, 1} and dead == set()
    finally:
        second.close(owner=False)
        first.close(owner=True)
        del store
