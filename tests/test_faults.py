"""Faults in the middle of a send, over every scheme.

The conformance suite covers a worker that died before a send, one that
stops acking, and one that fails to apply; here a worker dies while the
send it is part of is in flight.
"""

from __future__ import annotations

import time

import pytest
from conftest import Cluster

import weightsync as ws


def test_a_worker_killed_during_a_send_is_reported_and_the_others_updated(make_cluster) -> None:
    c: Cluster = make_cluster(["big", "big", "big"], trainer_kind="big")
    c.sender.send()
    c.bump()
    started = time.monotonic()
    c.sender.send_async()
    time.sleep(0.005)  # the send is in flight: staging, or the workers' copies of 32 MiB
    c.kill(1)
    with pytest.raises(ws.WorkerLostError) as info:
        c.sender.wait_async()
    assert time.monotonic() - started < 10
    assert info.value.worker_ids == (1,)
    expected = c.expected()
    c.assert_has(0, expected)
    c.assert_has(2, expected)
    c.bump()
    report = c.sender.send(worker_ids=[0, 2])
    assert report.worker_ids == (0, 2)
    c.assert_has(0, c.expected())
    c.assert_has(2, c.expected())
