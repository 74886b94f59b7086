"""The packet: what one send moves.

A send is prepared once into a flat layout: every tensor gets a fixed,
64-byte-aligned slice of one contiguous byte buffer. The :class:`Manifest`
(names, dtypes, shapes, offsets) depends only on the layout, so it is built
and sent to a worker once per layout and cached by its ``layout_id``; a
routine send carries only the version and the bytes.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ._exceptions import WeightMismatchError

__all__ = [
    "ALIGNMENT",
    "DEFAULT_TIMEOUT",
    "Manifest",
    "Packet",
    "Signature",
    "TensorSpec",
    "describe_mismatch",
    "signature_of",
]

#: Seconds a call waits by default: a send for every ack, a worker for an
#: awaited version. A dead worker or sender is reported long before this; the
#: deadline is for a peer that stops answering.
DEFAULT_TIMEOUT = 60.0

# Every slice starts on a cache line, so a byte view can be reinterpreted as
# any dtype and two tensors never share a line.
ALIGNMENT = 64

Signature = tuple[tuple[str, str, tuple[int, ...]], ...]


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightMismatchError(f"unknown dtype {name!r} in a manifest")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives in the packet's byte buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class Manifest:
    """The layout of a packet: one :class:`TensorSpec` per tensor, sorted by name.

    Two manifests with the same names, dtypes and shapes have the same
    ``layout_id`` and offsets, on any process.
    """

    signature: Signature
    specs: tuple[TensorSpec, ...] = field(repr=False)
    nbytes: int
    layout_id: str

    @functools.cached_property
    def fit(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) per tensor, in order: what tensors of this layout match."""
        return [(tuple(s.shape), s.dtype) for s in self.specs]

    @classmethod
    def from_signature(cls, signature: Signature) -> Manifest:
        specs = []
        offset = 0
        for name, dtype_name, shape in signature:
            dtype = _dtype_from_name(dtype_name)
            numel = 1
            for dim in shape:
                numel *= dim
            nbytes = numel * dtype.itemsize
            specs.append(TensorSpec(name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
        digest = hashlib.blake2b(repr(signature).encode(), digest_size=12).hexdigest()
        return cls(signature, tuple(specs), offset, digest)

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Manifest:
        """The manifest of a flat ``{name: tensor}`` mapping."""
        return cls.from_signature(signature_of(tensors))

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def ordered(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The tensors of ``tensors`` in manifest order."""
        return [tensors[spec.name] for spec in self.specs]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of each tensor's slice of a flat ``uint8`` buffer."""
        return [buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.specs]

    def check_matches(self, other: Manifest, *, model_id: str | None, where: str) -> None:
        """Raise :class:`WeightMismatchError` unless ``other`` (the layout of
        ``where``) has this layout: the one layout check of weightsync, so a
        mismatch reads the same wherever it is caught."""
        if other.layout_id == self.layout_id:
            return
        mine = {name: (dtype, shape) for name, dtype, shape in self.signature}
        theirs = {name: (dtype, shape) for name, dtype, shape in other.signature}
        missing = [n for n in theirs if n not in mine]
        extra = [n for n in mine if n not in theirs]
        wrong = [
            f"{n}: {mine[n][1]} {mine[n][0]} vs {theirs[n][1]} {theirs[n][0]}"
            for n in mine
            if n in theirs and mine[n] != theirs[n]
        ]
        raise WeightMismatchError(describe_mismatch(missing, extra, wrong, where=where), model_id=model_id)

    def check_within(self, other: Manifest, *, model_id: str | None, where: str) -> None:
        """Raise :class:`WeightMismatchError` unless every tensor of this
        (partial) layout is in ``other`` (the layout of ``where``) with the
        same dtype and shape; a name ``where`` lacks is named."""
        if other.layout_id == self.layout_id:
            return
        theirs = {name: (dtype, shape) for name, dtype, shape in other.signature}
        extra = [n for n, _, _ in self.signature if n not in theirs]
        wrong = [
            f"{n}: {shape} {dtype} vs {theirs[n][1]} {theirs[n][0]}"
            for n, dtype, shape in self.signature
            if n in theirs and theirs[n] != (dtype, shape)
        ]
        if extra or wrong:
            raise WeightMismatchError(describe_mismatch([], extra, wrong, where=where), model_id=model_id)


def describe_mismatch(missing: list[str], extra: list[str], wrong: list[str], *, where: str) -> str:
    parts = []
    for label, items in (("missing", missing), ("unexpected", extra), ("mismatched", wrong)):
        if items:
            shown = ", ".join(items[:5]) + (f", ... ({len(items)} in all)" if len(items) > 5 else "")
            parts.append(f"{label}: {shown}")
    return f"weights do not match {where} ({'; '.join(parts)})"


def signature_of(tensors: Mapping[str, torch.Tensor]) -> Signature:
    return tuple(
        (name, str(tensors[name].dtype).removeprefix("torch."), tuple(tensors[name].shape))
        for name in sorted(tensors)
    )


@dataclass(frozen=True, eq=False)
class Packet:
    """One prepared send: a version, its manifest, and the source tensors in
    manifest order (not yet copied anywhere)."""

    version: int
    manifest: Manifest
    tensors: Sequence[torch.Tensor] = field(repr=False)
    #: How many workers this packet goes to; each may copy with
    #: ``usable_cores() // fanout`` threads without oversubscribing the host.
    fanout: int = 1
    #: A partial update: some of the model's tensors, the others untouched.
    partial: bool = False
    #: With ``verify``: one digest per tensor, in manifest order (see
    #: ``_digest``), which each worker checks before it applies the update.
    digests: tuple[int, ...] | None = None

    @property
    def subset(self) -> Signature | None:
        """What a worker needs to find a partial update's tensors (their
        names, dtypes and shapes); None for a whole model."""
        return self.manifest.signature if self.partial else None

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes
