"""Faults in the middle of a send, over every scheme.

The conformance suite covers a worker that died before a send, one that
stops acking, and one that fails to apply; here a worker dies while the
send it is part of is in flight.
"""

from __future__ import annotations

import signal
import time

import pytest
from harness import Cluster, schemes

import weightsync as ws


def test_a_worker_killed_during_a_send_is_reported_and_the_others_updated(make_cluster) -> None:
    c: Cluster = make_cluster(["big", "big", "big"], trainer_kind="big")
    c.sender.send()
    c.bump()
    started = time.monotonic()
    # send_async() returns once the bytes are staged, and the other workers
    # may ack 32 MiB within milliseconds: worker 1 takes no update until it
    # is killed, so the send is still waiting for it then.
    c.pause(1)
    c.sender.send_async()
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


def _lost_worker_error(c: Cluster, i: int, cmd: str, targets: list[int]) -> ws.WorkerLostError:
    """Worker ``i`` ends by obeying ``cmd``; the error of the next send to ``targets``."""
    c.ctrls[i].send(cmd)
    c.procs[i].join(10)
    c.bump()
    with pytest.raises(ws.WorkerLostError) as info:
        c.sender.send(worker_ids=targets, timeout=30)
    assert info.value.worker_ids == (i,)
    return info.value.failures[i]  # type: ignore[return-value]


@pytest.mark.parametrize("scheme_name", schemes(processes=True, actors=False))
def test_a_lost_worker_says_how_it_ended(make_cluster, scheme_name: str) -> None:
    c = make_cluster(["net", "net", "net"])
    c.sender.send()
    c.kill(0)
    c.bump()
    with pytest.raises(ws.WorkerLostError) as info:
        c.sender.send(timeout=30)
    killed = info.value.failures[0]
    assert isinstance(killed, ws.WorkerLostError)
    assert killed.exit_signal == signal.SIGKILL and killed.exit_code is None
    assert "SIGKILL" in str(killed)
    exited = _lost_worker_error(c, 1, "exit3", [1, 2])
    assert exited.exit_code == 3 and exited.exit_signal is None
    assert "status 3" in str(exited)
    c.assert_has(2, c.expected())


@pytest.mark.parametrize("scheme_name", ["shared"])
def test_a_shared_scheme_worker_that_writes_its_parameters_is_told_why_it_faulted(
    make_cluster, scheme_name: str
) -> None:
    c = make_cluster(["net", "net"])
    c.sender.send()  # worker 1 now runs on read-only shared memory
    error = _lost_worker_error(c, 1, "write_params", [0, 1])
    assert error.exit_signal == signal.SIGSEGV
    assert "SIGSEGV" in str(error) and "MultiProcessWeightSyncScheme" in str(error)
