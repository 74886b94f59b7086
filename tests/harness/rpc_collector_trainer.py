"""The trainer of a torchrl ``RPCCollector`` run with weightsync's
``RPCWeightSyncScheme``, as a program of its own (``python -m
harness.rpc_collector_trainer SLOT PORT``, from the tests' directory): torchrl
0.14.1 cannot build a second ``RPCCollector`` in one process (the second
hangs, with torchrl's own scheme too), so each run gets a fresh process.

``SLOT``: ``weight_sync_schemes`` (the scheme given as
``weight_sync_schemes={"policy": scheme}``) or ``default`` (the collector's
default scheme, torchrl's ``RPCWeightSyncScheme``, replaced by
weightsync's). Four batches of 20 steps, with ``update_policy_weights_()``
after each: every step of each batch must have run with the trainer's
weights, bit for bit (the policy echoes them), and every worker must have
acked each version. Prints ``ok`` and exits 0, or raises.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torchrl.weight_update
from torchrl.collectors.distributed import RPCCollector

import weightsync as ws

from . import torchrl_parts as parts


def _same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    return torch.equal(got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))


def main(slot: str, port: int) -> None:
    made: list[ws.RPCWeightSyncScheme] = []

    def make_scheme(*args: Any, **kwargs: Any) -> ws.RPCWeightSyncScheme:
        made.append(ws.RPCWeightSyncScheme(*args, timeout=60, **kwargs))
        return made[-1]

    schemes = None
    if slot == "default":
        torchrl.weight_update.RPCWeightSyncScheme = make_scheme  # what RPCCollector takes by default
    else:
        schemes = {"policy": make_scheme()}
    policy = parts.make_echo_policy()
    generator = torch.Generator().manual_seed(3)
    collector = RPCCollector(
        [parts.make_env] * 2,
        policy,
        frames_per_batch=20,
        total_frames=10**9,
        sync=True,
        launcher="mp",
        tcp_port=str(port),
        weight_sync_schemes=schemes,
    )
    [scheme] = made
    try:
        # Initialised on each worker (twice) before the sender, then connected:
        # the initial weights are version 1.
        assert scheme.synchronized_on_sender
        assert scheme.get_sender().worker_versions == {0: 1, 1: 1}
        for i, batch in enumerate(collector):
            expected = parts.flat_weights(policy)
            echo = batch["echo"].reshape(-1, expected.numel())
            assert len(echo) == 20, len(echo)
            assert all(_same_bits(row, expected) for row in echo), f"batch {i}"
            parts.perturb(policy, generator)
            collector.update_policy_weights_()
            assert scheme.get_sender().worker_versions == {0: i + 2, 1: i + 2}
            if i == 3:
                break
    finally:
        collector.shutdown()
        scheme.shutdown()
    print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
