"""The trainer of tests/test_cluster.py: runs on host 0 of an emulated cluster
(``python -m harness.ray_cluster_trainer SCENARIO``, :mod:`.programs`), sends with RayWeightSyncScheme to
actors on the other hosts, checks every actor's weights bit for bit, and
prints ``RESULT <json>`` last. Before the send that the test disturbs it
prints ``SENDING`` and waits a moment, so the test can act during it.

Actor ``i`` of a scenario with ``per_host`` actors per host lives on host
``1 + i // per_host``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import ray
import torch

import weightsync as ws

from .checksums import weight_checksums

MIB = 1 << 20


@ray.remote(num_cpus=0)
class Collector:
    def __init__(self, scheme: ws.RayWeightSyncScheme, shapes: dict[str, tuple[int, ...]]) -> None:
        torch.set_num_threads(1)
        self.tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
        scheme.init_on_worker("policy", model=self.tensors)

    def checksums(self) -> dict[str, int]:
        return weight_checksums(self.tensors)

    def host(self) -> str:
        return str(ray.util.get_node_ip_address())

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())


def _model(mib: int) -> dict[str, torch.Tensor]:
    per = mib * MIB // 4 // 4
    generator = torch.Generator().manual_seed(mib)
    return {f"layer{i}.weight": torch.randn(per, generator=generator) for i in range(4)}


def _actors(
    scheme: ws.RayWeightSyncScheme, model: dict[str, torch.Tensor], hosts: range, per_host: int
) -> list[Any]:
    shapes = {name: tuple(t.shape) for name, t in model.items()}
    return [
        Collector.options(resources={f"host{h}": 1}).remote(scheme, shapes)
        for h in hosts
        for _ in range(per_host)
    ]


def _exact(actors: list[Any], model: dict[str, torch.Tensor], timeout: float = 60) -> list[int]:
    """The indices of the actors that do not hold exactly ``model``."""
    want = weight_checksums(model)
    got = ray.get([a.checksums.remote() for a in actors], timeout=timeout)
    return [i for i, sums in enumerate(got) if sums != want]


def _change(model: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor in model.values():
            tensor.add_(1.0)


def _error(exc: ws.WeightSyncError) -> dict[str, Any]:
    failures = getattr(exc, "failures", None) or {}
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "worker_ids": sorted(getattr(exc, "worker_ids", None) or []),
        "failures": {str(w): type(e).__name__ for w, e in failures.items()},
    }


def scenario_exact(result: dict[str, Any]) -> None:
    """3 receiving hosts x 2 actors: three sends, each checked; the relay ran."""
    model = _model(16)
    scheme = ws.RayWeightSyncScheme(timeout=60)
    actors = _actors(scheme, model, range(1, 4), 2)
    scheme.init_on_sender("policy", remote_collectors=actors, model=model)
    scheme.connect()
    result["hosts"] = ray.get([a.host.remote() for a in actors])
    result["bad"] = []
    for _ in range(3):
        _change(model)
        scheme.send()
        result["bad"].append(_exact(actors, model))
    relay = scheme.staging.relay  # type: ignore[attr-defined]
    result["chains"] = [len(chain) for chain in relay.last_attempts] if relay else []
    # A send to some of the actors only: the relay takes their hosts only.
    _change(model)
    scheme.send(worker_ids=[0, 4])
    result["subset_bad"] = _exact([actors[0], actors[4]], model)
    result["subset_chains"] = [len(chain) for chain in relay.last_attempts] if relay else []
    scheme.shutdown()


def _nudge(model: dict[str, torch.Tensor], step: int, fraction: float = 0.01) -> None:
    """Change ``fraction`` of the elements, as a small RL step does."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for tensor in model.values():
            flat = tensor.view(-1)
            picked = torch.randperm(flat.numel(), generator=gen)[: int(fraction * flat.numel())]
            flat[picked] += torch.randn(picked.numel(), generator=gen)


def scenario_delta(result: dict[str, Any]) -> None:
    """RayWeightSyncScheme(delta="always"), 3 receiving hosts x 1 actor: sends
    of small changes, each checked on every actor it targets, with how
    each went (chains, whether each carried a delta, wire bytes); host 3
    (actor 2) misses one send."""
    model = _model(16)
    # "always": a delta whenever a base is held (delta=True would weigh each
    # send, and may send the full bytes where the link outruns the codec).
    scheme = ws.RayWeightSyncScheme(timeout=60, delta="always")
    actors = _actors(scheme, model, range(1, 4), 1)
    scheme.init_on_sender("policy", remote_collectors=actors, model=model)
    scheme.connect(timeout=120)  # actors and relay agents start: not what is under test
    result["nbytes"] = sum(t.numel() * t.element_size() for t in model.values())
    # Each chain as the hosts (1..3) it went through.
    host_of = {node: 1 + i for i, node in enumerate(ray.get([a.node.remote() for a in actors]))}
    relay = scheme.staging.relay  # type: ignore[attr-defined]
    sends = []

    def send(step: int, worker_ids: list[int] | None = None) -> None:
        if step:
            _nudge(model, step)
            scheme.send(worker_ids=worker_ids)
        targets = actors if worker_ids is None else [actors[i] for i in worker_ids]
        sends.append(
            {
                "delta": scheme.last_delta,
                "wire": scheme.last_wire_bytes,
                "chains": [[host_of[n] for n in chain] for chain in relay.last_attempts],
                "bad": _exact(targets, model),
            }
        )

    send(0)  # connect()'s initial send
    # Until one send reached every host along one chain: the relay agents
    # start with the first send (seconds each, importing torch), which may
    # break its chain; a host no chain reached holds no base yet.
    for warmup in range(1, 6):
        if sends[-1]["chains"] == [[1, 2, 3]] and all(relay.why(n) is None for n in host_of):
            break
        send(100 + warmup)
    result["warmup"] = len(sends) - 1
    for step in range(1, 5):
        send(step)
    # Host 3 misses this one: the base moves on without it.
    send(5, worker_ids=[0, 1])
    for step in range(6, 9):
        send(step)
    result["sends"] = sends
    scheme.shutdown()


def _disturbed(result: dict[str, Any], timeout: float) -> None:
    """4 receiving hosts x 1 actor, 128 MiB; the test disturbs host 2 (actor
    1) during the second send."""
    model = _model(128)
    scheme = ws.RayWeightSyncScheme(timeout=timeout)
    actors = _actors(scheme, model, range(1, 5), 1)
    scheme.init_on_sender("policy", remote_collectors=actors, model=model)
    scheme.connect(timeout=120)  # actors and relay agents start: not what is under test
    _change(model)
    print("SENDING", flush=True)
    time.sleep(0.3)  # the test acts now, while the bytes move (about 1.1 s)
    started = time.monotonic()
    try:
        scheme.send()
        result["error"] = None
    except ws.WeightSyncError as exc:
        result["error"] = _error(exc)
    result["seconds"] = time.monotonic() - started
    survivors = [a for i, a in enumerate(actors) if i != 1]
    result["bad"] = _exact(survivors, model)
    relay = scheme.staging.relay  # type: ignore[attr-defined]
    result["chains"] = [len(chain) for chain in relay.last_attempts] if relay else []
    scheme.shutdown()


def scenario_kill(result: dict[str, Any]) -> None:
    _disturbed(result, timeout=30)


def scenario_stop(result: dict[str, Any]) -> None:
    _disturbed(result, timeout=15)


def scenario_join(result: dict[str, Any]) -> None:
    """2 receiving hosts, then an actor on a third host joins with add_worker
    and gets the latest weights; then a send to all three."""
    model = _model(16)
    scheme = ws.RayWeightSyncScheme(timeout=60)
    actors = _actors(scheme, model, range(1, 3), 1)
    scheme.init_on_sender("policy", remote_collectors=actors, model=model)
    scheme.connect()
    _change(model)
    scheme.send()
    late = _actors(scheme, model, range(3, 4), 1)[0]
    result["new_id"] = scheme.add_worker(late)
    result["late_bad"] = _exact([late], model)
    _change(model)
    scheme.send()
    result["bad"] = _exact([*actors, late], model)
    relay = scheme.staging.relay  # type: ignore[attr-defined]
    result["chains"] = [len(chain) for chain in relay.last_attempts] if relay else []
    scheme.shutdown()


def main() -> None:
    name = sys.argv[1]
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.ERROR, log_to_driver=False)
    result: dict[str, Any] = {"scenario": name}
    try:
        globals()[f"scenario_{name}"](result)
    except BaseException:
        import traceback

        result["crash"] = traceback.format_exc()
        raise
    finally:
        print("RESULT " + json.dumps(result), flush=True)
        ray.shutdown()


if __name__ == "__main__":
    main()
