"""The trainer's side of ``DistributedWeightSyncScheme(delta=True)``: which
version is the base, who holds it, and the encoded chain of a send against
it (``_delta`` encodes, ``_chain`` carries the frames)."""

from __future__ import annotations

import torch

from .._delta import DeltaEncoder
from .._packet import Manifest
from ._chain import Encoded, EncodedSend

__all__ = ["DeltaBase"]


class DeltaBase:
    """``delta=True``: the trainer's base (the last whole version sent and
    acked, held by the workers that acked it) and the encoder of each send
    against it.

    The base is the staged buffer of that send itself, kept instead of
    copied (the staging takes the old base's memory for its next send), so
    it costs one buffer of the model's size and no copy. Who holds it: the
    workers of that send; a worker believed to hold it that does not (it
    restarted, its buffer was overwritten) says so, and gets the full bytes.
    """

    def __init__(self) -> None:
        self.encoder: DeltaEncoder | None = None
        #: The workers that acked the base's version.
        self.holders: frozenset[int] = frozenset()
        #: The last send: its version, its workers (rank -> worker id),
        #: whether it was whole, and the worker ids that acked it (the
        #: sender's own record of that send, filled as the acks come).
        self.last: tuple[int, dict[int, int], bool, set[int]] | None = None

    def keep(self, staged: torch.Tensor, nbytes: int) -> tuple[bool, torch.Tensor | None]:
        """Before the next send is staged: if the last one was whole and
        acked, its staged bytes become the base, held by the workers that
        acked it (those that did not, dead or late, get the full bytes
        next). Returns whether they did (the next send must then be staged
        elsewhere), and the old base's memory to stage it in, if any."""
        last, self.last = self.last, None
        encoder = self.encoder
        if last is None or encoder is None or encoder.nbytes != nbytes:
            return False, None
        version, ranks, whole, done = last
        holders = frozenset(rank for rank, wid in ranks.items() if wid in done)
        if not whole or not holders:
            return False, None
        previous = encoder.adopt(staged[:nbytes], version)
        self.holders = holders
        return True, None if previous is None else torch.from_numpy(previous)

    def encoded(self, buffer: torch.Tensor, manifest: Manifest, ranks: list[int]) -> EncodedSend | None:
        """The delta chain of a whole send of ``manifest`` staged in
        ``buffer``, or None when there is no base for it (a new layout: the
        encoder starts again)."""
        nbytes = manifest.nbytes
        # Byte planes are split by the dtype that holds most of the bytes.
        share: dict[int, int] = {}
        for spec in manifest.specs:
            share[spec.dtype.itemsize] = share.get(spec.dtype.itemsize, 0) + spec.nbytes
        element_size = max(share, key=lambda size: share[size]) if share else 1
        encoder = self.encoder
        if encoder is None or encoder.nbytes != nbytes or encoder.element_size != element_size:
            self.encoder = DeltaEncoder(nbytes, element_size)
            self.holders = frozenset()
            return None
        if encoder.base_version is None or not self.holders.intersection(ranks):
            return None
        view = buffer[:nbytes]
        link = Encoded(encoder.base_version, element_size, len(encoder.spans))
        return EncodedSend(link, lambda: encoder.frames(view), self.holders)
