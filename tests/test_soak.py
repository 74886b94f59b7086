"""Load: many back-to-back sends to 4 workers leak nothing and lose no ack.

The default run sends 200 times per scheme; ``pytest -m slow``
runs the soak with thousands. Both print the sends per second reached.

Per process (the trainer and every worker): descriptors, threads and
weightsync's shared-memory mappings may not grow at all, memory mappings of
any kind by a few at most (a leak per send would add hundreds), and private
resident memory (``RssAnon``) by a fixed allowance (the allocator's and
Ray's own growth) plus an eighth of the model's bytes per send: with a
136 KiB model, a leak of a copy of the weights per send fails, and so does
one of 20 KiB per send. Shared memory is left out of the resident figure:
a Ray process touches more pages of Ray's object store as it goes, and a
pipe scheme's segments are counted as mappings and descriptors.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from harness import Cluster, RayCluster, schemes, shm_entries
from harness.workers import MEMFD_LABEL, tensors_of

WARMUP = 50
# Private resident memory a process may gain whatever the number of sends,
# in KiB: the allocator's arenas, and under Ray its own bookkeeping.
RSS_SLACK_KIB = {"multiprocess": 1024, "shared": 1024, "distributed": 1024, "ray": 4096}
# ... plus this share of the model's bytes per send.
RSS_PER_SEND = 1 / 8
# Mappings a process may gain (the allocator maps large blocks of its own).
MAPS_SLACK = 8


def _resources(pid: int) -> dict[str, int]:
    """Open descriptors, threads, private resident KiB, memory mappings and
    mappings of weightsync segments of process ``pid``."""
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))
    with open(f"/proc/{pid}/maps") as maps:
        lines = maps.readlines()
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "rss_kib": rss,
        "maps": len(lines),
        "memfd_maps": sum(MEMFD_LABEL in line for line in lines),
    }


def _measure(c: Cluster, pids: list[int]) -> dict[int, dict[str, int]]:
    """Every process's resources. Under Ray the threads counted, in the actors
    and in the trainer (the Ray driver), are Python threads (any thread
    weightsync could start is one): Ray's C++ threads come and go with the
    RPC load of the whole machine, which made full runs fail now and then on
    one of them."""
    measured = {pid: _resources(pid) for pid in pids}
    if isinstance(c, RayCluster):
        import ray

        counts = ray.get([c._ctrl(i, "python_threads") for i in range(len(c.pids))], timeout=30)
        for pid, count in zip(c.pids, counts, strict=True):
            measured[pid]["threads"] = count
        measured[os.getpid()]["threads"] = threading.active_count()
    return measured


def _soak(c: Cluster, sends: int) -> None:
    pids = [os.getpid(), *c.pids]
    model_kib = sum(t.numel() * t.element_size() for t in tensors_of(c.model).values()) / 1024
    rss_allowed = RSS_SLACK_KIB[c.scheme_name] + sends * model_kib * RSS_PER_SEND
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
        was, now = before[pid], after[pid]
        who = "trainer" if pid == os.getpid() else f"worker pid {pid}"
        grew = {key: now[key] - was[key] for key in was}
        print(f"{who}: {was} grew by {grew}")
        assert grew["fds"] <= 0, f"{who}: descriptors grew from {was['fds']} to {now['fds']}"
        assert grew["threads"] <= 0, f"{who}: threads grew from {was['threads']} to {now['threads']}"
        assert grew["memfd_maps"] <= 0, f"{who}: weightsync mappings grew by {grew['memfd_maps']}"
        assert grew["maps"] <= MAPS_SLACK, f"{who}: memory mappings grew by {grew['maps']}"
        assert grew["rss_kib"] <= rss_allowed, (
            f"{who}: private resident memory grew by {grew['rss_kib']} KiB in {sends} sends of a "
            f"{model_kib:.1f} KiB model (allowed: {rss_allowed:.0f} KiB)"
        )
    assert shm_entries() <= shm_before


# Every scheme whose workers are processes: their resources are counted.
pytestmark = pytest.mark.parametrize("scheme_name", schemes(processes=True))


def test_hundreds_of_sends_leak_nothing(make_cluster) -> None:
    _soak(make_cluster(["soak"] * 4, trainer_kind="soak"), sends=200)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_thousands_of_sends_leak_nothing(make_cluster) -> None:
    _soak(make_cluster(["soak"] * 4, trainer_kind="soak"), sends=5000)
