"""The trainer's delta base, for every chain that carries deltas
(``delta=True``: torch.distributed's chain, Ray's relay): the last whole
send that its receivers acked, kept as the encoder's base instead of
copied, and the chain of encoded frames of each send against it
(``_delta`` encodes, ``_chain`` carries the frames).

Who holds the base is each chain's own to say (the workers of that send
that acked it; the host agents whose buffer holds its version): a member
believed to hold it that does not says so and gets the full bytes.
"""

from __future__ import annotations

from typing import Any

from .._delta import DeltaEncoder
from .._frames import CHUNK_BYTES
from .._packet import Manifest
from ._chain import Encoded, EncodedSend

__all__ = ["DeltaBase", "element_size"]


def element_size(manifest: Manifest) -> int:
    """The bytes per element that a send's frames split byte planes by: the
    dtype size that holds most of its bytes."""
    share: dict[int, int] = {}
    for spec in manifest.specs:
        share[spec.dtype.itemsize] = share.get(spec.dtype.itemsize, 0) + spec.nbytes
    return max(share, key=lambda size: share[size]) if share else 1


class DeltaBase:
    """The encoder of one model's sends and its base.

    The base is the buffer of a send that was whole and acked, kept rather
    than copied (:meth:`adopt`): the caller gathers or stages its next send
    in the memory of the base it replaces, so the base costs one buffer of
    the model's size and no copy."""

    def __init__(self, chunk: int = CHUNK_BYTES) -> None:
        self.chunk = chunk
        self.encoder: DeltaEncoder | None = None

    @property
    def version(self) -> int | None:
        """The base's version (None: no base)."""
        return None if self.encoder is None else self.encoder.base_version

    def fits(self, nbytes: int) -> bool:
        """Whether a send of ``nbytes`` fits the encoder (may be adopted)."""
        return self.encoder is not None and self.encoder.nbytes == nbytes

    def fit(self, nbytes: int, element_size: int) -> bool:
        """Get ready for a send of ``nbytes`` split by ``element_size``:
        True where the encoder fits it (its base may serve), False where it
        starts again (a new layout: no base until a send is adopted)."""
        encoder = self.encoder
        if encoder is not None and encoder.nbytes == nbytes and encoder.element_size == element_size:
            return True
        self.encoder = DeltaEncoder(nbytes, element_size, chunk_bytes=self.chunk) if nbytes else None
        return False

    def adopt(self, buffer: Any, version: int) -> Any | None:
        """Make ``buffer`` (a whole send of ``version``, acked by those that
        hold it from now on; it :meth:`fits`) the base, kept as it is: the
        caller must not write it again. Returns the previous base's memory
        (a numpy array; None: there was none) for the caller's next send."""
        assert self.encoder is not None, "fit() comes first"
        return self.encoder.adopt(buffer, version)

    def chain(self, current: Any, eligible: set[Any]) -> EncodedSend | None:
        """The delta chain of ``current`` (the send's flat bytes, unchanged
        until its frames are taken) for the ``eligible`` members (those
        believed to hold the base); None where there is no base or no
        member is eligible (the send goes as full bytes)."""
        encoder = self.encoder
        if encoder is None or encoder.base_version is None or not eligible:
            return None
        link = Encoded(encoder.base_version, encoder.element_size, len(encoder.spans))
        return EncodedSend(link, lambda: encoder.frames(current), eligible)
