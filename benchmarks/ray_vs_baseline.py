"""RayWeightSyncScheme against a hand-written zero-copy Ray broadcast.

The baseline is what one would write by hand with Ray's object store: one
``ray.put`` of the weights as numpy buffers, then one call per actor that
copies the buffers into the actor's model, and ``ray.get`` of the calls. The
same actors serve both (each registers its model with weightsync and has the
baseline's method), and the two run alternately, one send each per round, so
they see the same machine state. Both copy into the same tensors in place;
after each round every actor's weights are checked against the trainer's,
outside the timing.

torchrl's ``RayWeightSyncScheme`` is measured too when torchrl is importable.

Targets: median no more than 1.1x the baseline at 1 MiB and 512 MiB to 4
actors.

Run: ``python benchmarks/ray_vs_baseline.py [--size 1 512] [--workers 4] [--repeats 15] [--mixin]``
(``--mixin``: the actors subclass ``weightsync.RayWeightSyncMixin``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
import ray
import torch

import weightsync as ws

MIB = 1 << 20
TENSORS = 8


def _weights(nbytes: int, value: float = 0.0) -> dict[str, torch.Tensor]:
    numel = nbytes // 4 // TENSORS
    return {f"w{i}": torch.full((numel,), value) for i in range(TENSORS)}


class Actor:
    """A collector holding a model of ``nbytes``; reachable by both paths.
    weightsync reaches it through Ray's ``__ray_call__``."""

    def __init__(self, nbytes: int) -> None:
        self.weights = _weights(nbytes)
        self.scheme = ws.RayWeightSyncScheme()
        self.scheme.init_on_worker("policy", model=self.weights)

    def baseline(self, arrays: list[np.ndarray]) -> int:
        # The obvious hand-written apply: view each read-only buffer as a
        # tensor and copy it into the model's tensor in place.
        for (_, tensor), array in zip(sorted(self.weights.items()), arrays, strict=True):
            tensor.copy_(torch.from_numpy(array).view(tensor.dtype).view(tensor.shape))
        return len(arrays)

    def values(self) -> tuple[float, float]:
        return (
            min(float(t.min()) for t in self.weights.values()),
            max(float(t.max()) for t in self.weights.values()),
        )


class MixinActor(ws.RayWeightSyncMixin, Actor):
    """The same, with weightsync's optional mixin: updates are a method call."""


def _check(actors: list[Any], value: float) -> None:
    for lo, hi in ray.get([a.values.remote() for a in actors]):
        if lo != value or hi != value:
            raise SystemExit(f"an actor holds [{lo}, {hi}], expected {value}")


def _fill(weights: dict[str, torch.Tensor], value: float) -> None:
    for tensor in weights.values():
        tensor.fill_(value)


def run(nbytes: int, workers: int, repeats: int, warmup: int, mixin: bool) -> dict[str, list[float]]:
    remote = ray.remote(num_cpus=0)(MixinActor if mixin else Actor)
    actors = [remote.remote(nbytes) for _ in range(workers)]
    trainer = _weights(nbytes)
    scheme = ws.RayWeightSyncScheme()
    scheme.init_on_sender("policy", remote_collectors=actors, model=trainer)
    sender = scheme.get_sender()
    sender.connect(timeout=120)
    samples: dict[str, list[float]] = {"weightsync": [], "baseline": []}
    value = 0.0
    try:
        for round_ in range(warmup + repeats):
            for name in ("weightsync", "baseline"):
                value += 1
                _fill(trainer, value)
                start = time.perf_counter()
                if name == "weightsync":
                    sender.send()
                else:
                    ordered = [trainer[k].numpy() for k in sorted(trainer)]
                    ref = ray.put(ordered)
                    ray.get([a.baseline.remote(ref) for a in actors])
                    del ref
                elapsed = time.perf_counter() - start
                _check(actors, value)
                if round_ >= warmup:
                    samples[name].append(elapsed)
    finally:
        scheme.shutdown()
        for actor in actors:
            ray.kill(actor)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, nargs="+", default=[1, 512], help="MiB")
    parser.add_argument("--workers", type=int, nargs="+", default=[4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--mixin", action="store_true", help="actors subclass weightsync.RayWeightSyncMixin")
    args = parser.parse_args()
    # address="local": a new instance, even while another one (a test cluster) runs.
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        print(f"{'MiB':>5} {'actors':>6} {'weightsync ms':>14} {'baseline ms':>12} {'ratio':>6}")
        for size in args.size:
            for workers in args.workers:
                samples = run(size * MIB, workers, args.repeats, args.warmup, args.mixin)
                ours = statistics.median(samples["weightsync"]) * 1e3
                base = statistics.median(samples["baseline"]) * 1e3
                print(f"{size:>5} {workers:>6} {ours:>14.2f} {base:>12.2f} {ours / base:>6.2f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
