"""Load: many back-to-back sends to 4 workers leak nothing and lose no ack.

The default run sends 200 times per scheme; ``pytest -m slow``
runs the soak with thousands. Both print the sends per second reached.
"""

from __future__ import annotations

import os
import time

import pytest
from conftest import Cluster, shm_entries

WARMUP = 50


# Thread pools of gRPC inside a Ray actor, sized by gRPC to the RPC load:
# they are Ray's, not ours. (In full runs of the suite a pooled Ray actor
# now and then had one thread more after the sends; the soak alone never
# did. These are the pools that can grow so.)
ELASTIC_THREADS = {"grpcpp_sync_ser", "event_engine"}


def _threads(pid: int) -> int:
    count = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as comm:
                count += comm.read().strip() not in ELASTIC_THREADS
        except OSError:
            pass  # the thread ended meanwhile
    return count


def _resources(pid: int) -> tuple[int, int, int]:
    """Open descriptors, threads and resident KiB of process ``pid``."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = _threads(pid)
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return fds, threads, rss


def _soak(c: Cluster, sends: int) -> None:
    pids = [os.getpid(), *c.pids]
    for _ in range(WARMUP):
        c.bump()
        c.sender.send()
    before = {pid: _resources(pid) for pid in pids}
    shm_before = shm_entries()
    first = c.sender.async_sender.version + 1
    started = time.perf_counter()
    for expected_version in range(first, first + sends):
        c.bump()
        report = c.sender.send()
        assert report.version == expected_version and report.worker_ids == (0, 1, 2, 3)
    rate = sends / (time.perf_counter() - started)
    print(f"\n{c.scheme_name}: {sends} sends to 4 workers at {rate:.0f} sends/s")
    # Measured before the checks below: the test's own state() replies
    # open descriptors for the tensors they carry.
    after = {pid: _resources(pid) for pid in pids}
    expected = c.expected()
    for i in range(4):
        c.assert_has(i, expected)
        assert c.state(i)["applied"][-1] == first + sends - 1
    for pid in pids:
        (fds0, threads0, rss0), (fds1, threads1, rss1) = before[pid], after[pid]
        who = "trainer" if pid == os.getpid() else f"worker pid {pid}"
        assert fds1 <= fds0, f"{who}: descriptors grew from {fds0} to {fds1}"
        assert threads1 <= threads0, f"{who}: threads grew from {threads0} to {threads1}"
        assert rss1 - rss0 < 16 * 1024, f"{who}: resident memory grew by {rss1 - rss0} KiB"
    assert shm_entries() <= shm_before


def test_hundreds_of_sends_leak_nothing(make_cluster) -> None:
    _soak(make_cluster(["net"] * 4), sends=200)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_thousands_of_sends_leak_nothing(make_cluster) -> None:
    _soak(make_cluster(["net"] * 4), sends=5000)
