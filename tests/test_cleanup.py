"""Nothing leaks: shared memory, threads, processes, file descriptors."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
from _workers import build_model, trainer_then_die
from conftest import PIPE_SCHEMES, SCHEMES, Cluster, fd_baseline, open_fds, shm_entries, weightsync_threads

import weightsync as ws


@pytest.fixture(params=PIPE_SCHEMES)
def scheme_name(request: pytest.FixtureRequest) -> str:
    """The pipe-based schemes: their memory, descriptors and processes are
    weightsync's to clean up."""
    return request.param


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_shutdown_on_both_sides_leaves_nothing(scheme_name: str) -> None:
    shm_before, fds_before = shm_entries(), fd_baseline()
    c = Cluster(scheme_name, ["net", "net"])
    for _ in range(3):
        c.bump()
        c.sender.send()
    worker_threads = []
    for i in range(2):
        c.ctrls[i].send("stop")
        assert c.ctrls[i].poll(30)
        tag, names = c.ctrls[i].recv()
        assert tag == "bye"
        worker_threads.append(names)
    for proc in c.procs:
        proc.join(20)
        assert proc.exitcode == 0
        proc.close()
    c.scheme.shutdown()
    c.scheme.shutdown()  # idempotent
    for conn in c.ctrls + c.pipes:
        conn.close()
    assert all(not any(n.startswith(("weightsync", "AnyIO")) for n in names) for names in worker_threads)
    assert _wait_for(lambda: not weightsync_threads()), weightsync_threads()
    assert mp.active_children() == []
    assert shm_entries() <= shm_before
    assert _wait_for(lambda: open_fds() <= fds_before), open_fds() - fds_before


def test_sigkilled_worker_leaves_nothing_behind(scheme_name: str) -> None:
    shm_before, fds_before = shm_entries(), fd_baseline()
    c = Cluster(scheme_name, ["net", "net"])
    c.sender.send()
    c.kill(0)
    with pytest.raises(ws.WorkerLostError):
        c.sender.send()
    c.close()
    assert shm_entries() <= shm_before
    assert _wait_for(lambda: not weightsync_threads()), weightsync_threads()
    assert _wait_for(lambda: open_fds() <= fds_before), open_fds() - fds_before
    assert mp.active_children() == []


def test_sigkilled_trainer_is_reported_to_the_worker_promptly(scheme_name: str) -> None:
    ctx = mp.get_context("spawn")
    shm_before = shm_entries()
    scheme = SCHEMES[scheme_name]()
    ours, theirs = ctx.Pipe()
    trainer = ctx.Process(target=trainer_then_die, args=(scheme, "policy", theirs, 2), daemon=True)
    trainer.start()
    theirs.close()
    model = build_model("net", seed=3)
    scheme.init_on_worker("policy", pipe=ours, model=model)
    try:
        applied = []
        while len(applied) < 2:
            version = scheme.receive(timeout=30)
            assert version, "the trainer's update did not arrive"
            applied.append(version)
        trainer.join(30)
        assert trainer.exitcode == -9
        started = time.monotonic()
        with pytest.raises(ws.SenderLostError) as info:
            scheme.receive(timeout=30)
        assert time.monotonic() - started < 5
        # A killed trainer is not a clean shutdown.
        assert not isinstance(info.value, ws.SenderClosedError)
        assert float(model.inp.weight.detach().sum()) != 0.0
    finally:
        scheme.shutdown()
        ours.close()
    assert shm_entries() <= shm_before
    assert _wait_for(lambda: not weightsync_threads()), weightsync_threads()
