"""RayWeightSyncScheme against torchrl's RayWeightSyncScheme.

Both send a trainer's weights from the Ray driver to Ray actors and return
once every actor applied them. weightsync's scheme puts the weights into
Ray's object store once and calls every actor; torchrl's
(``torchrl.weight_update.RayWeightSyncScheme``, 0.14) calls every actor's
``_receive_weights_scheme`` through Ray and streams the tensors over a
torch.distributed gloo process group (the trainer is rank 0).

The same actors serve both: each holds one model (an ``nn.Module`` of 8
float32 tensors; torchrl's receiver needs a module), registers it with
weightsync in its ``__init__`` and has the few methods torchrl's scheme calls
on a collector, written as torchrl's collectors write them. The two run
alternately, one send each per round, so they see the same machine state.
After each send every actor's weights are checked against the trainer's,
outside the timing.

Target: weightsync at least 2x faster than torchrl at 512 MiB to 4 actors.

Run (torchrl must be importable, it is not in the repository's own venv):
``python benchmarks/ray_vs_torchrl.py [--size 512] [--workers 4] [--repeats 15] [--warmup 3]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import ray
import torch
from torch import nn

import weightsync as ws

try:
    from torchrl.weight_update import RayWeightSyncScheme as TorchRLRayWeightSyncScheme
except ImportError:
    TorchRLRayWeightSyncScheme = None

MIB = 1 << 20
TENSORS = 8


def _model(nbytes: int, value: float = 0.0) -> nn.Module:
    # A policy's weights are parameters; these need no gradients (the
    # trainer's are filled in place, the actors' are inference copies).
    numel = nbytes // 4 // TENSORS
    model = nn.Module()
    for i in range(TENSORS):
        model.register_parameter(f"w{i}", nn.Parameter(torch.full((numel,), value), requires_grad=False))
    return model


class Actor:
    """A collector holding a model of ``nbytes``; reachable by both schemes.
    weightsync reaches it through Ray's ``__ray_call__``; torchrl through the
    methods below, which mirror torchrl's collectors
    (``torchrl/collectors/_base.py``: ``register_scheme_receiver``,
    ``_connect_weights_scheme``, ``_receive_weights_scheme``)."""

    def __init__(self, nbytes: int, worker_idx: int) -> None:
        # torchrl's receiver resolves its model as ``context.policy`` and its
        # rank as ``context.worker_idx + 1``, as for a collector.
        self.worker_idx = worker_idx
        self.policy = _model(nbytes)
        self.scheme = ws.RayWeightSyncScheme()
        self.scheme.init_on_worker("policy", model=self.policy)
        self._receiver_schemes: dict[str, Any] = {}

    def register_scheme_receiver(self, schemes: dict[str, Any], *, synchronize_weights: bool = True) -> None:
        for model_id, scheme in schemes.items():
            scheme.init_on_receiver(model_id=model_id, context=self, worker_idx=self.worker_idx)
            self._receiver_schemes[model_id] = scheme
        if synchronize_weights:
            self._connect_weights_scheme()

    def _connect_weights_scheme(self, model_version: int | None = None) -> None:
        # Joins the process group and receives the initial weights.
        for scheme in self._receiver_schemes.values():
            if not scheme.synchronized_on_receiver:
                scheme.connect(worker_idx=self.worker_idx)

    def _receive_weights_scheme(self, model_version: int | None = None) -> None:
        # Receives every tensor over gloo and applies the update. (A
        # collector then records model_version, None here.)
        for scheme in self._receiver_schemes.values():
            scheme.receive()

    def values(self) -> tuple[float, float]:
        return (
            min(float(t.min()) for t in self.policy.parameters()),
            max(float(t.max()) for t in self.policy.parameters()),
        )


def _check(actors: list[Any], value: float, name: str) -> None:
    for lo, hi in ray.get([a.values.remote() for a in actors]):
        if lo != value or hi != value:
            raise SystemExit(f"{name}: an actor holds [{lo}, {hi}], expected {value}")


def _fill(model: nn.Module, value: float) -> None:
    for tensor in model.parameters():
        tensor.fill_(value)


def run(nbytes: int, workers: int, repeats: int, warmup: int) -> dict[str, list[float]]:
    assert TorchRLRayWeightSyncScheme is not None
    remote = ray.remote(num_cpus=0)(Actor)
    actors = [remote.remote(nbytes, i) for i in range(workers)]
    trainer = _model(nbytes)
    scheme = ws.RayWeightSyncScheme()
    scheme.init_on_sender("policy", remote_collectors=actors, model=trainer)
    sender = scheme.get_sender()
    # torchrl's defaults (strategy="tensordict", backend="gloo"), set up as
    # torchrl's RayCollector does: init on the sender, hand the scheme to
    # every actor, then the actors' connects and the sender's connect
    # together (the sender's connect sends the initial weights).
    torchrl_scheme = TorchRLRayWeightSyncScheme()
    try:
        sender.connect(timeout=120)
        torchrl_scheme.init_on_sender(model_id="policy", remote_collectors=actors, model=trainer)
        ray.get(
            [
                a.register_scheme_receiver.remote({"policy": torchrl_scheme}, synchronize_weights=False)
                for a in actors
            ]
        )
        connects = [a._connect_weights_scheme.remote() for a in actors]
        torchrl_scheme.connect()
        ray.get(connects)
        samples: dict[str, list[float]] = {"weightsync": [], "torchrl": []}
        value = 0.0
        for round_ in range(warmup + repeats):
            for name in ("weightsync", "torchrl"):
                value += 1
                _fill(trainer, value)
                start = time.perf_counter()
                if name == "weightsync":
                    sender.send()
                else:
                    # As a collector's update_policy_weights_(policy) does:
                    # the scheme extracts the module's weights itself.
                    torchrl_scheme.send(weights=trainer)
                elapsed = time.perf_counter() - start
                _check(actors, value, name)
                if round_ >= warmup:
                    samples[name].append(elapsed)
    finally:
        torchrl_scheme.shutdown()
        scheme.shutdown()
        for actor in actors:
            ray.kill(actor)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, nargs="+", default=[512], help="MiB")
    parser.add_argument("--workers", type=int, nargs="+", default=[4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if TorchRLRayWeightSyncScheme is None:
        print("torchrl is not installed; this comparison needs it", file=sys.stderr)
        sys.exit(2)
    # address="local": a new instance, even while another one (a test cluster) runs.
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        print(f"{'MiB':>5} {'actors':>6} {'weightsync ms':>14} {'torchrl ms':>11} {'speed-up':>9}")
        for size in args.size:
            for workers in args.workers:
                samples = run(size * MIB, workers, args.repeats, args.warmup)
                ours = statistics.median(samples["weightsync"]) * 1e3
                theirs = statistics.median(samples["torchrl"]) * 1e3
                print(f"{size:>5} {workers:>6} {ours:>14.2f} {theirs:>11.2f} {theirs / ours:>9.2f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
