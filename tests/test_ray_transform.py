"""RayModuleTransformScheme: torchrl's scheme for the module of a
``RayModuleTransform``, with weightsync's guarantees. The Ray tests run a
real actor that holds its module as torchrl's ``ModuleTransform`` does
(``harness.transform_actor``) in the session's Ray (extended); the rest
needs no Ray. tests/test_torchrl.py runs it in torchrl's own transform."""

from __future__ import annotations

import inspect
import pickle
import time
from typing import Any

import pytest
import torch
from harness import RayRuntime
from harness.transform_actor import TransformActor, TransformHandle, make_module

import weightsync as ws


def test_it_is_made_as_torchrls_and_refuses_what_it_cannot_do() -> None:
    params = inspect.signature(ws.RayModuleTransformScheme).parameters
    assert list(params)[:2] == ["strategy", "backend"]
    scheme = ws.RayModuleTransformScheme("state_dict", "gloo")
    assert scheme.strategy_str == "state_dict" and scheme.backend == "gloo"
    assert ws.RayModuleTransformScheme().strategy_str == "tensordict"
    with pytest.raises(ValueError, match="nccl"):
        ws.RayModuleTransformScheme(backend="nccl")
    with pytest.raises(ValueError, match="gloo"):
        ws.RayModuleTransformScheme(backend="mpi")
    with pytest.raises(ValueError, match="RayModuleTransform"):
        scheme.init_on_sender("transform_module")  # no transform: nothing to reach
    assert not scheme.initialized_on_sender


def test_the_transform_stays_with_the_trainer_when_pickled() -> None:
    scheme = ws.RayModuleTransformScheme(timeout=5)
    scheme._set_transform(TransformHandle(actor=object()))
    copy = pickle.loads(pickle.dumps(scheme))
    assert copy.timeout == 5 and copy._ray_transform is None


ray = pytest.importorskip("ray")


def _actor(ray_runtime: RayRuntime, **kwargs: Any) -> Any:
    del ray_runtime  # (Ray is up)
    return ray.remote(num_cpus=0)(TransformActor).remote(**kwargs)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _sender(actor: Any, model: Any = None, timeout: float = 30) -> ws.RayModuleTransformScheme:
    scheme = ws.RayModuleTransformScheme(timeout=timeout)
    scheme._set_transform(TransformHandle(actor))  # as RayModuleTransform does
    scheme.init_on_sender(model=model) if model is not None else scheme.init_on_sender()
    return scheme


def test_each_send_is_applied_acked_and_versioned(ray_runtime: RayRuntime) -> None:
    actor = _actor(ray_runtime)
    trainer = make_module(1)
    scheme = _sender(actor, trainer)
    try:
        report = scheme.connect()  # the actor initialises its side, then the initial weights
        assert report is not None and report.version == 1 and report.worker_ids == (0,)
        assert _same(ray.get(actor.weights.remote()), trainer.state_dict())
        for version in (2, 3):
            with torch.no_grad():
                trainer.bias.add_(1.0)
            report = scheme.send()
            assert report.version == version  # returned once the actor applied and acked it
            assert _same(ray.get(actor.weights.remote()), trainer.state_dict())
        assert ray.get(actor.version.remote()) == 3
        assert ray.get(actor.kept_its_tensors.remote())  # in place: same storage
        assert ray.get(actor._receive_weights_scheme.remote()) == 3  # torchrl's call: never waits
        assert scheme.get_sender().worker_versions == {0: 3}
    finally:
        scheme.shutdown()
        ray.kill(actor)


def test_weights_given_to_send_without_a_model_on_the_trainer(ray_runtime: RayRuntime) -> None:
    """As RayModuleTransform's own flow: init and connect with no model, then
    each update names its weights (a module, a state dict)."""
    actor = _actor(ray_runtime)
    scheme = _sender(actor)
    try:
        assert scheme.connect() is None  # nothing to send yet
        source = make_module(2)
        assert scheme.send(source).version == 1
        assert _same(ray.get(actor.weights.remote()), source.state_dict())
    finally:
        scheme.shutdown()
        ray.kill(actor)


def test_an_update_lands_between_two_method_calls(ray_runtime: RayRuntime) -> None:
    actor = _actor(ray_runtime)
    trainer = make_module(1)
    scheme = _sender(actor, trainer)
    try:
        scheme.connect()
        call = actor.forward_twice_slowly.remote(1.0)
        time.sleep(0.3)
        with torch.no_grad():
            trainer.bias.fill_(7.0)
        scheme.send()
        first, last = ray.get(call)
        assert torch.equal(first, last), "the module changed during a method call"
        assert torch.equal(ray.get(actor.weights.remote())["bias"], trainer.bias.detach())
    finally:
        scheme.shutdown()
        ray.kill(actor)


def test_a_busy_actor_is_late_by_the_deadline_and_a_stale_ack_counts_for_nothing(
    ray_runtime: RayRuntime,
) -> None:
    actor = _actor(ray_runtime)
    trainer = make_module(1)
    scheme = _sender(actor, trainer)
    try:
        scheme.connect()
        busy = actor.forward_twice_slowly.remote(2.0)
        time.sleep(0.2)
        with pytest.raises(ws.AckTimeoutError) as caught:
            scheme.send(timeout=0.5)
        assert caught.value.worker_ids == (0,) and caught.value.version == 2
        ray.get(busy)
        report = scheme.send()  # the next send gets its own ack
        assert report.version == 3
        assert scheme.get_sender().worker_versions[0] == 3
    finally:
        scheme.shutdown()
        ray.kill(actor)


def test_weights_that_do_not_fit_are_refused_before_anything_moves(ray_runtime: RayRuntime) -> None:
    actor = _actor(ray_runtime)
    trainer = make_module(1)
    scheme = _sender(actor, trainer)
    try:
        scheme.connect()
        before = ray.get(actor.weights.remote())
        with pytest.raises(ws.WeightMismatchError):
            scheme.send(torch.nn.Linear(3, 3))
        assert _same(ray.get(actor.weights.remote()), before)
        assert scheme.send().version == 2  # the refused send used no version
    finally:
        scheme.shutdown()
        ray.kill(actor)


def test_a_dead_actor_is_named(ray_runtime: RayRuntime) -> None:
    actor = _actor(ray_runtime)
    trainer = make_module(1)
    scheme = _sender(actor, trainer)
    try:
        scheme.connect()
        ray.kill(actor)
        started = time.monotonic()
        with pytest.raises(ws.WorkerLostError) as caught:
            scheme.send()
        assert time.monotonic() - started < 20  # not the deadline's 30 s
        assert caught.value.worker_ids == (0,) and caught.value.model_id is None
    finally:
        scheme.shutdown()


def test_an_actor_that_cannot_initialise_is_named_at_connect(ray_runtime: RayRuntime) -> None:
    actor = _actor(ray_runtime, with_module=False)  # no module to update
    scheme = _sender(actor, make_module(1))
    try:
        with pytest.raises(ws.WorkerApplyError) as caught:
            scheme.connect()
        assert caught.value.worker_ids == (0,)
        assert "model" in caught.value.worker_message
    finally:
        scheme.shutdown()
        ray.kill(actor)
