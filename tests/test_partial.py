"""Partial updates, over every scheme: ``send(keys=...)`` or
``send(subset, partial=True)`` writes exactly those tensors on every worker,
leaves the others as they were, moves only their bytes, and is checked
against every worker's model before anything moves."""

from __future__ import annotations

import pytest
import torch
from harness import Cluster

import weightsync as ws


def _head(name: str) -> bool:
    return name.startswith("out.")


def test_a_partial_update_writes_those_tensors_only(cluster: Cluster) -> None:
    cluster.bump()
    cluster.sender.send()
    whole = cluster.expected()
    # Several partial updates in a row: under the shared scheme the tensors
    # they leave alone keep running on the slot of the whole update, which
    # no later update may overwrite.
    for _ in range(4):
        cluster.bump()
        report = cluster.sender.send(keys=_head)
    latest = cluster.expected()
    head_bytes = sum(-(-t.numel() * t.element_size() // 64) * 64 for n, t in latest.items() if _head(n))
    assert report.nbytes == head_bytes  # only the head's bytes moved
    for i in range(3):
        got = cluster.state(i)["weights"]
        for name, value in got.items():
            want = latest[name] if _head(name) else whole[name]
            assert torch.equal(value, want), f"worker {i}: {name}"
    assert cluster.sender.worker_versions == dict.fromkeys(range(3), report.version)


def test_a_subset_given_as_weights(cluster: Cluster) -> None:
    cluster.bump()
    cluster.sender.send()
    before = cluster.expected()
    with torch.no_grad():
        cluster.model.inp.bias.add_(5.0)
    cluster.sender.send({"inp.bias": cluster.model.inp.bias}, partial=True)
    for i in range(3):
        got = cluster.state(i)["weights"]
        assert torch.equal(got["inp.bias"], cluster.model.inp.bias.detach())
        assert all(torch.equal(got[n], before[n]) for n in got if n != "inp.bias")


@pytest.mark.parametrize(
    ("defect", "named"),
    [("unknown", "nope"), ("shape", "out.weight"), ("dtype", "out.bias")],
)
def test_a_partial_update_that_does_not_fit_moves_nothing(cluster: Cluster, defect: str, named: str) -> None:
    cluster.bump()
    cluster.sender.send()
    version = cluster.sender.async_sender.version
    states = [cluster.state(i)["weights"] for i in range(3)]
    subset = {
        "unknown": {"nope": torch.zeros(3)},
        "shape": {"out.weight": torch.zeros(3, 3)},
        "dtype": {"out.bias": torch.zeros(4, dtype=torch.float64)},
    }[defect]
    with pytest.raises(ws.WeightMismatchError, match=named):
        cluster.sender.send(subset, partial=True)
    with pytest.raises(ws.WeightMismatchError, match="nope"):
        cluster.sender.send(keys=["out.bias", "nope"])  # a key the weights lack
    assert cluster.sender.async_sender.version == version  # nothing moved
    for i in range(3):
        got = cluster.state(i)["weights"]
        assert all(torch.equal(got[n], states[i][n]) for n in got)


def test_a_partial_update_goes_only_to_workers_in_step(make_cluster) -> None:
    # Before any whole update, or after a missed send, a worker cannot take a
    # partial one: its other tensors would not be the trainer's.
    c = make_cluster(["net", "net"])
    with pytest.raises(ws.WeightSyncStateError, match="whole model first"):
        c.sender.send(keys=_head)
    c.bump()
    c.sender.send()
    c.pause(1)
    c.bump()
    with pytest.raises(ws.AckTimeoutError):
        c.sender.send(timeout=0.5)
    c.resume(1)
    with pytest.raises(ws.WeightSyncStateError, match=r"\[1\]"):
        c.sender.send(keys=_head)
    c.sender.send(keys=_head, worker_ids=[0])  # worker 0 is in step
    c.sender.send(worker_ids=[1])  # the whole model brings worker 1 back
    c.bump()
    c.sender.send(keys=_head)  # both are in step again
    expected = c.expected()
    for i in range(2):
        got = c.state(i)["weights"]
        assert all(torch.equal(got[n], expected[n]) for n in got if _head(n))
