"""Workers join, leave and come back while the trainer runs: a new worker
gets the latest weights alone; a removed one hears a clean shutdown and the
others go on; a dead one, restarted, rejoins under its old id (a new process
with a new pipe, or a Ray actor restarted by Ray with no trainer action)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
from harness import Cluster, RayCluster, schemes, start_pipe_worker
from harness import background_workers as workers
from harness.workers import worker_main

import weightsync as ws


def _start_worker(cluster: Cluster) -> Any:
    """One more worker process for ``cluster``: the trainer's end of its pipe."""
    proc, ours, ctrl = start_pipe_worker(
        worker_main, lambda pipe, ctrl: (cluster.scheme, cluster.model_id, pipe, ctrl, "net")
    )
    assert ctrl.poll(60)
    tag, pid = ctrl.recv()
    assert tag == "ready"
    cluster.procs.append(proc)
    cluster.ctrls.append(ctrl)
    cluster.pipes.append(ours)
    cluster.pids.append(pid)
    return ours


@pytest.mark.parametrize("scheme_name", schemes(pipes=True))
def test_workers_join_leave_and_come_back(scheme_name: str) -> None:
    cluster = Cluster(scheme_name, ["net", "net"])
    scheme = cluster.scheme
    try:
        cluster.bump()
        assert scheme.send().version == 1

        # Join: the new worker gets the latest weights, alone.
        cluster.bump()
        joined = scheme.add_worker(_start_worker(cluster))
        assert joined == 2
        cluster.assert_has(2, cluster.expected())
        assert cluster.state(0)["applied"] == [1] and cluster.state(1)["applied"] == [1]
        assert scheme.get_sender().worker_versions == {0: 1, 1: 1, 2: 2}

        # Leave: worker 1 hears a clean shutdown; the others go on.
        scheme.remove_worker(1)
        if scheme_name == "shared":
            assert 1 not in scheme.staging.host._ledger._holding  # its slot is free again
        cluster.bump()
        assert scheme.send().worker_ids == (0, 2)
        cluster.assert_has(0, cluster.expected())
        cluster.assert_has(2, cluster.expected())
        deadline = time.monotonic() + 10
        while not cluster.state(1)["errors"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cluster.state(1)["errors"][0].startswith("SenderClosedError")

        # Come back: worker 0 dies; a new process rejoins under its old id.
        cluster.kill(0)
        cluster.bump()
        with pytest.raises(ws.WorkerLostError, match="worker 0") as lost:
            scheme.send()
        assert lost.value.worker_ids == (0,)
        cluster.assert_has(2, cluster.expected())
        assert scheme.add_worker(_start_worker(cluster), worker_id=0) == 0
        cluster.assert_has(len(cluster.procs) - 1, cluster.expected())
        cluster.bump()
        assert scheme.send().worker_ids == (0, 2)
        cluster.assert_has(len(cluster.procs) - 1, cluster.expected())
        with pytest.raises(ws.UnknownWorkerError):
            scheme.remove_worker(1)  # gone already
    finally:
        cluster.close()


def test_ray_actors_join_and_leave(ray_runtime: Any) -> None:
    import ray

    cluster = RayCluster(ray_runtime, ["net", "net"])
    scheme = cluster.scheme
    try:
        cluster.bump()
        scheme.send()
        newcomer = ray_runtime.take(1)[0]
        ray.get(newcomer.setup.remote(ws.RayWeightSyncScheme(), "policy", "net"), timeout=60)
        cluster.actors.append(newcomer)
        cluster.bump()
        assert scheme.add_worker(newcomer) == 2
        cluster.assert_has(2, cluster.expected())
        assert cluster.state(0)["applied"] == [1]
        scheme.remove_worker(0)
        cluster.bump()
        assert scheme.send().worker_ids == (1, 2)
        cluster.assert_has(1, cluster.expected())
        assert cluster.state(0)["applied"] == [1]
    finally:
        cluster.close()


@pytest.mark.extended  # Ray restarts the actor: a new process that imports torch
def test_a_ray_actor_restarted_by_ray_rejoins_with_no_trainer_action(ray_runtime: Any) -> None:
    import ray

    actor_class = ray.remote(num_cpus=0, max_restarts=1)(workers.RestartingCollector)
    actor = actor_class.remote()
    scheme = ws.RayWeightSyncScheme(timeout=60)
    trainer = workers.Net()
    try:
        scheme.init_on_sender("policy", remote_collectors=[actor], model=trainer)
        scheme.send()
        os.kill(ray.get(actor.pid.remote(), timeout=30), signal.SIGKILL)
        with torch.no_grad():
            trainer.inp.weight.add_(1.0)
        # Sends that race the restart name the actor; one soon succeeds.
        deadline = time.monotonic() + 60
        while True:
            try:
                report = scheme.send()
                break
            except ws.WorkerLostError as exc:
                assert exc.worker_ids == (0,)
                assert time.monotonic() < deadline, "the restarted actor never rejoined"
                time.sleep(0.2)
        weights, version = ray.get(actor.state.remote(), timeout=30)
        assert version == report.version
        assert torch.equal(weights["inp.weight"], trainer.inp.weight.detach())
    finally:
        scheme.shutdown()
        ray.kill(actor)
