"""A sender group on one host: the trainer's ranks and a class of workers
all on the same host share one buffer (shared memory that rank 0 makes
and every rank maps), into which every rank writes its own part of each
version, and from which rank 0 alone sends the version, once every rank's
part is in. The workers take it as one part, from one session, as from a
single sender: one notice, one copy out of the buffer, one ack (each
takes :func:`~weightsync._shards.whole_part`); the ranks other than 0
have no session for the class.

A rank other than 0 says in the store that its part of send ``seq`` is
written, or why not (``SenderGroup.staged``); rank 0 writes its own, then
waits for all of them (``SenderGroup.wait_staged``) before it stages its
send, which publishes the version. A rank that raised, died or stopped
before it said so leaves the version unpublished: no worker is told of
it, and every worker holds the one before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..._copy import usable_cores
from ..._exceptions import InvalidWeightsError
from ..._memory._segment import Segment
from ..._packet import Manifest
from ..._shards import Part, Want, local_tensors, part_signature, place

__all__ = ["HostBuffer"]


class HostBuffer:
    """One class's buffer on a sender group's host: what this rank writes
    into it (``sub``, its part cut to the class's boxes ``want``), and, on
    rank 0, the sender of the class (``sender``), whose sends are
    :attr:`views` of it (``whole``'s tensors). ``ranks``: how many ranks
    write at once (they share the host's cores)."""

    def __init__(
        self, segment: Segment, whole: Part, sub: Part, want: Want, ranks: int, sender: Any = None
    ) -> None:
        assert segment.data is not None
        self.segment = segment
        self.sub = sub
        self.want = want
        self.ranks = ranks
        #: Rank 0's sender of the class (a ``WeightSender``, which owns the
        #: segment from then on); None on the other ranks.
        self.sender = sender
        manifest = Manifest.from_signature(part_signature(whole))
        #: The class's tensors (the boxes its workers hold), as views of
        #: the buffer in the manifest's order: what rank 0 sends.
        self.views = dict(zip(manifest.names, manifest.views(segment.data), strict=True))

    def write(self, tensors: Mapping[str, Any], part: Part, version: int) -> None:
        """Write this rank's pieces of ``version`` (``tensors``: its state
        dict, ``part``: its part of the group) into their boxes of the
        buffer. The buffer is marked as being filled with ``version``
        first: a worker still copying the version before sees it
        overwritten. Blocks while it copies.

        :raises InvalidWeightsError: a tensor is not of the shape or dtype
            the group's plan has for it (nothing is written).
        """
        sources = local_tensors(tensors, part, self.sub)
        for piece, source in zip(self.sub.pieces, sources.values(), strict=True):
            shape, dtype = tuple(source.shape), str(source.dtype).removeprefix("torch.")
            if shape != piece.local_shape or dtype != piece.dtype:
                raise InvalidWeightsError(
                    f"weight {piece.name!r}: this rank's shard is {dtype}{list(shape)}, the sender group's "
                    f"plan has {piece.dtype}{list(piece.local_shape)} (a layout change needs a new scheme)"
                )
        self.segment.begin_fill(version)
        with torch.no_grad():
            # (The ranks write at once: each on its share of the cores. More
            # copy threads than cores only switch between them.)
            threads = max(1, usable_cores() // self.ranks)
            place(self.views, [(self.sub, list(sources.values()))], self.want, threads=threads)

    def close(self) -> None:
        """Let go of the buffer (rank 0's sender closes its own; the views
        kept its memory mapped). Idempotent."""
        self.views = {}
        if self.sender is None:
            self.segment.close()
