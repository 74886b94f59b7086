"""The sync facade (send / send_async / wait_async) and the async core, with real workers."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator

import anyio
import pytest
import torch
from harness import Cluster, schemes

import weightsync as ws
from weightsync._memory._segment import WRITING, Segment
from weightsync._runtime import RUNTIME as LOOP


# The facade and the loops are the same for every transport: one scheme is enough.
@pytest.fixture
def scheme_name() -> str:
    return "multiprocess"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster("multiprocess", ["net", "net", "net"])
    yield c
    c.close()


def test_send_async_then_wait_async(cluster: Cluster) -> None:
    cluster.bump()
    handle = cluster.sender.send_async()
    assert isinstance(handle, ws.SendHandle) and handle.worker_ids == (0, 1, 2)
    report = cluster.sender.wait_async()
    assert report.version == handle.version and handle.done()
    for i in range(3):
        cluster.assert_has(i, cluster.expected())
        assert cluster.state(i)["applied"][-1] == report.version


def test_blocking_rules_of_the_weight_sender_page(cluster: Cluster) -> None:
    sender = cluster.sender
    with pytest.raises(RuntimeError, match="wait_async"):
        sender.wait_async()
    sender.send_async()
    with pytest.raises(RuntimeError, match="pending"):
        sender.send_async()
    with pytest.raises(RuntimeError, match="pending"):
        sender.send()
    sender.wait_async()
    sender.send()  # usable again


def test_wait_async_reraises_the_sends_error(cluster: Cluster) -> None:
    bad = {k: v for k, v in cluster.expected().items() if k != "out.bias"}
    cluster.sender.send_async(bad)
    with pytest.raises(ws.WeightMismatchError):
        cluster.sender.wait_async()
    with pytest.raises(RuntimeError):
        cluster.sender.wait_async()  # nothing pending any more


def test_update_weights_is_send_to_all(cluster: Cluster) -> None:
    cluster.bump()
    cluster.sender.update_weights(cluster.model)
    for i in range(3):
        cluster.assert_has(i, cluster.expected())


def test_scheme_send_goes_through_the_sender(cluster: Cluster) -> None:
    cluster.bump()
    report = cluster.scheme.send(worker_ids=[0, 2])
    assert report is not None and report.worker_ids == (0, 2)
    cluster.assert_has(2, cluster.expected())


def test_blocking_call_from_a_thread_running_its_own_loop(cluster: Cluster) -> None:
    """Inside a coroutine it is refused (tests/test_coroutines.py); from
    code the loop runs outside any task it blocks the loop's thread."""
    cluster.bump()

    async def main() -> ws.SendReport:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[ws.SendReport] = loop.create_future()
        loop.call_soon(lambda: done.set_result(cluster.sender.send()))
        return await done

    report = asyncio.run(main())
    assert report.worker_ids == (0, 1, 2)
    cluster.assert_has(1, cluster.expected())


def test_blocking_call_from_the_library_loop_thread_raises(cluster: Cluster) -> None:
    async def inside_the_loop() -> None:
        cluster.sender.send()

    with pytest.raises(RuntimeError, match="own event-loop thread"):
        LOOP.portal().call(inside_the_loop)
    cluster.sender.send()


def test_sends_from_several_threads_never_interleave(cluster: Cluster) -> None:
    """Three threads send five different sets of weights each, all at once.
    A send that finds another in progress is refused (and uses no version);
    every other send completes alone: the versions are consecutive, every
    worker applied each of them in order, and ends with exactly the weights
    of the newest one."""
    first = cluster.sender.send().version + 1
    start = threading.Barrier(3)
    sent: dict[int, dict[str, torch.Tensor]] = {}  # version -> the weights it carried
    refused: list[ws.WeightSyncStateError] = []
    errors: list[BaseException] = []

    def weights(value: int) -> dict[str, torch.Tensor]:
        return {k: torch.full_like(v, value) for k, v in cluster.expected().items()}

    def trainer_thread(k: int) -> None:
        start.wait()
        for i in range(5):
            mine = weights(100 * (k + 1) + i)
            try:
                sent[cluster.sender.send(mine).version] = mine
            except ws.WeightSyncStateError as exc:
                refused.append(exc)
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=trainer_thread, args=(k,)) for k in range(3)]
    # Threads switch every microsecond, not every 5 ms: a check and a set of
    # "busy" that are not one atomic step would let two sends in.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    print(f"{len(sent)} sends completed, {len(refused)} refused")
    assert not errors, errors
    assert len(sent) + len(refused) == 15
    assert all("in progress" in str(exc) for exc in refused), refused
    versions = sorted(sent)
    assert versions == list(range(first, first + len(sent))), "a version was used twice or skipped"
    assert cluster.sender.async_sender.version == versions[-1]
    for i in range(3):
        applied = [v for v in cluster.state(i)["applied"] if v >= first]
        assert applied == versions, f"worker {i} applied {applied}"
        cluster.assert_has(i, sent[versions[-1]])


@pytest.mark.asyncio
async def test_async_trainer_awaits_sends(make_cluster) -> None:
    c = make_cluster(["net", "net"])
    sender = c.scheme.get_async_sender()
    for _ in range(3):
        c.bump()
        report = await sender.send()
    assert report.worker_ids == (0, 1)
    for i in range(2):
        c.assert_has(i, c.expected())
        assert c.state(i)["applied"][-1] == report.version


def _segments(c: Cluster) -> list[Segment]:
    staging = c.scheme.staging.host  # (the pipe schemes' host staging)
    segment = getattr(staging, "segment", None)  # the multiprocess scheme's one segment
    return [segment] if segment is not None else list(getattr(staging, "slots", []))  # the shared scheme's


async def _turns_while_written(c: Cluster, until: list[object]) -> int:
    """Turns of this loop, until ``until`` is not empty, during which a
    segment of the staging was marked as being written."""
    turns = 0
    while not until:
        turns += any(s.published() == WRITING for s in _segments(c))
        await anyio.sleep(0)
    return turns


@pytest.mark.asyncio
@pytest.mark.parametrize("scheme_name", schemes(pipes=True))
async def test_a_send_does_not_block_the_event_loop(make_cluster, scheme_name: str) -> None:
    """While a send waits for an ack, the loop it runs on keeps running. The
    model (32 MiB, past the 1 MiB below which a send copies inline) is
    written into the staging on a thread: a task of the same loop sees the
    staging marked as being written, which it never could if the copy
    blocked the loop. That is looked for over five sends: on a loaded
    machine a loop that is not blocked may still get no core during one copy
    of a few milliseconds."""
    c = make_cluster(["big"], trainer_kind="big")
    sender = c.scheme.get_async_sender()
    await sender.send()
    c.pause(0)
    ticks = 0
    writes_seen = 0
    report: list[ws.SendReport] = []

    longest_gap = 0.0

    async def ticker() -> None:
        nonlocal ticks, longest_gap
        last = time.monotonic()
        while not report:
            ticks += 1
            await anyio.sleep(0.005)
            now = time.monotonic()
            longest_gap, last = max(longest_gap, now - last), now

    async def watcher() -> None:
        nonlocal writes_seen
        writes_seen += await _turns_while_written(c, report)

    async def resume_later() -> None:
        await anyio.sleep(0.5)
        await anyio.to_thread.run_sync(c.resume, 0)

    async def send() -> None:
        c.bump()
        report.append(await sender.send(timeout=30))

    started = time.monotonic()
    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        group.start_soon(watcher)
        group.start_soon(resume_later)
        group.start_soon(send)
    assert time.monotonic() - started >= 0.5
    # A loop blocked while the send waits for the paused worker would not
    # tick for 0.5 s; a loaded machine (a second test run beside this one)
    # delays ticks by tens of milliseconds, never by most of the wait.
    assert longest_gap < 0.4, f"the loop stood still for {longest_gap:.3f} s during a send"
    assert ticks >= 10, f"the loop ran only {ticks} ticks during a 0.5 s send"
    for _ in range(4):
        report.clear()
        async with anyio.create_task_group() as group:
            group.start_soon(watcher)
            group.start_soon(send)
    assert writes_seen > 0, "the loop never ran while the staging was written"
    c.assert_has(0, c.expected())


@pytest.mark.asyncio
async def test_two_concurrent_async_sends_are_refused_not_mixed(make_cluster) -> None:
    c = make_cluster(["net"])
    sender = c.scheme.get_async_sender()
    outcomes: list[object] = []

    async def one() -> None:
        try:
            outcomes.append(await sender.send())
        except ws.WeightSyncStateError as exc:
            outcomes.append(exc)

    # The worker holds its ack until both sends have begun: a first send that
    # got its ack before the second began would not be concurrent at all.
    c.pause(0)
    async with anyio.create_task_group() as group:
        group.start_soon(one)
        group.start_soon(one)
        await anyio.sleep(0.2)
        await anyio.to_thread.run_sync(c.resume, 0)
    assert sum(isinstance(o, ws.SendReport) for o in outcomes) == 1
    assert sum(isinstance(o, ws.WeightSyncStateError) for o in outcomes) == 1


def test_send_async_tells_every_worker_before_it_returns(cluster: Cluster) -> None:
    """Once send_async() returned, every worker was told (the pipes): they
    apply the version while the trainer does other work, before anyone
    waits. The acks are gathered where the caller waits; done() never
    blocks, and hands the gathering to the background."""
    cluster.bump()
    handle = cluster.sender.send_async()
    deadline = time.monotonic() + 20
    for i in range(3):
        while handle.version not in cluster.state(i)["applied"]:
            assert time.monotonic() < deadline, f"worker {i} was not told before wait_async()"
            time.sleep(0.01)
    while not handle.done():
        assert time.monotonic() < deadline, "the acks were not gathered in the background"
        time.sleep(0.01)
    assert cluster.sender.wait_async().version == handle.version
    # And the usual way: the acks gathered by the waiting thread itself.
    cluster.bump()
    handle = cluster.sender.send_async()
    assert handle.wait().version == handle.version
    expected = cluster.expected()
    for i in range(3):
        cluster.assert_has(i, expected)
