"""weightsync's schemes inside torchrl's own collectors (torchrl 0.14): passed
as ``weight_sync_schemes={"policy": scheme}``, driven by the collector's
``update_policy_weights_()``. Real spawned collector workers, torchrl's mock
environment; each action of a batch is the version of the weights that
produced it (see ``harness.torchrl_parts``).

Runs where torchrl is installed (CI's torchrl step: torchrl 0.14 needs
tensordict < 0.15); skipped elsewhere.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

torchrl = pytest.importorskip("torchrl")

from harness import TESTS_DIR, program  # noqa: E402
from harness import torchrl_parts as parts  # noqa: E402
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from torchrl.weight_update import WeightSyncScheme as TorchRLScheme  # noqa: E402

import weightsync as ws  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SCHEMES = {
    "multiprocess": ws.MultiProcessWeightSyncScheme,
    "shared": ws.SharedMemWeightSyncScheme,
}


def _collector(cls: Any, scheme: Any, policy: Any = None, **kwargs: Any) -> Any:
    """A collector of 2 mock environments (unless ``kwargs`` say otherwise),
    20 frames a batch, no end, with ``scheme`` as its policy's scheme."""
    kwargs.setdefault("create_env_fn", [parts.make_env] * 2)
    schemes = {"policy": scheme}
    return cls(policy=policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes=schemes, **kwargs)


def _collect(collector: Any, batches: int) -> Iterator[Any]:
    try:
        for i, batch in enumerate(collector):
            yield batch
            if i + 1 == batches:
                break
    finally:
        collector.shutdown()


@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_each_batch_of_a_sync_collector_holds_the_version_just_sent(scheme_name: str) -> None:
    scheme = SCHEMES[scheme_name](timeout=60)
    assert isinstance(scheme, TorchRLScheme)
    policy = parts.make_policy(1.0)
    collector = _collector(MultiSyncCollector, scheme, policy, track_policy_version=True)
    try:
        assert scheme.initialized_on_sender and scheme.synchronized_on_sender
        seen = []
        for i, batch in enumerate(_collect(collector, 5)):
            # Version i + 1 went out before this batch began: every action is it.
            seen.append(parts.versions_in(batch["action"]))
            # torchrl counts the updates after the initial weights.
            assert int(batch["policy_version"][..., -1].min()) == i
            parts.set_version(policy, i + 2.0)
            collector.update_policy_weights_()
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert seen == [{1.0}, {2.0}, {3.0}, {4.0}, {5.0}]


@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_no_step_of_an_async_collector_mixes_two_versions(scheme_name: str) -> None:
    scheme = SCHEMES[scheme_name](timeout=60)
    policy = parts.make_probe_policy(1.0)
    collector = _collector(MultiAsyncCollector, scheme, policy)
    sent = {1.0}
    steps = mixed = 0
    seen: set[float] = set()
    try:
        for i, batch in enumerate(_collect(collector, 30)):
            actions = batch["action"].reshape(-1, parts.SIZE)
            lo, hi = actions.aminmax(dim=-1)
            steps += len(actions)
            mixed += int((lo != hi).sum())
            seen.update(float(v) for v in lo.unique())
            version = i + 2.0
            parts.fill(policy, version)
            collector.update_policy_weights_()  # while the workers step
            sent.add(version)
    finally:
        collector.shutdown()
        scheme.shutdown()
    print(f"{scheme_name}: {steps} steps, {mixed} mixed, {len(seen)} versions seen")
    assert mixed == 0
    assert seen <= sent
    assert len(seen) > 5  # the updates landed while the workers stepped


def test_worker_ids_update_those_workers_only() -> None:
    scheme = ws.MultiProcessWeightSyncScheme(timeout=60)
    policy = parts.make_policy(1.0)
    collector = _collector(MultiSyncCollector, scheme, policy)
    try:
        batches = _collect(collector, 2)
        next(batches)
        parts.set_version(policy, 2.0)
        collector.update_policy_weights_(worker_ids=[1])
        batch = next(batches)  # stacked: one row per worker
        assert parts.versions_in(batch["action"][0]) == {1.0}
        assert parts.versions_in(batch["action"][1]) == {2.0}
    finally:
        collector.shutdown()
        scheme.shutdown()


def test_no_weight_sync_scheme_with_a_policy_factory() -> None:
    # With a policy instance torchrl sends workers a policy on the meta device
    # that only a synchronising scheme fills (torchrl's own NoWeightSyncScheme
    # fails there too); each worker builds its own with a factory.
    scheme = ws.NoWeightSyncScheme()
    collector = _collector(MultiSyncCollector, scheme, policy_factory=parts.make_policy)
    try:
        batches = _collect(collector, 2)
        assert parts.versions_in(next(batches)["action"]) == {0.0}
        collector.update_policy_weights_()  # nothing moves
        assert parts.versions_in(next(batches)["action"]) == {0.0}
    finally:
        collector.shutdown()
        scheme.shutdown()


def test_a_policy_that_does_not_fit_is_refused_at_the_rendezvous_by_name() -> None:
    # The trainer's policy (read for the weights) and the one each worker
    # builds differ in layout: the collector fails to start, naming the worker.
    scheme = ws.MultiProcessWeightSyncScheme(timeout=60)
    try:
        with pytest.raises(ws.WeightMismatchError, match="worker 0"):
            _collector(
                MultiSyncCollector,
                scheme,
                parts.make_policy(1.0),
                create_env_fn=[parts.make_env],
                policy_factory=parts.make_probe_policy,
            )
    finally:
        scheme.shutdown()


def test_weightsync_imports_torchrl_only_when_asked() -> None:
    code = "\n".join(
        [
            "import sys, weightsync as ws",
            "early = ws.InProcessWeightSyncScheme()",
            "assert 'torchrl' not in sys.modules",
            "from torchrl.weight_update import WeightSyncScheme",
            # torchrl came later: the scheme registers itself at its init.
            "early.init_on_sender('policy', num_workers=1)",
            "assert isinstance(early, WeightSyncScheme)",
            "early.shutdown()",
        ]
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    asked = "import weightsync as ws; ws.register_with_torchrl(); import sys; assert 'torchrl' in sys.modules"
    subprocess.run([sys.executable, "-c", asked], check=True, timeout=120)


@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_each_worker_of_a_collector_keeps_weights_of_its_own(scheme_name: str) -> None:
    """A policy factory per worker and ``per_worker_weights=True``: each
    worker starts from its own policy, ``update_policy_weights_({i: ...})``
    gives each its own, and ``worker_ids=i`` updates one alone."""
    import functools

    import torch
    from tensordict import TensorDict

    scheme = SCHEMES[scheme_name](timeout=60, per_worker_weights=True)
    factories = [functools.partial(parts.make_policy, 1.0), functools.partial(parts.make_policy, 2.0)]
    collector = _collector(MultiSyncCollector, scheme, policy_factory=factories)
    seen = []
    try:
        for i, batch in enumerate(_collect(collector, 4)):
            seen.append(parts.versions_in(batch["action"]))
            if i == 0:  # worker 0 alone, as nested TensorDict weights
                zero = torch.zeros(parts.SIZE, parts.SIZE)
                nested = TensorDict({"module": {"weight": zero, "bias": torch.full((parts.SIZE,), 3.0)}})
                collector.update_policy_weights_({0: nested})
            elif i == 1:
                own = {0: parts.make_policy(4.0), 1: parts.make_policy(5.0)}
                collector.update_policy_weights_({w: dict(p.state_dict()) for w, p in own.items()})
            elif i == 2:
                collector.update_policy_weights_(dict(parts.make_policy(6.0).state_dict()), worker_ids=1)
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert seen == [{1.0, 2.0}, {3.0, 2.0}, {4.0, 5.0}, {4.0, 6.0}]


@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_a_scheme_given_a_params_map_before_the_collector_starts(scheme_name: str) -> None:
    """As torchrl's schemes are set up before a collector starts:
    ``init_on_sender(params_map={worker_idx: weights})`` gives the workers
    and the weights ``update_policy_weights_()`` sends; the collector keeps
    the scheme as it is, and each batch after an update holds the version
    sent."""
    from tensordict import TensorDict

    policy = parts.make_policy(1.0)
    weights = TensorDict.from_module(policy)
    scheme = SCHEMES[scheme_name](timeout=60)
    scheme.init_on_sender(params_map={0: weights, 1: weights})
    collector = _collector(MultiSyncCollector, scheme, policy)
    seen = []
    try:
        assert sorted(scheme.sender_transports) == [0, 1]
        for i, batch in enumerate(_collect(collector, 3)):
            seen.append(parts.versions_in(batch["action"]))
            parts.set_version(policy, i + 2.0)
            collector.update_policy_weights_()
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert seen == [{1.0}, {2.0}, {3.0}]


TORCHRL_CLASSES = [
    ws.MultiProcessWeightSyncScheme,
    ws.SharedMemWeightSyncScheme,
    ws.NoWeightSyncScheme,
    ws.RayWeightSyncScheme,
    ws.RayModuleTransformScheme,
]


@pytest.mark.parametrize("strategy", ["state_dict", "tensordict"])
@pytest.mark.parametrize("cls", TORCHRL_CLASSES)
def test_torchrl_extracts_weights_in_the_form_a_scheme_names(
    cls: type[ws.WeightSyncScheme], strategy: str
) -> None:
    """torchrl's trainers (``weight_update_map``) and Ray collector extract
    the weights themselves, by ``WeightStrategy(extract_as=scheme.strategy_str)``."""
    from tensordict import TensorDictBase
    from torchrl.weight_update.weight_sync_schemes import WeightStrategy

    scheme = cls(strategy)  # type: ignore[arg-type]
    assert scheme.strategy_str == strategy
    weights = WeightStrategy(extract_as=scheme.strategy_str).extract_weights(parts.make_policy(3.0))
    if strategy == "tensordict":
        assert isinstance(weights, TensorDictBase)
        assert float(weights["module", "bias"][0]) == 3.0
    else:
        assert isinstance(weights, dict)
        assert float(weights["module.bias"][0]) == 3.0


def test_the_torchrun_bench_times_torchrls_distributed_scheme_beside_weightsyncs(tmp_path: Any) -> None:
    """``torchrun ... -m weightsync bench --scheme distributed`` where torchrl
    is installed: torchrl's own DistributedWeightSyncScheme is a column of
    the table, each of its sends checked bit for bit on every rank."""
    import json

    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
            "-m", "weightsync", "bench", "--scheme", "distributed", "--size", "1", "--repeats", "2",
            "--json", str(out)]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    header = next(line for line in result.stdout.splitlines() if line.lstrip().startswith("workers"))
    assert "torchrl" in header
    (row,) = json.loads(out.read_text())["rows"]
    for way in ("weightsync", "gloo_bcast", "gloo_star", "torchrl"):
        assert len(row[way]) == 2 and all(s > 0 for s in row[way]), way


# -- the collectors whose loop is not the user's: Ray and torch.distributed --


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    """A Ray instance of this module's own (never one found on the machine),
    whose workers import the tests' parts and this weightsync."""
    ray = pytest.importorskip("ray")
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def _same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    return torch.equal(got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))


def _assert_remote_policies_are(ray: Any, collector: Any, policy: Any) -> None:
    """Every remote collector's policy holds the trainer's weights, bit for bit."""
    expected = policy.state_dict()
    calls = [c.cascade_execute.remote("policy.state_dict") for c in collector.remote_collectors]
    remote = ray.get(calls, timeout=60)
    for worker, got in enumerate(remote):
        assert list(got) == list(expected), worker
        for name, value in expected.items():
            assert _same_bits(got[name], value), (worker, name)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_ray_collector_keeps_every_remote_policy_equal_to_the_trainers(local_ray: Any, sync: bool) -> None:
    """torchrl's ``RayCollector`` with weightsync's ``RayWeightSyncScheme``
    passed as torchrl documents it (the collector gives ``model=`` and
    itself, which has no ``get_model()``, as the context): after each
    ``update_policy_weights_()`` every remote policy equals the trainer's,
    the remote policy versions count the updates as torchrl's own scheme
    does (1 after the first), and torchrl warns of no experimental
    strategy."""
    from torchrl.collectors.distributed import RayCollector

    scheme = ws.RayWeightSyncScheme(timeout=60)
    policy = parts.make_echo_policy()
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collector = RayCollector(
            [parts.make_env] * 2,
            policy,
            frames_per_batch=20,
            total_frames=10**9,
            sync=sync,
            collector_kwargs={"track_policy_version": True},
            weight_sync_schemes={"policy": scheme},
        )
        try:
            collector.update_policy_weights_()  # before the first batch, as torchrl asks
            _assert_remote_policies_are(local_ray, collector, policy)
            for updates, batch in enumerate(collector, start=1):
                if sync:  # each batch began after the update before it
                    echo = batch["echo"].reshape(-1, parts.flat_weights(policy).numel())
                    assert all(_same_bits(row, parts.flat_weights(policy)) for row in echo)
                versions = local_ray.get([c.get_policy_version.remote() for c in collector.remote_collectors])
                assert versions == [updates, updates]
                if updates == 4:
                    break
                parts.perturb(policy, generator)
                collector.update_policy_weights_()
                _assert_remote_policies_are(local_ray, collector, policy)
        finally:
            collector.shutdown()
            scheme.shutdown()
    assert not [w for w in caught if "experimental" in str(w.message)]


def test_ray_module_transform_holds_each_version_sent_through_a_collector(local_ray: Any) -> None:
    """torchrl's ``RayModuleTransform`` given weightsync's
    ``RayModuleTransformScheme`` (which it initialises and connects), in the
    environment of a ``Collector`` that gets the scheme as
    ``weight_sync_schemes={"transform_module": scheme}``: each
    ``update_policy_weights_(weights, model_id="transform_module")`` returns
    once the transform's actor applied them, so every step of the next
    batch ran the transform with exactly that version."""
    from torchrl.collectors import Collector
    from torchrl.envs import TransformedEnv
    from torchrl.envs.transforms.module import RayModuleTransform

    scheme = ws.RayModuleTransformScheme(timeout=60)
    assert isinstance(scheme, TorchRLScheme)
    transform = RayModuleTransform(
        module=parts.make_transform_module(1.0), no_grad=True, weight_sync_scheme=scheme
    )
    assert scheme.initialized_on_sender and scheme.synchronized_on_sender
    trainer_module = parts.make_transform_module(1.0)
    env = TransformedEnv(parts.make_env(), transform)
    collector = Collector(
        env,
        parts.make_policy(0.0),
        frames_per_batch=20,
        total_frames=-1,
        weight_sync_schemes={"transform_module": scheme},
    )
    seen = []
    try:
        for i, batch in enumerate(_collect(collector, 4)):
            seen.append(parts.versions_in(batch["next", "observation"]))
            parts.set_version(trainer_module, i + 2.0)
            collector.update_policy_weights_(trainer_module, model_id="transform_module")
            assert scheme.get_sender().worker_versions == {0: i + 1}
    finally:
        collector.shutdown()
        scheme.shutdown()
        local_ray.kill(transform._actor)
    # The first batch ran on the transform's own weights; each later one on the version sent.
    assert seen == [{1.0}, {2.0}, {3.0}, {4.0}]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_distributed_collector_applies_every_update_without_receive() -> None:
    """torchrl's ``DistributedCollector`` (``launcher="mp"``: real worker
    processes) with weightsync's ``DistributedWeightSyncScheme`` at its
    default ``sync=True``: the collector gives no ``model=`` (its
    ``.policy`` is read) and its workers' loop never calls ``receive()``,
    so each worker applies updates in the background. Every step of each
    batch after an update ran with the trainer's new weights, bit for bit."""
    from torchrl.collectors.distributed import DistributedCollector

    scheme = ws.DistributedWeightSyncScheme(timeout=60)
    policy = parts.make_echo_policy()
    generator = torch.Generator().manual_seed(2)
    collector = DistributedCollector(
        [parts.make_env] * 2,
        policy,
        frames_per_batch=20,
        total_frames=10**9,
        sync=True,
        launcher="mp",
        tcp_port=_free_port(),
        weight_sync_schemes={"policy": scheme},
    )
    try:
        for i, batch in enumerate(_collect(collector, 4)):
            expected = parts.flat_weights(policy)
            echo = batch["echo"].reshape(-1, expected.numel())
            assert len(echo) == 20
            assert all(_same_bits(row, expected) for row in echo), i
            parts.perturb(policy, generator)
            collector.update_policy_weights_()
    finally:
        collector.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("slot", ["weight_sync_schemes", "default"])
def test_rpc_collector_applies_every_update_bit_for_bit(slot: str) -> None:
    """torchrl's ``RPCCollector`` (``launcher="mp"``: real worker processes
    joined by ``torch.distributed.rpc``) with weightsync's
    ``RPCWeightSyncScheme``, given as ``weight_sync_schemes={"policy":
    scheme}`` or in the collector's default slot (torchrl's
    ``RPCWeightSyncScheme``, replaced by weightsync's). torchrl initialises
    the scheme on each worker twice, inside ``rpc.remote``, before the
    trainer's ``init_on_sender``; the workers' loop never calls
    ``receive()``. Every step of each batch after ``update_policy_weights_()``
    ran with the trainer's new weights, bit for bit, and every worker acked
    each version (see ``harness.rpc_collector_trainer``, a program of its
    own: torchrl cannot build two ``RPCCollector`` in one process)."""
    argv = program("rpc_collector_trainer", slot, str(_free_port()))
    result = subprocess.run(argv, cwd=TESTS_DIR, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]
