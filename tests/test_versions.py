"""Versions on both sides, under every scheme (the Ray scheme's actors in a
test of their own): ``receiver.version`` (None
before the first update), ``receiver.wait_for_version`` (applies pending
updates while it waits, or waits for the applier; raises at its deadline),
and ``sender.worker_versions`` (the last version each worker acked)."""

from __future__ import annotations

import copy
import multiprocessing
import threading
from typing import Any

import pytest
from harness import background_workers as workers
from harness import make_scheme, reap, schemes, start_pipe_worker, start_worker
from harness.workers import Net

import weightsync as ws


class _Workers:
    """Two workers running ``version_worker``: processes on pipes, processes
    reached by rank (DistributedWeightSyncScheme: the trainer inits first,
    its store on 127.0.0.1) or threads (the in-process scheme)."""

    def __init__(self, scheme_name: str) -> None:
        self.scheme = make_scheme(scheme_name)
        self.conns: list[Any] = []
        self.runners: list[Any] = []
        pipes = []
        if scheme_name == "distributed":
            self.scheme.init_on_sender("policy", model=Net(), num_workers=2, host="127.0.0.1")
        for i in range(2):
            runner: Any
            if scheme_name == "inprocess":
                ctrl, ctrl_child = multiprocessing.Pipe()
                runner = threading.Thread(
                    target=workers.version_worker,
                    args=(copy.copy(self.scheme), None, ctrl_child, i),
                    daemon=True,
                )
                runner.start()
            elif scheme_name == "distributed":
                runner, ctrl = start_worker(
                    workers.version_worker, lambda ctrl, i=i: (self.scheme, None, ctrl, i + 1)
                )
            else:
                runner, ours, ctrl = start_pipe_worker(
                    workers.version_worker, lambda pipe, ctrl: (self.scheme, pipe, ctrl)
                )
                pipes.append(ours)
            self.conns.append(ctrl)
            self.runners.append(runner)
        if scheme_name == "inprocess":
            self.scheme.init_on_sender("policy", model=Net(), num_workers=2)
        elif scheme_name != "distributed":
            self.scheme.init_on_sender("policy", pipes=pipes, model=Net())
        self.pipes = pipes
        for conn in self.conns:
            assert conn.poll(60) and conn.recv()[0] == "ready"

    def ask(self, i: int, cmd: Any) -> Any:
        self.conns[i].send(cmd)
        assert self.conns[i].poll(30), f"worker {i} did not answer {cmd!r}"
        return self.conns[i].recv()

    def close(self) -> None:
        for conn in self.conns:
            conn.send("stop")
        for runner in self.runners:
            runner.join(20)
        reap([r for r in self.runners if not isinstance(r, threading.Thread)])
        self.scheme.shutdown()
        for conn in self.conns + self.pipes:
            conn.close()


@pytest.mark.parametrize("scheme_name", schemes(actors=False))
def test_versions_on_both_sides(scheme_name: str) -> None:
    cluster = _Workers(scheme_name)
    sender = cluster.scheme.get_sender()
    try:
        assert sender.worker_versions == {0: None, 1: None}
        assert cluster.ask(0, "version") is None
        sender.send_async()
        # Each worker's wait applies the pending update (the send is acked by it).
        assert cluster.ask(0, ("wait", 1, 10)) == ("ok", 1)
        assert cluster.ask(1, ("wait", 1, 10)) == ("ok", 1)
        assert sender.wait_async(10).version == 1
        assert sender.worker_versions == {0: 1, 1: 1}

        sender.send_async(worker_ids=[0])
        assert cluster.ask(0, ("wait", 2, 10)) == ("ok", 2)
        sender.wait_async(10)
        tag, message = cluster.ask(1, ("wait", 2, 0.3))  # never sent to worker 1
        assert tag == "timeout" and "version 2" in message and "applied: 1" in message
        assert sender.worker_versions == {0: 2, 1: 1}
        assert cluster.ask(1, "version") == 1

        # Applying in the background: the wait only waits.
        assert cluster.ask(0, "background") == cluster.ask(1, "background") == "ok"
        sender.send()
        assert cluster.ask(0, ("wait", 3, 10)) == cluster.ask(1, ("wait", 3, 10)) == ("ok", 3)
        assert sender.worker_versions == {0: 3, 1: 3}
    finally:
        cluster.close()


def _wait(actor: Any, version: int, timeout: float) -> tuple[str, Any]:
    """On the actor (through ``__ray_call__``): its receiver's wait."""
    try:
        return ("ok", actor.scheme.get_receiver().wait_for_version(version, timeout))
    except ws.WaitTimeoutError as exc:
        return ("timeout", str(exc))


def test_versions_on_both_sides_ray(ray_runtime: Any) -> None:
    import ray

    actors = ray_runtime.take(2)
    scheme = make_scheme("ray")
    try:
        ray.get([a.setup.remote(make_scheme("ray"), "policy", "net") for a in actors], timeout=60)
        scheme.init_on_sender("policy", remote_collectors=actors, model=Net())
        sender = scheme.get_sender()
        assert sender.worker_versions == {0: None, 1: None}
        version_of = lambda a: ray.get(a.__ray_call__.remote(lambda w: w.scheme.get_receiver().version))  # noqa: E731
        assert version_of(actors[0]) is None
        sender.send()
        assert ray.get([a.__ray_call__.remote(_wait, 1, 10) for a in actors], timeout=30) == [("ok", 1)] * 2
        sender.send(worker_ids=[0])
        assert sender.worker_versions == {0: 2, 1: 1}
        assert version_of(actors[0]) == 2 and version_of(actors[1]) == 1
        tag, message = ray.get(actors[1].__ray_call__.remote(_wait, 2, 0.3), timeout=30)
        assert tag == "timeout" and "applied: 1" in message
    finally:
        scheme.shutdown()
        ray.get([a.teardown.remote() for a in actors], timeout=30)
        ray_runtime.give_back(actors)
