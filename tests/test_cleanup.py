"""Nothing leaks: shared memory, threads, processes, file descriptors.

weightsync's segments are memfd: they never appear in /dev/shm, only as
``memfd:weightsync`` entries in a process's descriptors (/proc/<pid>/fd) and
memory mappings (/proc/<pid>/maps). Each test first sees those entries while
a send is live (so its checks can fail), then checks that they are gone, in
the trainer and in the workers.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time

import pytest
import torch
from harness import (
    Cluster,
    fd_baseline,
    make_scheme,
    new_cluster,
    open_fds,
    schemes,
    shm_entries,
    spec,
    start_worker,
    weightsync_threads,
)
from harness.workers import build_model, leftovers, memfd_fds, memfd_maps, trainer_then_die

import weightsync as ws

# The schemes whose worker processes, memory and descriptors are weightsync's
# to clean up (a Ray actor's process is Ray's; the in-process scheme's
# workers are threads, which the leak checks of the other suites count).
pytestmark = pytest.mark.parametrize("scheme_name", schemes(processes=True, actors=False))


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _assert_live(c: Cluster) -> None:
    """While the scheme is up, weightsync's segments are held open and mapped
    (the checks below see them): a pipe scheme's trainer stages into its
    own, and every worker maps one (the trainer's, or under
    DistributedWeightSyncScheme the host leader's or its own)."""
    if spec(c.scheme_name).pipes:
        assert memfd_fds(), "the trainer holds no weightsync segment during a send"
        assert memfd_maps(), "the trainer maps no weightsync segment during a send"
    for pid in c.pids:
        if _alive(pid):
            assert memfd_maps(pid), f"worker {pid} maps no weightsync segment after a send"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _assert_worker_left_nothing(who: str, what: dict[str, list[str]], scheme_name: str) -> None:
    """``what`` a worker holds after its shutdown (``harness.workers.leftovers``)."""
    assert not any(n.startswith(("weightsync", "AnyIO")) for n in what["threads"]), what
    assert what["new_fds"] == [], f"{who} keeps descriptors weightsync opened: {what['new_fds']}"
    assert what["unused_memfd_maps"] == [], f"{who} still maps segments: {what['unused_memfd_maps']}"
    if scheme_name == "multiprocess":
        assert what["used_memfd_maps"] == [], f"{who}'s model runs on shared memory: {what}"
    # The one segment a shared-scheme worker's parameters still run on stays
    # mapped, with its mapping's descriptor; no other.
    assert len(what["used_memfd_maps"]) <= 1, what
    assert len(what["memfd_fds"]) <= len(what["used_memfd_maps"]), f"{who} keeps segments open: {what}"


def _assert_trainer_holds_no_segment() -> None:
    assert _wait_for(lambda: not memfd_fds()), memfd_fds()
    assert _wait_for(lambda: not memfd_maps()), memfd_maps()


def test_shutdown_on_both_sides_leaves_nothing(request: pytest.FixtureRequest, scheme_name: str) -> None:
    shm_before, fds_before = shm_entries(), fd_baseline()
    c = new_cluster(request, scheme_name, ["net", "net"])
    for _ in range(3):
        c.bump()
        c.sender.send()
    _assert_live(c)
    left = []
    for i in range(2):
        c.ctrls[i].send("stop")
        assert c.ctrls[i].poll(30)
        tag, what = c.ctrls[i].recv()
        assert tag == "bye"
        left.append(what)
    for proc in c.procs:
        proc.join(20)
        assert proc.exitcode == 0
        proc.close()
    c.scheme.shutdown()
    c.scheme.shutdown()  # idempotent
    for conn in c.ctrls + c.pipes:
        conn.close()
    for i, what in enumerate(left):
        _assert_worker_left_nothing(f"worker {i}", what, scheme_name)
    assert _wait_for(lambda: not weightsync_threads()), weightsync_threads()
    assert mp.active_children() == []
    assert shm_entries() <= shm_before
    assert _wait_for(lambda: open_fds() <= fds_before), open_fds() - fds_before
    _assert_trainer_holds_no_segment()


def test_sigkilled_worker_leaves_nothing_behind(request: pytest.FixtureRequest, scheme_name: str) -> None:
    shm_before, fds_before = shm_entries(), fd_baseline()
    c = new_cluster(request, scheme_name, ["net", "net"])
    c.sender.send()
    _assert_live(c)
    c.kill(0)
    with pytest.raises(ws.WorkerLostError):
        c.sender.send()
    c.close()
    assert shm_entries() <= shm_before
    assert _wait_for(lambda: not weightsync_threads()), weightsync_threads()
    assert _wait_for(lambda: open_fds() <= fds_before), open_fds() - fds_before
    assert mp.active_children() == []
    _assert_trainer_holds_no_segment()


def test_sigkilled_trainer_is_reported_to_the_worker_promptly(scheme_name: str) -> None:
    """The test process is the worker here (its model after shutdown keeps
    nothing of weightsync's but, under the shared scheme, the slot it runs
    on); the trainer is a child process that sends twice (its ``inp.weight`` plus 1, then plus 2) and SIGKILLs
    itself."""
    shm_before = shm_entries()
    scheme = make_scheme(scheme_name)
    trainer, ours = start_worker(trainer_then_die, lambda pipe, scheme=scheme: (scheme, "policy", pipe, 2))
    model = build_model("net", seed=3)
    fds_before = set(os.listdir("/proc/self/fd"))
    expected = build_model("net", seed=7).state_dict()  # the trainer's model...
    for _ in range(2):  # ...after its two sends
        expected["inp.weight"].add_(1)
    try:
        if scheme_name == "distributed":
            assert ours.poll(60), "the trainer did not say where its store is"
            scheme.init_on_worker("policy", model=model, worker_idx=1, store_info=ours.recv())
        else:
            scheme.init_on_worker("policy", pipe=ours, model=model)
        assert scheme.receive(timeout=30) == 1, "the trainer's first update did not arrive"
        if spec(scheme_name).pipes:
            # The trainer now waits for the ack of its second send: it is
            # alive and holds its segment, which this worker maps.
            assert memfd_fds(trainer.pid) and memfd_maps(trainer.pid), "the trainer holds no segment"
            assert memfd_maps(), "this worker maps no segment of the trainer's"
        assert scheme.receive(timeout=30) == 2, "the trainer's second update did not arrive"
        trainer.join(30)
        assert trainer.exitcode == -9
        started = time.monotonic()
        with pytest.raises(ws.SenderLostError) as info:
            scheme.receive(timeout=30)
        assert time.monotonic() - started < 5
        # A killed trainer is not a clean shutdown.
        assert not isinstance(info.value, ws.SenderClosedError)
        # The worker holds the trainer's last weights, exactly.
        got = model.state_dict()
        assert set(got) == set(expected)
        for name, value in expected.items():
            assert torch.equal(got[name], value), name
    finally:
        scheme.shutdown()
        ours.close()
    assert shm_entries() <= shm_before
    assert _wait_for(lambda: not weightsync_threads()), weightsync_threads()
    # Under the shared scheme the model's parameters still run on the dead
    # trainer's slot: that mapping stays while they do, and no other.
    what = leftovers(model.state_dict().values(), fds_before)
    what["threads"] = []  # (this process's threads: checked above)
    _assert_worker_left_nothing("this worker", what, scheme_name)
    del model, got, scheme, info  # (the error's traceback holds the receiver, with the model)
    gc.collect()
    assert _wait_for(lambda: not memfd_maps()), memfd_maps()
    assert memfd_fds() == []
