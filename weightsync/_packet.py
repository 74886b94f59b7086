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
from typing import Any, NamedTuple

import torch

from ._exceptions import WeightMismatchError

__all__ = [
    "ALIGNMENT",
    "ChainReport",
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

    def check_matches(
        self,
        other: Manifest,
        *,
        model_id: str | None,
        where: str,
        sides: tuple[str, str] = ("weights", "model"),
    ) -> None:
        """Raise :class:`WeightMismatchError` unless ``other`` (the layout of
        ``where``) has this layout: the one layout check of weightsync, so a
        mismatch reads the same wherever it is caught. ``sides`` name this
        layout's side and ``other``'s in the message."""
        differences = self._differences(other, partial=False, sides=sides)
        if differences is not None:
            raise WeightMismatchError(describe_mismatch(*differences, where=where), model_id=model_id)

    def check_within(
        self,
        other: Manifest,
        *,
        model_id: str | None,
        where: str,
        sides: tuple[str, str] = ("weights", "model"),
    ) -> None:
        """Raise :class:`WeightMismatchError` unless every tensor of this
        (partial) layout is in ``other`` (the layout of ``where``) with the
        same dtype and shape; a name ``where`` lacks is named."""
        differences = self._differences(other, partial=True, sides=sides)
        if differences is not None:
            raise WeightMismatchError(describe_mismatch(*differences, where=where), model_id=model_id)

    def check_workers(
        self, layouts: Mapping[int, Manifest | None], *, partial: bool, model_id: str | None
    ) -> None:
        """Raise one :class:`WeightMismatchError` naming every worker whose
        model (its layout in ``layouts``; None: not known yet) this layout,
        the trainer's, does not fit, with each one's differences, and with
        ``wire_dtype`` suggested where the workers hold a narrower float
        dtype than the trainer's float32.

        :raises WeightMismatchError: one worker or more does not fit;
            ``worker_ids`` lists them.
        """
        by_text: dict[str, list[int]] = {}
        narrower: dict[str, list[int]] = {}
        for wid, layout in layouts.items():
            if layout is None:
                continue
            differences = self._differences(layout, partial=partial, sides=("trainer", "worker"))
            if differences is not None:
                by_text.setdefault(_parts(*differences), []).append(wid)
                for dtype in _narrower_floats(self, layout):
                    narrower.setdefault(dtype, []).append(wid)
        if not by_text:
            return
        failed = sorted(w for ids in by_text.values() for w in ids)
        if len(by_text) == 1:
            [(text, ids)] = by_text.items()
            plural = "models" if len(ids) > 1 else "model"
            message = f"the trainer's weights do not match the {plural} of {_worker_list(ids)} ({text})"
        else:
            groups = "; ".join(f"{_worker_list(ids)} ({text})" for text, ids in by_text.items())
            message = f"the trainer's weights do not match the models of {len(failed)} workers: {groups}"
        if len(narrower) == 1:  # one wire_dtype can fix it (two cannot)
            [(dtype, ids)] = narrower.items()
            holds = "holds" if len(ids) == 1 else "hold"
            message += (
                f". {_worker_list(ids).capitalize()} {holds} {dtype} where the trainer has float32: create "
                f"the scheme with wire_dtype=torch.{dtype} to send the trainer's float32 weights as {dtype}"
            )
        raise WeightMismatchError(message, model_id=model_id, worker_ids=tuple(failed))

    def _differences(
        self, other: Manifest, *, partial: bool, sides: tuple[str, str]
    ) -> tuple[list[str], list[str], list[str]] | None:
        """(missing, unexpected, mismatched) as :func:`describe_mismatch`
        takes them; None when this layout fits ``other``. A partial layout
        misses nothing."""
        if other.layout_id == self.layout_id:
            return None
        mine = {name: (dtype, shape) for name, dtype, shape in self.signature}
        theirs = {name: (dtype, shape) for name, dtype, shape in other.signature}
        missing = [] if partial else [n for n in theirs if n not in mine]
        extra = [n for n in mine if n not in theirs]
        ours, their_side = sides
        wrong = [
            f"{n}: {ours} {mine[n][1]} {mine[n][0]} vs {their_side} {theirs[n][1]} {theirs[n][0]}"
            for n in mine
            if n in theirs and mine[n] != theirs[n]
        ]
        if not (missing or extra or wrong):
            return None
        return missing, extra, wrong


def _narrower_floats(trainer: Manifest, worker: Manifest) -> set[str]:
    """The dtypes a wire_dtype could cast to that ``worker`` holds where
    ``trainer`` has float32 tensors of the same shape."""
    theirs = {name: (dtype, shape) for name, dtype, shape in worker.signature}
    return {
        theirs[n][0]
        for n, dtype, shape in trainer.signature
        if dtype == "float32" and n in theirs and theirs[n][1] == shape and theirs[n][0] in _WIRE_DTYPES
    }


# What wire_dtype casts float32 to (see _copy.WireCast).
_WIRE_DTYPES = ("bfloat16", "float16")


def _worker_list(ids: Sequence[int], shown: int = 8) -> str:
    """``ids`` as "worker 0", "worker 0 and worker 2", ..., at most ``shown``
    of them named, each as "worker i" so that a worker's name is in the text."""
    names = [f"worker {i}" for i in ids[:shown]]
    if len(ids) > shown:
        return ", ".join(names) + f" and {len(ids) - shown} more"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _parts(missing: list[str], extra: list[str], wrong: list[str]) -> str:
    parts = []
    for label, items in (("missing", missing), ("unexpected", extra), ("mismatched", wrong)):
        if items:
            shown = ", ".join(items[:5]) + (f", ... ({len(items)} in all)" if len(items) > 5 else "")
            parts.append(f"{label}: {shown}")
    return "; ".join(parts)


def describe_mismatch(missing: list[str], extra: list[str], wrong: list[str], *, where: str) -> str:
    """Why weights do not match ``where``: the names it has and they lack
    (missing), they have and it lacks (unexpected), and those of another
    shape or dtype (mismatched)."""
    return f"weights do not match {where} ({_parts(missing, extra, wrong)})"


def signature_of(tensors: Mapping[str, torch.Tensor]) -> Signature:
    return tuple(
        (name, str(tensors[name].dtype).removeprefix("torch."), tuple(tensors[name].shape))
        for name in sorted(tensors)
    )


class Packet(NamedTuple):
    """One prepared send: a version, its manifest, and the source tensors in
    manifest order (not yet copied anywhere). Never changed once made
    (``_replace`` makes another); a named tuple, not a frozen dataclass,
    since a send makes two: a frozen dataclass's ``__init__`` costs 1.4 µs
    to a tuple's 0.3 µs."""

    version: int
    manifest: Manifest
    tensors: Sequence[torch.Tensor]
    #: How many workers this packet goes to; each may copy with
    #: ``usable_cores() // fanout`` threads without oversubscribing the host.
    fanout: int = 1
    #: A partial update: some of the model's tensors, the others untouched.
    partial: bool = False
    #: With ``verify``: one digest per tensor, in manifest order (see
    #: ``_digest``), which each worker checks before it applies the update.
    digests: tuple[int, ...] | None = None
    #: The devices the trainer's tensors are on (``_placement``).
    devices: tuple[str, ...] = ("cpu",)
    #: The caller's CUDA stream when the send was planned
    #: (``_placement.caller_stream``), for tensors on a GPU; else None.
    stream: Any = None
    #: Whether the next send reads these same tensors (the same list: a
    #: module's, read again), so that a staging may keep what it derived
    #: from them; else it lets go of them once staged (they are the
    #: caller's, made for this send).
    reused: bool = False

    def __repr__(self) -> str:
        # (Not the tensors: a model's worth of them.)
        return f"Packet(version={self.version}, layout={self.manifest.layout_id}, devices={self.devices})"

    # A packet is no value to compare (its tensors would be compared
    # element-wise): two sends of the same bytes are two packets.
    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def __hash__(self) -> int:
        return id(self)

    def staged(self, digests: tuple[int, ...] | None) -> Packet:
        """This packet once staged: with ``digests``, without the caller's
        tensors (each worker reads the staging now)."""
        return Packet(
            self.version, self.manifest, (), self.fanout, self.partial, digests, self.devices, self.stream
        )

    @property
    def subset(self) -> Signature | None:
        """What a worker needs to find a partial update's tensors (their
        names, dtypes and shapes); None for a whole model."""
        return self.manifest.signature if self.partial else None

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes


@dataclass(frozen=True)
class ChainReport:
    """How a send's chains carried it (the cross-host schemes: a
    torch.distributed chain, Ray's relay between nodes)."""

    #: Each chain formed (a repair forms more than one): its members in
    #: chain order (worker ranks; Ray's relay: node ids), and whom each
    #: host leader of it fed through shared memory (``{leader:
    #: (followers...)}``).
    routes: tuple[tuple[tuple[Any, ...], Mapping[Any, tuple[Any, ...]]], ...] = ()
    #: The bytes the trainer put on the chains (the encoded frames of a delta).
    wire_bytes: int = 0
    #: Per chain, as ``routes``: whether it carried a delta (``delta=True``).
    delta: tuple[bool, ...] = ()
    #: Per chain, as ``routes``: the bytes the trainer put on it.
    sent: tuple[int, ...] = ()
    #: ``delta=True``: why the send went as a delta or whole, and the rates
    #: weighed (``{"delta": bool, "why": str, "rates": {...}}``); empty
    #: otherwise.
    delta_choice: Mapping[str, Any] = field(default_factory=dict)

    def joined(self, other: ChainReport) -> ChainReport:
        """This and ``other`` (another staging's chains of one version) as one."""
        return ChainReport(
            self.routes + other.routes,
            self.wire_bytes + other.wire_bytes,
            self.delta + other.delta,
            self.sent + other.sent,
            self.delta_choice or other.delta_choice,
        )
