"""Load: many back-to-back sends to 4 workers leak nothing and lose no ack.

The default run sends 200 times per scheme; ``pytest -m slow``
runs the soak with thousands. Both print the sends per second reached.
"""

from __future__ import annotations

import os
import time

import pytest
from conftest import Cluster, RayCluster, shm_entries

WARMUP = 50


def _resources(pid: int) -> tuple[int, int, int]:
    """Open descriptors, threads and resident KiB of process ``pid``."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return fds, threads, rss


def _measure(c: Cluster, pids: list[int]) -> dict[int, tuple[int, int, int]]:
    """Every process's descriptors, threads and resident KiB. In a Ray actor
    the threads counted are its Python threads (any thread weightsync could
    start is one): Ray's C++ threads come and go with the RPC load of the
    whole machine, which made full runs fail now and then on one of them."""
    measured = {pid: _resources(pid) for pid in pids}
    if isinstance(c, RayCluster):
        import ray

        counts = ray.get([c._ctrl(i, "python_threads") for i in range(len(c.pids))], timeout=30)
        for pid, count in zip(c.pids, counts, strict=True):
            fds, _, rss = measured[pid]
            measured[pid] = (fds, count, rss)
    return measured


def _soak(c: Cluster, sends: int) -> None:
    pids = [os.getpid(), *c.pids]
    for _ in range(WARMUP):
        c.bump()
        c.sender.send()
    before = _measure(c, pids)
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
    after = _measure(c, pids)
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
