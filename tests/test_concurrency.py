"""Concurrent sends: several models over the same workers, sends from
several threads or tasks at once, blocking and async sends mixed. Every
worker ends at the last version of each model and every ack matches its own
send."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from harness import PROCS, Cluster, RayRuntime, make_scheme, reap, schemes, start_worker
from harness.workers import build_model, two_model_worker

import weightsync as ws

MODELS = ("policy", "value")
SENDS = 30


def _bump(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(1)


def _send_from_threads(schemes: dict[str, ws.WeightSyncScheme], trainers: dict[str, torch.nn.Module]) -> None:
    """Each model's sender runs SENDS blocking sends on a thread of its own."""
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            for expected in range(1, SENDS + 1):
                _bump(trainers[name])
                report = schemes[name].send()
                assert report is not None and report.version == expected
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in MODELS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors


def _matches(got: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    return all(torch.equal(got[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("scheme_name", schemes(pipes=True))
def test_two_models_over_the_same_worker_processes_from_two_threads(scheme_name: str) -> None:
    trainers = {"policy": build_model("net", seed=21), "value": build_model("wide", seed=22)}
    by_model = {name: make_scheme(scheme_name) for name in MODELS}
    procs, ctrls, ours = [], [], {name: [] for name in MODELS}
    try:
        for _ in range(2):
            pipes = {name: PROCS.Pipe() for name in MODELS}
            theirs = {n: p[1] for n, p in pipes.items()}
            proc, ctrl = start_worker(two_model_worker, lambda ctrl, theirs=theirs: (by_model, theirs, ctrl))
            for name, (mine, theirs) in pipes.items():
                theirs.close()
                ours[name].append(mine)
            procs.append(proc)
            ctrls.append(ctrl)
        for name in MODELS:
            by_model[name].init_on_sender(name, pipes=ours[name], model=trainers[name])
        for ctrl in ctrls:
            assert ctrl.poll(60) and ctrl.recv()[0] == "ready"
        _send_from_threads(by_model, trainers)
        for ctrl in ctrls:
            ctrl.send("state")
            assert ctrl.poll(30)
            state = ctrl.recv()
            for name in MODELS:
                assert state["applied"][name] == list(range(1, SENDS + 1))
                assert _matches(state["weights"][name], trainers[name])
    finally:
        for ctrl in ctrls:
            ctrl.send("stop")
        reap(procs)
        for scheme in by_model.values():
            scheme.shutdown()
        for conn in ctrls + ours["policy"] + ours["value"]:
            conn.close()


def test_two_models_over_the_same_ray_actors_from_two_threads(ray_runtime: RayRuntime) -> None:
    ray = pytest.importorskip("ray")
    actors = ray_runtime.take(2)  # test actors, one on each node
    ray.get([a.setup_two_models.remote(ws.RayWeightSyncScheme(), ws.RayWeightSyncScheme()) for a in actors])
    trainers = {"policy": build_model("net", seed=21), "value": build_model("wide", seed=22)}
    by_model: dict[str, ws.WeightSyncScheme] = {}
    try:
        for name in MODELS:
            by_model[name] = ws.RayWeightSyncScheme(timeout=30)
            by_model[name].init_on_sender(name, remote_collectors=actors, model=trainers[name])
        _send_from_threads(by_model, trainers)
        for got in ray.get([a.weights.remote() for a in actors]):
            for name in MODELS:
                assert _matches(got[name], trainers[name])
    finally:
        for scheme in by_model.values():
            scheme.shutdown()
        ray.get([a.teardown.remote() for a in actors], timeout=30)
        ray_runtime.give_back(actors)


def test_blocking_background_and_awaited_sends_mixed(make_cluster) -> None:
    c: Cluster = make_cluster(["net", "net"])
    sender = c.sender
    versions = []
    for _ in range(10):
        c.bump()
        versions.append(sender.send().version)
        c.bump()
        sender.send_async()
        versions.append(sender.wait_async().version)
        c.bump()
        versions.append(asyncio.run(sender.async_sender.send()).version)
    assert versions == list(range(1, 31))
    for i in range(2):
        c.assert_has(i, c.expected())
        assert c.state(i)["applied"][-1] == 30


def test_sends_of_two_models_from_one_event_loop_overlap(make_cluster) -> None:
    first: Cluster = make_cluster(["net", "net"], model_id="policy")
    second: Cluster = make_cluster(["net", "net"], model_id="value")

    async def trainer() -> list[tuple[int, int]]:
        pairs = []
        ticks = 0

        async def other_work() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(other_work())
        for _ in range(20):
            first.bump()
            second.bump()
            a, b = await asyncio.gather(
                first.scheme.get_async_sender().send(), second.scheme.get_async_sender().send()
            )
            pairs.append((a.version, b.version))
        ticker.cancel()
        assert ticks > 20, "the sends blocked the event loop"
        return pairs

    pairs = asyncio.run(trainer())
    assert pairs == [(v, v) for v in range(1, 21)]
    for c in (first, second):
        for i in range(2):
            c.assert_has(i, c.expected())
