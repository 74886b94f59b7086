"""verify=True: the trainer digests every tensor it sends, and the bytes are
checked before any model is written.

- Copying schemes (multiprocess, in-process): each worker checks the bytes
  it is about to apply, and one whose bytes differ (here: the staging
  overwritten in the trainer after the send staged it) refuses the update,
  by name, with its model left as it was; the next send goes through.
- The shared scheme checks once for the host: the trainer checks each
  block of the slot right after writing it, so a byte changed before that
  check fails the send, by name, before any worker is told; a published
  slot is read-only in the trainer too, so a write into it afterwards
  faults in the writer; each worker checks that it maps the slot it was
  told.
"""

from __future__ import annotations

import time

import pytest
import torch
from harness import Cluster, new_cluster, schemes

import weightsync as ws
from weightsync._copy import CopyPlan
from weightsync._digest import BLOCK, copy_and_check, copy_with_digests, digests, mismatched
from weightsync._memory._segment import Segment
from weightsync._packet import Manifest
from weightsync._strategy import flat_weights
from weightsync._transports._pipes._slot_staging import SlotStaging


def _staged(scheme: ws.WeightSyncScheme) -> torch.Tensor:
    """The trainer's writable view of the bytes its last send staged."""
    staging = getattr(scheme.staging, "host", scheme.staging)  # (a pipe scheme's host staging)
    segment = getattr(staging, "segment", None) or getattr(staging, "current", None)
    assert segment is not None and segment.data is not None
    return segment.data


@pytest.mark.parametrize("scheme_name", schemes())
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


@pytest.mark.parametrize("scheme_name", ["multiprocess", "inprocess"])
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


def test_shared_slot_bytes_changed_before_the_trainers_check_are_refused_by_name(
    request: pytest.FixtureRequest,
) -> None:
    c: Cluster = new_cluster(request, "shared", ["net", "net"])
    try:
        c.bump()
        c.sender.send(verify=True)
        before = [c.state(i)["weights"] for i in range(2)]
        version = c.sender.async_sender.version
        spec = next(s for s in Manifest.of(flat_weights(c.model)).specs if s.name == "out.weight")
        staging = c.scheme.staging.host
        assert isinstance(staging, SlotStaging)

        def flip(index: int, start: int) -> None:
            # Between the copy of out.weight's block and its check: memory
            # that changed under the trainer.
            if index == spec_index:
                slot = _writing(staging)
                assert slot.data is not None
                slot.data[spec.offset + 3] ^= 0x5A

        spec_index = Manifest.of(flat_weights(c.model)).names.index("out.weight")
        staging.after_copy = flip
        c.bump()
        with pytest.raises(ws.InvalidWeightsError, match=r"out\.weight"):
            c.sender.send(verify=True)
        staging.after_copy = None
        assert c.sender.async_sender.version == version, "a refused send used a version"
        for i in range(2):
            got = c.state(i)["weights"]
            assert all(torch.equal(got[n], before[i][n]) for n in got), "a refused update reached a worker"
            assert c.state(i)["errors"] == []
        c.sender.send(verify=True)
        for i in range(2):
            c.assert_has(i, c.expected())
    finally:
        c.close()


def _writing(staging: SlotStaging) -> Segment:
    """The slot a send is being written into: the one not published."""
    return next(slot for slot in staging.slots if slot.published() == -1)


WRITE_A_PUBLISHED_SLOT = """
import asyncio
import multiprocessing as mp
import torch
import weightsync as ws
from weightsync._packing import Packer

ours, theirs = mp.Pipe()
scheme = ws.SharedMemWeightSyncScheme(timeout=30)
model = {"w": torch.ones(1 << 16)}
scheme.init_on_sender("policy", pipes=[ours], model=model)
staging = scheme.staging.host
# Staged (checked and published) with no worker: the packet goes no further.
packet = Packer("policy", None, None).packet(1, model)
staging.write(packet, True, {})
slot = staging.current
print("published", slot.published(), flush=True)
slot.data[7] = 1  # nothing in the trainer may write a published slot
print("wrote", flush=True)
"""


@pytest.mark.extended  # a child interpreter of its own
def test_a_write_into_a_published_slot_faults_in_the_writer() -> None:
    import signal
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", WRITE_A_PUBLISHED_SLOT], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.splitlines() == ["published 1"], done.stdout + done.stderr[-2000:]
    assert done.returncode == -signal.SIGSEGV, done.stderr[-2000:]


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
    # A pair over the same bytes (a sender group's rank 0 sends from the
    # buffer its ranks wrote) is digested alike, its bytes left as they are.
    assert copy_with_digests(tensors, tensors, threads=3) == one
    plan = CopyPlan([*tensors, copies[0]], [*tensors, tensors[0]])
    assert plan.total == tensors[0].nbytes and len(plan.spans) == 1


def test_the_checked_copy_finds_a_block_changed_between_its_copy_and_its_check() -> None:
    tensors = _odd_tensors()
    copies = [torch.zeros_like(t) for t in tensors]
    sums, bad = copy_and_check(copies, tensors, threads=3)
    assert sums == digests(tensors) and bad == []
    assert all(torch.equal(c, t) for c, t in zip(copies, tensors, strict=True))

    def change(index: int, start: int) -> None:
        if index == 2 and start == BLOCK:  # b's middle block, once copied
            copies[2][BLOCK + 3] ^= 1

    assert copy_and_check(copies, tensors, threads=3, after_copy=change)[1] == [2]


def test_a_changed_byte_names_its_tensor_whatever_block_it_is_in() -> None:
    tensors = _odd_tensors()
    names = ["a", "empty", "b", "c"]
    sums = digests(tensors)
    assert mismatched(names, tensors, sums, threads=2) == []
    tensors[2][BLOCK + 3] ^= 1  # the middle block of b
    tensors[3][4, 2] += 1.0
    assert mismatched(names, tensors, sums, threads=2) == ["b", "c"]
    assert mismatched(names, tensors, sums[:-1]) == names  # a malformed list refuses all
