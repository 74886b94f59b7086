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
from weightsync._digest import BLOCK, copy_with_digests, digests, mismatched
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


def _odd_tensors() -> list[torch.Tensor]:
    """A block and a half, no bytes, two blocks and a few bytes (one tensor
    cut over threads), a small one."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(3 * BLOCK // 8, generator=gen),
        torch.empty(0),
        torch.randint(0, 255, (2 * BLOCK + 7,), dtype=torch.uint8, generator=gen),
        torch.randn(5, 3, generator=gen, dtype=torch.float64),
    ]


def test_digests_do_not_depend_on_threads_or_on_being_taken_while_copying() -> None:
    tensors = _odd_tensors()
    one = digests(tensors, threads=1)
    assert len(one) == 2 + 1 + 3 + 1  # blocks: 2, the empty tensor's 1, 3, 1
    assert digests(tensors, threads=3) == one
    copies = [torch.zeros_like(t) for t in tensors]
    assert copy_with_digests(copies, tensors, threads=3) == one
    assert all(torch.equal(c, t) for c, t in zip(copies, tensors, strict=True))
    # A source that is not a plain tensor (a transposed view) goes through
    # torch's copy, and the copies are digested: the same digests.
    square = torch.randn(64, 64)
    into = torch.zeros(64, 64)
    assert copy_with_digests([into], [square.t()], threads=2) == digests([square.t().contiguous()])
    assert torch.equal(into, square.t())


def test_a_changed_byte_names_its_tensor_whatever_block_it_is_in() -> None:
    tensors = _odd_tensors()
    names = ["a", "empty", "b", "c"]
    sums = digests(tensors)
    assert mismatched(names, tensors, sums, threads=2) == []
    tensors[2][BLOCK + 3] ^= 1  # the middle block of b
    tensors[3][4, 2] += 1.0
    assert mismatched(names, tensors, sums, threads=2) == ["b", "c"]
    assert mismatched(names, tensors, sums[:-1]) == names  # a malformed list refuses all
