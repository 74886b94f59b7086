"""The transfer plan of a sharded send, a pure function tested with no
process: over random shapes, element sizes, meshes and placements on both
sides, the runs rebuild every receiver's pieces byte for byte, write each
byte once, and send replicated bytes from turning holders; the bytes each
side moves are what FSDP2 and tensor-parallel layouts imply."""

from __future__ import annotations

import math
import random

import pytest
import torch

from weightsync._plan import Replicate, Shard, TensorLayout, plan_transfers


def _slice(box):
    return tuple(slice(lo, hi) for lo, hi in box)


def _simulate(senders, receivers, groups, seed=0):
    """Run the plan over real bytes: the receivers' buffers, and how many
    times each of their bytes was written."""
    gen = torch.Generator().manual_seed(seed)
    plan = plan_transfers(senders, receivers, receiver_groups=groups)
    tensors = [
        torch.randint(0, 256, (*s.shape, s.itemsize), generator=gen, dtype=torch.uint8) for s in senders
    ]
    n_send = len(plan.src_nbytes)
    n_group = len(plan.dst_nbytes)
    src = [torch.zeros(plan.src_nbytes[r], dtype=torch.uint8) for r in range(n_send)]
    for rank in range(n_send):
        for t, (s, tensor) in enumerate(zip(senders, tensors, strict=True)):
            piece = tensor[_slice(s.box(rank))].reshape(-1)
            at = plan.src_offsets[rank][t]
            src[rank][at : at + piece.numel()] = piece
    dst = [torch.zeros(plan.dst_nbytes[r % n_group], dtype=torch.uint8) for r in range(n_group * groups)]
    writes = [torch.zeros_like(d, dtype=torch.int32) for d in dst]
    for run in plan.runs:
        dst[run.receiver][run.dst : run.dst + run.nbytes] = src[run.sender][run.src : run.src + run.nbytes]
        writes[run.receiver][run.dst : run.dst + run.nbytes] += 1
    for receiver in range(n_group * groups):
        rank = receiver % n_group
        for t, (r, tensor) in enumerate(zip(receivers, tensors, strict=True)):
            want = tensor[_slice(r.box(rank))].reshape(-1)
            at = plan.dst_offsets[rank][t]
            assert torch.equal(dst[receiver][at : at + want.numel()], want), (receiver, t)
            assert bool((writes[receiver][at : at + want.numel()] == 1).all()), (receiver, t)
    return plan


def _random_layout(rng, shape, itemsize, ranks):
    if ranks == 1 or rng.random() < 0.15:
        return TensorLayout(shape, itemsize)
    mesh = (ranks,) if ranks not in (4, 6) or rng.random() < 0.5 else (2, ranks // 2)
    placements = tuple(
        Shard(rng.randrange(len(shape))) if shape and rng.random() < 0.75 else Replicate() for _ in mesh
    )
    return TensorLayout(shape, itemsize, mesh, placements)


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts_rebuild_every_receiver_byte_for_byte(seed: int) -> None:
    rng = random.Random(seed)
    n_send = rng.choice([1, 2, 3, 4, 6])
    n_recv = rng.choice([1, 2, 3, 4])
    groups = rng.choice([1, 2, 3])
    senders, receivers = [], []
    for _ in range(rng.randint(1, 5)):
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3)))
        itemsize = rng.choice([1, 2, 4, 8])
        senders.append(_random_layout(rng, shape, itemsize, n_send))
        receivers.append(_random_layout(rng, shape, itemsize, n_recv))
    # (Layouts of one side span one number of ranks: pad those left whole.)
    n_send = max(s.ranks for s in senders)
    n_recv = max(r.ranks for r in receivers)
    senders = [s if s.ranks in (1, n_send) else TensorLayout(s.shape, s.itemsize) for s in senders]
    receivers = [r if r.ranks in (1, n_recv) else TensorLayout(r.shape, r.itemsize) for r in receivers]
    _simulate(senders, receivers, groups, seed)


def test_fsdp2_shards_to_full_copies_each_sender_sends_its_shard_to_each_receiver() -> None:
    # 4 ranks, Shard(0) of uneven tensors (torch.chunk: 3, 3, 3, 1 rows of 10).
    senders = [TensorLayout((10, 6), 4, (4,), (Shard(0),)), TensorLayout((7,), 4, (4,), (Shard(0),))]
    receivers = [TensorLayout((10, 6), 4), TensorLayout((7,), 4)]
    plan = _simulate(senders, receivers, groups=4)
    local = [sum(s.local_nbytes(rank) for s in senders) for rank in range(4)]
    assert list(plan.sent) == [4 * n for n in local]
    total = (10 * 6 + 7) * 4
    assert list(plan.taken) == [total] * 4
    # Each sender's shard of a row-sharded tensor is one run per receiver.
    assert len([r for r in plan.runs if r.sender == 0]) == 4 * 2


def test_tensor_parallel_receivers_take_only_their_half() -> None:
    # FSDP2 over 4 trainer ranks; 2 replicas, each tensor-parallel over 2.
    senders = [TensorLayout((8, 6), 2, (4,), (Shard(0),))]
    column = [TensorLayout((8, 6), 2, (2,), (Shard(0),))]
    row = [TensorLayout((8, 6), 2, (2,), (Shard(1),))]
    for receivers in (column, row):
        plan = _simulate(senders, receivers, groups=2)
        assert list(plan.taken) == [8 * 6 * 2 // 2] * 4
    # Row-parallel halves cut each row: one run per row and sender.
    plan = plan_transfers(senders, row, receiver_groups=2)
    assert len(plan.of_receiver(0)) == 8


def test_replicated_bytes_are_sent_by_turning_holders() -> None:
    senders = [TensorLayout((16,), 4, (4,), (Replicate(),)) for _ in range(4)]
    receivers = [TensorLayout((16,), 4) for _ in range(4)]
    plan = _simulate(senders, receivers, groups=4)
    assert list(plan.sent) == [4 * 16 * 4 * 4 // 4] * 4
    assert math.prod(plan.taken) == (4 * 16 * 4) ** 4


def test_mismatched_sides_are_refused() -> None:
    with pytest.raises(ValueError, match="sent"):
        plan_transfers([TensorLayout((4,), 4)], [TensorLayout((5,), 4)])
    with pytest.raises(ValueError, match="placements"):
        TensorLayout((4,), 4, (2,), ())
    with pytest.raises(ValueError, match="Shard"):
        TensorLayout((4,), 4, (2,), (Shard(1),))
