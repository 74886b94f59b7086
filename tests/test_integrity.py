"""verify=True: the trainer digests every tensor it sends, each worker checks
the bytes it is about to apply, and one whose bytes differ (here: the staging
overwritten in the trainer after the send staged it) refuses the update, by
name, with its model left as it was; the next send goes through."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import CONFORMANCE_SCHEMES, Cluster, new_cluster

import weightsync as ws
from weightsync._packet import Manifest
from weightsync._strategy import flat_weights


def _staged(scheme: ws.WeightSyncScheme) -> torch.Tensor:
    """The trainer's writable view of the bytes its last send staged."""
    staging = scheme.staging
    segment = getattr(staging, "segment", None) or getattr(staging, "current", None)
    assert segment is not None and segment.data is not None
    return segment.data


@pytest.mark.parametrize("scheme_name", CONFORMANCE_SCHEMES)
def test_a_verified_send_arrives_exact(request: pytest.FixtureRequest, scheme_name: str) -> None:
    c = new_cluster(request, scheme_name, ["net", "net"])
    try:
        c.bump()
        c.sender.send(verify=True)
        c.bump()
        c.sender.send(verify=True, keys=lambda n: n.startswith("out."))
        c.bump()
        report = c.sender.send(verify=True)
        for i in range(2):
            c.assert_has(i, c.expected())
            assert c.state(i)["applied"][-1] == report.version
    finally:
        c.close()


@pytest.mark.parametrize("scheme_name", ["multiprocess", "shared", "inprocess"])
def test_bytes_that_changed_on_the_way_are_refused_by_name(
    request: pytest.FixtureRequest, scheme_name: str
) -> None:
    c: Cluster = new_cluster(request, scheme_name, ["net", "net"])
    try:
        c.bump()
        c.sender.send(verify=True)
        before = [c.state(i)["weights"] for i in range(2)]
        for i in range(2):
            c.pause(i)
        c.bump()
        c.sender.send_async(verify=True)
        # The send staged its bytes and digests and told the workers; flip
        # one byte of out.weight where they will read it.
        spec = next(s for s in Manifest.of(flat_weights(c.model)).specs if s.name == "out.weight")
        deadline = time.monotonic() + 10
        while c.sender.async_sender.version < 2:  # the version is taken once the bytes are staged
            assert time.monotonic() < deadline, "the send never staged"
            time.sleep(0.005)
        data = _staged(c.scheme)
        data[spec.offset + 3] ^= 0x5A
        for i in range(2):
            c.resume(i)
        with pytest.raises(ws.WorkerApplyError, match=r"out\.weight") as refused:
            c.sender.wait_async(30)
        assert refused.value.worker_ids == (0, 1)
        assert "integrity check" in str(refused.value)
        for i in range(2):
            got = c.state(i)["weights"]
            assert all(torch.equal(got[n], before[i][n]) for n in got), "a refused update wrote the model"
        c.bump()
        c.sender.send(verify=True)
        for i in range(2):
            c.assert_has(i, c.expected())
    finally:
        c.close()
