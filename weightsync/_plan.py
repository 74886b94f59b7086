"""The transfer plan of a sharded send: which byte ranges of which sender
go to which receiver.

A sharded trainer (FSDP2's ``fully_shard``, tensor parallelism) holds each
tensor spread over a mesh of ranks, each rank one box of it (a DTensor's
local shard); its receivers hold each tensor whole, or spread over a mesh
of their own (a tensor-parallel policy). The plan intersects the boxes of
the two sides and turns each intersection into runs of contiguous bytes,
from a sender's buffer (its local shards, one after the other) to a
receiver's (likewise). It is a pure function of the two layouts and the
numbers of ranks, computed once per layout and membership and tested with
no process at all, as the send machine is.

Bytes that several ranks of the sending side hold (a ``Replicate``
placement) are sent by one of them; which one turns with the receiver,
so that no sender carries them all.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._packet import ALIGNMENT

__all__ = [
    "Replicate",
    "Run",
    "Shard",
    "TensorLayout",
    "TransferPlan",
    "intersect",
    "layout_of",
    "plan_transfers",
]


@dataclass(frozen=True)
class Shard:
    """The tensor's dimension ``dim`` is split over one mesh dimension, as
    ``torch.chunk`` splits it (pieces of ``ceil(n / ranks)``, the last ones
    shorter or empty), as DTensor's ``Shard(dim)`` does."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """Every rank along one mesh dimension holds the same piece."""


Placement = Shard | Replicate

#: A box of a tensor: per dimension, [start, stop).
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TensorLayout:
    """How one tensor is laid out over a group of ranks: its global
    ``shape``, its element size, the ``mesh`` of ranks (its shape; rank r
    is the row-major flattening of its coordinate) and one placement per
    mesh dimension. ``mesh=()``: every rank of its side holds it whole
    (a buffer FSDP2 does not shard; a receiver's full tensor)."""

    shape: tuple[int, ...]
    itemsize: int
    mesh: tuple[int, ...] = ()
    placements: tuple[Placement, ...] = ()

    def __post_init__(self) -> None:
        if len(self.mesh) != len(self.placements):
            raise ValueError(f"a mesh of {len(self.mesh)} dimensions needs as many placements")
        for p in self.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < len(self.shape):
                raise ValueError(f"Shard({p.dim}) of a tensor of {len(self.shape)} dimensions")

    @property
    def ranks(self) -> int:
        return math.prod(self.mesh)

    def box(self, rank: int) -> Box:
        """The part of the global tensor that ``rank`` holds (possibly empty)."""
        coords = _coordinates(rank, self.mesh)
        box = [(0, n) for n in self.shape]
        for size, coord, placement in zip(self.mesh, coords, self.placements, strict=True):
            if isinstance(placement, Shard):
                start, stop = box[placement.dim]
                chunk = -(-(stop - start) // size) if stop > start else 0
                lo = min(start + coord * chunk, stop)
                box[placement.dim] = (lo, min(lo + chunk, stop))
        return tuple(box)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box(rank))

    def local_nbytes(self, rank: int) -> int:
        return math.prod(self.local_shape(rank)) * self.itemsize


def _coordinates(rank: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(mesh):
        rank, coord = divmod(rank, size)
        coords.append(coord)
    return tuple(reversed(coords))


def layout_of(tensor: Any) -> TensorLayout:
    """The layout of a DTensor (read from its mesh and placements, never
    from its data), or of a plain tensor (whole, on one rank).

    :raises ValueError: a placement other than ``Shard`` or ``Replicate``
        (a ``Partial`` sum is not weights yet).
    """
    itemsize = tensor.element_size()
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None:
        return TensorLayout(tuple(tensor.shape), itemsize)
    placements: list[Placement] = []
    for p in tensor.placements:
        if p.is_shard():
            placements.append(Shard(p.dim))
        elif p.is_replicate():
            placements.append(Replicate())
        else:
            raise ValueError(f"a DTensor placed {p!r} holds no weights yet (reduce it first)")
    return TensorLayout(tuple(tensor.shape), itemsize, tuple(mesh.shape), tuple(placements))


@dataclass(frozen=True)
class Run:
    """``nbytes`` contiguous bytes of sender ``sender``'s buffer at ``src``
    go to receiver ``receiver``'s buffer at ``dst``."""

    sender: int
    receiver: int
    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class TransferPlan:
    """What a sharded send moves: the runs, and where each tensor's local
    piece sits in each side's buffer."""

    runs: tuple[Run, ...]
    #: Per sender rank: its buffer's size, and each tensor's offset in it.
    src_offsets: tuple[tuple[int, ...], ...]
    src_nbytes: tuple[int, ...]
    #: Per receiver: likewise.
    dst_offsets: tuple[tuple[int, ...], ...]
    dst_nbytes: tuple[int, ...]
    #: Bytes each sender sends, and each receiver takes in.
    sent: tuple[int, ...] = field(default=())
    taken: tuple[int, ...] = field(default=())

    def of_sender(self, sender: int) -> list[Run]:
        return [run for run in self.runs if run.sender == sender]

    def of_receiver(self, receiver: int) -> list[Run]:
        return [run for run in self.runs if run.receiver == receiver]


def _offsets(layouts: Sequence[TensorLayout], rank: int, align: int) -> tuple[tuple[int, ...], int]:
    offsets, offset = [], 0
    for layout in layouts:
        offsets.append(offset)
        offset += -(-layout.local_nbytes(rank) // align) * align
    return tuple(offsets), offset


def intersect(a: Box, b: Box) -> Box | None:
    """The box two boxes share (None: none)."""
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in box) else box


def _runs_of(part: Box, src_box: Box, dst_box: Box, itemsize: int) -> Iterator[tuple[int, int, int]]:
    """``part`` (inside both boxes) as (src byte, dst byte, nbytes) runs,
    each side's box stored row-major on its own."""
    src_shape = [hi - lo for lo, hi in src_box]
    dst_shape = [hi - lo for lo, hi in dst_box]
    dims = len(part)
    # The trailing dimensions ``part`` spans whole on both sides are one run.
    k = dims
    while k > 0 and part[k - 1] == src_box[k - 1] == dst_box[k - 1]:
        k -= 1
    # Dimension k - 1 (if any) is cut: each row of it is one run.
    inner = math.prod(hi - lo for lo, hi in part[max(k - 1, 0) :]) if dims else 1
    src_strides = [math.prod(src_shape[d + 1 :]) for d in range(dims)]
    dst_strides = [math.prod(dst_shape[d + 1 :]) for d in range(dims)]
    outer = [range(lo, hi) for lo, hi in part[: max(k - 1, 0)]]
    start = [lo for lo, _ in part]
    for index in itertools.product(*outer):
        at = list(index) + start[len(index) :]
        src = sum((i - lo) * s for i, (lo, _), s in zip(at, src_box, src_strides, strict=True))
        dst = sum((i - lo) * s for i, (lo, _), s in zip(at, dst_box, dst_strides, strict=True))
        yield src * itemsize, dst * itemsize, inner * itemsize


def plan_transfers(
    senders: Sequence[TensorLayout],
    receivers: Sequence[TensorLayout],
    *,
    receiver_groups: int = 1,
    align: int = ALIGNMENT,
) -> TransferPlan:
    """The plan that moves tensors laid out as ``senders`` (one layout per
    tensor, over the sending ranks) to ``receivers`` (one per tensor, over
    one receiving group's ranks), for ``receiver_groups`` groups alike
    (receiver ``g * group_ranks + r`` is rank r of group g). Each side's
    buffer holds its local pieces in tensor order, each at an ``align``
    boundary.

    :raises ValueError: the two sides disagree on a tensor's shape or
        element size, or the sending layouts span different numbers of ranks.
    """
    if len(senders) != len(receivers):
        raise ValueError(f"{len(senders)} sending layouts for {len(receivers)} receiving ones")
    n_send = max((s.ranks for s in senders), default=1)
    n_group = max((r.ranks for r in receivers), default=1)
    for i, (s, r) in enumerate(zip(senders, receivers, strict=True)):
        if s.shape != r.shape or s.itemsize != r.itemsize:
            raise ValueError(f"tensor {i}: {s.shape} x {s.itemsize} B sent, {r.shape} x {r.itemsize} B taken")
        if s.ranks not in (1, n_send) or r.ranks not in (1, n_group):
            raise ValueError(f"tensor {i}: every layout of a side spans the same ranks")
    src = [_offsets(senders, rank, align) for rank in range(n_send)]
    dst = [_offsets(receivers, rank, align) for rank in range(n_group)]
    runs: list[Run] = []
    sent = [0] * n_send
    taken = [0] * (n_group * receiver_groups)
    for t, (s, r) in enumerate(zip(senders, receivers, strict=True)):
        # One holder per distinct piece: where replicas hold the same box,
        # the one that sends turns with the receiver.
        by_box: dict[Box, list[int]] = {}
        for rank in range(n_send):
            by_box.setdefault(s.box(rank), []).append(rank)
        for receiver in range(n_group * receiver_groups):
            rank_in_group = receiver % n_group
            want = r.box(rank_in_group)
            for box, holders in by_box.items():
                part = intersect(box, want)
                if part is None:
                    continue
                sender = holders[(receiver + t) % len(holders)]
                src_base = src[sender][0][t]
                dst_base = dst[rank_in_group][0][t]
                for a, b, n in _runs_of(part, box, want, s.itemsize):
                    last = runs[-1] if runs else None
                    if (
                        last is not None
                        and last.sender == sender
                        and last.receiver == receiver
                        and last.src + last.nbytes == src_base + a
                        and last.dst + last.nbytes == dst_base + b
                    ):
                        runs[-1] = Run(sender, receiver, last.src, last.dst, last.nbytes + n)
                    else:
                        runs.append(Run(sender, receiver, src_base + a, dst_base + b, n))
                    sent[sender] += n
                    taken[receiver] += n
    return TransferPlan(
        runs=tuple(runs),
        src_offsets=tuple(o for o, _ in src),
        src_nbytes=tuple(n for _, n in src),
        dst_offsets=tuple(o for o, _ in dst),
        dst_nbytes=tuple(n for _, n in dst),
        sent=tuple(sent),
        taken=tuple(taken),
    )
