"""What only the Ray scheme does: several nodes, when an actor applies an
update, async actors, the optional mixin, actors that register late.

The conformance suite covers the rest of the Ray scheme (test_conformance.py).
All tests share the session's two-node Ray test cluster.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness import RayCluster, RayRuntime, torn_read_probe
from harness.workers import (
    AsyncActorRegisteringLate,
    AsyncRayProbe,
    MixinRayWorker,
    RayProbe,
    build_model,
    probe_weights,
    register_off_the_loop,
)

import weightsync as ws

ray = pytest.importorskip("ray")


def _sender(actors: list, model: object, model_id: str = "probe") -> ws.RayWeightSyncScheme:
    scheme = ws.RayWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model_id, remote_collectors=actors, model=model)
    return scheme


def test_actors_on_two_nodes_get_every_update(ray_runtime: RayRuntime) -> None:
    c = RayCluster(ray_runtime, ["probe", "probe"], trainer_kind="probe")  # one actor on each node
    try:
        nodes = ray.get([c._ctrl(i, "node_id") for i in range(2)], timeout=30)
        assert nodes[0] != nodes[1], "the actors must run on different nodes"
        for version in (1, 2, 3):
            torn_read_probe.fill(c.model, version)
            report = c.sender.send()
            assert report.version == version
            # 16 MiB crossed to the second node's object store each time.
            for i in range(2):
                assert torn_read_probe.span(c.state(i)["weights"]) == (version, version)
        assert [c.state(i)["applied"] for i in range(2)] == [[1, 2, 3], [1, 2, 3]]
    finally:
        c.close()


def test_a_plain_actor_applies_an_update_between_its_method_calls(ray_runtime: RayRuntime) -> None:
    actor = ray.remote(num_cpus=0)(RayProbe).remote(ws.RayWeightSyncScheme())
    weights = probe_weights()
    scheme = _sender([actor], weights)
    try:
        torn_read_probe.fill(weights, 1)
        scheme.send()
        rollout = actor.timed_rollout.remote(1.0)
        time.sleep(0.3)  # the rollout is most likely running (the update queues behind it anyway)
        torn_read_probe.fill(weights, 2)
        scheme.send()
        returned = time.monotonic()
        seen = ray.get(rollout)
        assert seen["first"] == seen["last"] == (1, 1), "the weights changed during a method call"
        # The update was applied (and acked) only once the method had ended,
        # however long the machine took to run either.
        assert returned > seen["ended"], "the send returned before the running method ended"
        assert ray.get(actor.rollout.remote(0.0))[0] == (2, 2)
    finally:
        scheme.shutdown()
        ray.kill(actor)


def test_an_async_actor_applies_updates_between_awaits(ray_runtime: RayRuntime) -> None:
    actor = ray.remote(num_cpus=0)(AsyncRayProbe).remote(ws.RayWeightSyncScheme())
    weights = probe_weights()
    scheme = _sender([actor], weights)
    try:
        torn_read_probe.fill(weights, 1)
        scheme.send()
        sends = 1
        # The first update to land while one of the actor's async methods
        # runs took 1.6 to 2.4 s on the project's 2-core machine, later ones
        # 25 to 65 ms (with the tree before the send became a machine too):
        # that one is made during a scan of its own first, so that the scan
        # below, whose 2.5 s it could take up, sees updates land.
        warm = actor.scan.remote(1.0)
        sends += 1
        torn_read_probe.fill(weights, sends)
        scheme.send()
        ray.get(warm)
        scan = actor.scan.remote(2.5)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            sends += 1
            torn_read_probe.fill(weights, sends)
            scheme.send()
        report = ray.get(scan)
        assert report["mixed"] == 0, report
        # The scan went on while updates were applied: it saw several versions.
        assert len(report["values"]) >= 3, report
        assert ray.get(actor.applied.remote())[-1] == sends
    finally:
        scheme.shutdown()
        ray.kill(actor)


def test_a_new_sender_is_not_mistaken_for_a_late_one(ray_runtime: RayRuntime) -> None:
    cluster = RayCluster(ray_runtime, ["net"])
    try:
        for _ in range(3):
            cluster.bump()
            cluster.sender.send()
        cluster.scheme.shutdown()
        # A restarted trainer: a new scheme whose versions start at 1 again.
        trainer = cluster.model
        with torch.no_grad():
            trainer.out.weight.fill_(-5.0)
        cluster.scheme = _sender(cluster.actors, trainer, model_id="policy")
        assert cluster.sender.send().version == 1
        cluster.assert_has(0, cluster.expected())
    finally:
        cluster.close()


def test_an_actor_with_the_mixin_is_updated_through_its_method(ray_runtime: RayRuntime) -> None:
    actor = ray.remote(num_cpus=0)(MixinRayWorker).remote(ws.RayWeightSyncScheme())
    model = _probe_net()
    scheme = _sender([actor], model, model_id="policy")
    try:
        assert ray.get(actor.state.remote())[1] is None  # nothing applied yet
        report = scheme.send()
        weights, received = ray.get(actor.state.remote())
        assert received == report.version
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
        assert ray.get(actor.state.remote())[1] is None  # reported once
    finally:
        scheme.shutdown()
        ray.kill(actor)


def test_an_actor_that_registers_late_is_waited_for_until_the_deadline(ray_runtime: RayRuntime) -> None:
    [actor] = ray_runtime.take(1)  # a test actor with no model registered
    model = _probe_net()
    scheme = _sender([actor], model, model_id="policy")
    try:
        with pytest.raises(ws.AckTimeoutError, match="worker 0") as info:
            scheme.send(timeout=1.0)
        assert "announce" in str(info.value)
        ray.get(actor.setup.remote(ws.RayWeightSyncScheme(), "policy", "net"))
        scheme.send()
        weights = ray.get(actor.state.options(concurrency_group="ctrl").remote())["weights"]
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    finally:
        scheme.shutdown()
        ray.get(actor.teardown.remote(), timeout=30)
        ray_runtime.give_back([actor])


def test_two_models_on_the_same_actors_are_kept_apart(ray_runtime: RayRuntime) -> None:
    actors = ray_runtime.take(2)  # test actors, one on each node
    ray.get([a.setup_two_models.remote(ws.RayWeightSyncScheme(), ws.RayWeightSyncScheme()) for a in actors])
    trainers = {"policy": build_model("net", seed=21), "value": build_model("wide", seed=22)}
    schemes = {name: _sender(actors, model, model_id=name) for name, model in trainers.items()}
    try:
        for _ in range(3):
            for name in ("value", "policy"):
                with torch.no_grad():
                    trainers[name].out.bias.add_(1)
                schemes[name].send()
        for got in ray.get([a.weights.remote() for a in actors]):
            for name, model in trainers.items():
                assert all(torch.equal(got[name][k], v) for k, v in model.state_dict().items())
    finally:
        for scheme in schemes.values():
            scheme.shutdown()
        ray.get([a.teardown.remote() for a in actors], timeout=30)
        ray_runtime.give_back(actors)


def _probe_net() -> torch.nn.Module:
    return build_model("net", seed=11)


# A second Ray driver (about 20 s on 2 cores): with -m extended, a CI step.
@pytest.mark.extended
def test_a_killed_trainer_takes_its_actors_with_it(ray_runtime: RayRuntime) -> None:
    """Ray's fate-sharing: a collector never waits for a trainer that died."""
    import os
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    address = ray_runtime.nodes.address
    code = f"from harness.workers import ray_trainer_then_die; ray_trainer_then_die({address!r}, 'orphan')"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tests_dir,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    actor_pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{actor_pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{actor_pid}"), "the collector outlived its trainer"
    with pytest.raises(ValueError):
        ray.get_actor("orphan", namespace="weightsync-tests")


def test_an_async_actor_must_register_where_its_loop_runs(ray_runtime: RayRuntime) -> None:
    actor = ray.remote(num_cpus=0)(AsyncActorRegisteringLate).remote()
    try:
        assert ray.get(actor.ping.remote())
        refused = ray.get(actor.__ray_call__.remote(register_off_the_loop))
        assert "call it from the actor's __init__ or one of its methods" in refused
    finally:
        ray.kill(actor)


def test_delta_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # An entry of None in sys.modules makes ``import blosc2`` fail as if it
    # were not installed: refused at construction, before anything moves.
    monkeypatch.setitem(sys.modules, "blosc2", None)
    with pytest.raises(ws.MissingExtraError, match=r"pip install 'weightsync\[delta\]'"):
        ws.RayWeightSyncScheme(delta=True)


def test_delta_on_one_host_sends_the_bytes_as_they_are(ray_runtime: RayRuntime) -> None:
    """Actors on the trainer's node and on one other: no relay, so Ray's
    object store carries the bytes as ever, and ``delta=True`` changes
    nothing (no chain, no wire bytes of weightsync's own)."""
    pytest.importorskip("blosc2")
    c = RayCluster(ray_runtime, ["probe", "probe"], trainer_kind="probe", delta=True)
    try:
        assert c.scheme.delta and pickle.loads(pickle.dumps(c.scheme)).delta
        for version in (1, 2, 3):
            torn_read_probe.fill(c.model, version)
            assert c.sender.send().version == version
            for i in range(2):
                assert torn_read_probe.span(c.state(i)["weights"]) == (version, version)
            assert c.scheme.last_delta == [] and c.scheme.last_wire_bytes == 0
    finally:
        c.close()


# -- the relay across nodes: each node's actors read their agent's shared memory --


@pytest.fixture(scope="module")
def third_node(ray_runtime: RayRuntime) -> Iterator[str]:
    """A third node in the session's Ray cluster for this module's relay
    tests (the trainer's node and two more: the relay runs from two other
    nodes on), removed afterwards. Its actors are pinned with the resource
    it names."""
    node = ray_runtime.nodes.add_node(num_cpus=1, object_store_memory=256 << 20, resources={"third_node": 1})
    ray_runtime.nodes.wait_for_nodes()
    yield "third_node"
    ray_runtime.nodes.remove_node(node)


def _relayed_pair(ray_runtime: RayRuntime, third: str, model: object, **options: object) -> tuple:
    """One actor on the second node and one on the third (both relayed),
    set up with a scheme whose sender is ready (a send done), and the
    version of that send."""
    actors = [ray_runtime.actor("second_node"), ray_runtime.actor(third)]
    scheme = ws.RayWeightSyncScheme(timeout=60, **options)
    ray.get([a.setup.remote(scheme, "relayed", "net") for a in actors], timeout=120)
    scheme.init_on_sender("relayed", remote_collectors=actors, model=model)
    scheme.connect()
    version = scheme.send().version
    assert scheme.staging.relay is not None and scheme.staging.relay.last_attempts, "the relay was not used"
    return actors, scheme, version


def _bump(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_relayed_reader_still_copying_keeps_its_bytes_while_the_next_send_proceeds(
    ray_runtime: RayRuntime, third_node: str, tmp_path: Path
) -> None:
    """An actor still copying a send its trainer abandoned (past the
    deadline) holds its host's copy: the next send's agent receives into
    another buffer, so the slow actor applies exactly the bytes of the
    version it was sent, then the next."""
    from harness.workers import applied_weights, slow_applies

    model = build_model("net", seed=7)
    actors, scheme, v = _relayed_pair(ray_runtime, third_node, model)
    fast, slow = actors
    copying, release = tmp_path / "copying", tmp_path / "release"
    try:
        ray.get(slow.__ray_call__.remote(slow_applies, str(copying), str(release)), timeout=30)
        abandoned = _bump(model)
        with pytest.raises(ws.AckTimeoutError, match="worker 1"):
            scheme.send(timeout=10.0)
        assert copying.exists(), "the slow actor never began to apply the abandoned send"
        # The slow actor is inside its copy of the abandoned send while the next one goes.
        following = _bump(model)
        sender = scheme.get_sender()
        sender.send_async(timeout=60)
        _wait_applied(fast, v + 2)
        release.touch()
        assert sender.wait_async().version == v + 2
        weights = ray.get(slow.__ray_call__.remote(applied_weights), timeout=30)
        assert sorted(weights) == [v + 1, v + 2]
        assert _equal(weights[v + 1], abandoned), "the slow actor applied bytes of another version"
        assert _equal(weights[v + 2], following)
    finally:
        release.touch()
        scheme.shutdown()
        for a in actors:
            ray.kill(a)


def _wait_applied(actor: object, version: int) -> None:
    """Wait until ``actor`` applied ``version`` (so the relay's chain of that send is done)."""
    deadline = time.monotonic() + 30
    while (
        version not in ray.get(actor.state.options(concurrency_group="ctrl").remote(), timeout=30)["applied"]
    ):
        assert time.monotonic() < deadline, f"the other actor never got version {version}"
        time.sleep(0.1)
    time.sleep(0.2)


def test_a_late_relayed_reader_of_a_rewritten_copy_refuses_and_leaves_its_model(
    ray_runtime: RayRuntime, third_node: str
) -> None:
    """An actor busy past the deadline of a send reads its host's copy only
    after the next send rewrote it: the late call refuses (its model
    untouched, never half-written), and the next send's call applies."""
    from harness.workers import applied_weights, slow_applies

    model = build_model("net", seed=8)
    actors, scheme, v = _relayed_pair(ray_runtime, third_node, model)
    late = actors[1]
    try:
        ray.get(late.__ray_call__.remote(slow_applies, "/dev/null", "/dev/null", 0), timeout=30)
        held = late.hold.remote(60.0)
        assert ray.get(late.wait_held.options(concurrency_group="ctrl").remote(), timeout=30)
        _bump(model)
        with pytest.raises(ws.AckTimeoutError, match="worker 1"):
            scheme.send(timeout=10.0)
        # The late actor's call of that send waits; the next send rewrites its host's copy.
        following = _bump(model)
        sender = scheme.get_sender()
        sender.send_async(timeout=60)
        _wait_applied(actors[0], v + 2)
        ray.get(late.release.options(concurrency_group="ctrl").remote(), timeout=30)
        ray.get(held, timeout=30)
        assert sender.wait_async().version == v + 2
        weights = ray.get(late.__ray_call__.remote(applied_weights), timeout=30)
        assert sorted(weights) == [v + 2], "the late call of the abandoned send wrote into the model"
        assert _equal(weights[v + 2], following)
        assert ray.get(late.state.remote(), timeout=30)["applied"][-2:] == [v, v + 2]
    finally:
        scheme.shutdown()
        for a in actors:
            ray.kill(a)


def test_relayed_host_copies_leave_nothing_behind(ray_runtime: RayRuntime, third_node: str) -> None:
    """The agents' segments go with the scheme's shutdown (the agents end),
    an actor's mappings with its own shutdown, and a killed actor's with it."""
    from harness.workers import host_copy_state, memfd_fds, memfd_maps

    model = build_model("net", seed=9)
    actors, scheme, _ = _relayed_pair(ray_runtime, third_node, model)
    try:
        _bump(model)
        scheme.send()
        states = ray.get([a.__ray_call__.remote(host_copy_state) for a in actors], timeout=30)
        assert all(s["maps"] for s in states), f"an actor maps no host copy: {states}"
        relay = scheme.staging.relay
        agents = [ray.get(agent.ping.remote(), timeout=30) for agent in relay._agents.values()]
        assert all(memfd_fds(pid) for pid in agents), "an agent holds no segment"
        # A killed actor takes its mappings with it; the agent is unaffected.
        ray.kill(actors[1])
        _bump(model)
        with pytest.raises(ws.WorkerLostError):
            scheme.send()
        ray.get([a.teardown.remote() for a in actors[:1]], timeout=30)
        scheme.shutdown()
        deadline = time.monotonic() + 20
        while any(os.path.exists(f"/proc/{pid}") for pid in agents) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in agents), "a relay agent outlived the scheme"
        left = ray.get(actors[0].__ray_call__.remote(host_copy_state), timeout=30)
        assert left["maps"] == [] and left["fds"] == [], left
        assert memfd_fds() == [] and memfd_maps() == []
    finally:
        scheme.shutdown()
        for a in actors:
            ray.kill(a)
