"""The parts of a sharded trainer's send: which piece of which tensor each
trainer rank sends, and how a worker that holds whole tensors puts the
pieces together.

Every rank of a sharded trainer (FSDP2's ``fully_shard``, tensor
parallelism: DTensors) holds one box of each sharded tensor, and every
rank holds the tensors that are not sharded. Each piece is sent once, by
one rank: a DTensor's box by the rank that holds it (by the least loaded
of the ranks that hold the same box, for a replicated placement), a whole
tensor by the least loaded rank. Rank r's *part* is the list of the
pieces it sends, each named as the global tensor: its own send (its own
version counter kept in step, its own chain, its own digests) carries
exactly those, as a model of its own. A worker puts every part of one
version in place, each piece into its box of the model's tensor, once
all parts of that version are in.

Pure functions of the tensors' layouts: every rank computes the same parts
with no message, and so does the test, with no process at all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._exceptions import InvalidWeightsError
from ._packet import Manifest, Signature
from ._plan import Box, TensorLayout, layout_of
from ._strategy import is_dtensor

__all__ = ["Part", "Piece", "local_tensors", "part_signature", "parts_of", "pieces_misfit", "place"]


@dataclass(frozen=True)
class Piece:
    """One piece of a part: ``box`` of the global tensor ``name`` (of
    ``shape`` and ``dtype``, a dtype's name as manifests write it)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    box: Box

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)

    @property
    def whole(self) -> bool:
        return self.local_shape == self.shape

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, stop) for start, stop in self.box)


@dataclass(frozen=True)
class Part:
    """What trainer rank ``rank`` sends: its pieces, by name (at most one
    piece of a tensor per rank)."""

    rank: int
    pieces: tuple[Piece, ...]


def _mesh_ranks(tensor: Any) -> list[int]:
    mesh = tensor.device_mesh
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def parts_of(tensors: Mapping[str, Any], ranks: int, *, model_id: str | None = None) -> tuple[Part, ...]:
    """The parts of ``ranks`` trainer ranks sending ``tensors`` (a state
    dict as each rank holds it: DTensors and plain tensors), one per rank.
    Every DTensor's mesh must be the trainer's ranks 0..ranks-1 in order.

    :raises InvalidWeightsError: a DTensor over other ranks, or placed
        ``Partial`` (a sum not reduced yet).
    """
    load = [0] * ranks
    pieces: list[list[Piece]] = [[] for _ in range(ranks)]

    # Big tensors first: the balance of whole tensors over the ranks is
    # then within one small tensor's bytes.
    def size(name: str) -> int:
        t = tensors[name]
        return math.prod(t.shape) * t.element_size()

    for name in sorted(tensors, key=lambda n: (-size(n), n)):
        tensor = tensors[name]
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = tuple(int(n) for n in tensor.shape)
        try:
            layout = layout_of(tensor) if is_dtensor(tensor) else TensorLayout(shape, tensor.element_size())
        except ValueError as exc:
            raise InvalidWeightsError(f"weight {name!r}: {exc}", model_id=model_id) from exc
        if layout.mesh and _mesh_ranks(tensor) != list(range(ranks)):
            raise InvalidWeightsError(
                f"weight {name!r} is sharded over ranks {_mesh_ranks(tensor)} of the trainer's group; a "
                f"sender group of {ranks} ranks sends DTensors over a mesh of its ranks 0..{ranks - 1}, "
                "in order",
                model_id=model_id,
            )
        holders: dict[Box, list[int]] = {}
        for rank in range(ranks):
            box = layout.box(rank) if layout.mesh else tuple((0, n) for n in shape)
            if math.prod(stop - start for start, stop in box) == 0 and math.prod(shape) != 0:
                continue  # (an empty shard: nothing to send)
            holders.setdefault(box, []).append(rank)
        for box, who in holders.items():
            rank = min(who, key=lambda r: (load[r], r))
            pieces[rank].append(Piece(name, shape, dtype, box))
            load[rank] += math.prod(stop - start for start, stop in box) * layout.itemsize
    return tuple(Part(r, tuple(sorted(p, key=lambda piece: piece.name))) for r, p in enumerate(pieces))


def local_tensors(tensors: Mapping[str, Any], part: Part) -> dict[str, torch.Tensor]:
    """The tensors this rank sends as ``part``: each piece's local shard (a
    DTensor's ``to_local()``, never its global view) or whole tensor."""
    out: dict[str, torch.Tensor] = {}
    for piece in part.pieces:
        value = tensors[piece.name]
        local = value.to_local() if is_dtensor(value) else value
        out[piece.name] = local.detach()
    return out


def part_signature(part: Part) -> Signature:
    """The layout of ``part``'s send, as a manifest writes it (the local
    shapes): what the trainer rank checks a worker's hello against."""
    return tuple(sorted((p.name, p.dtype, p.local_shape) for p in part.pieces))


def pieces_misfit(manifest: Manifest, parts: Sequence[Part]) -> str | None:
    """Why a worker's model (``manifest``: whole tensors) cannot take the
    parts (a tensor missing, of another shape or dtype, or not sent at
    all); None when it can."""
    mine = {spec.name: spec for spec in manifest.specs}
    sent: dict[str, int] = {}
    wrong: list[str] = []
    for part in parts:
        for p in part.pieces:
            spec = mine.get(p.name)
            if spec is None:
                wrong.append(f"{p.name!r} is not in it")
            elif tuple(spec.shape) != p.shape or str(spec.dtype).removeprefix("torch.") != p.dtype:
                wrong.append(
                    f"{p.name!r} is {tuple(spec.shape)} {str(spec.dtype).removeprefix('torch.')}, "
                    f"the trainer's {p.shape} {p.dtype}"
                )
            sent[p.name] = sent.get(p.name, 0) + math.prod(p.local_shape)
    unsent = [name for name, spec in mine.items() if name not in sent]
    if unsent:
        wrong.append(f"the trainer sends no {', '.join(repr(n) for n in unsent[:5])}")
    if not wrong:
        return None
    shown = "; ".join(sorted(set(wrong))[:5])
    return f"this worker's model does not fit the trainer's sharded weights: {shown}"


def place(targets: Mapping[str, torch.Tensor], part: Part, sources: Sequence[torch.Tensor]) -> None:
    """Write ``part``'s pieces (``sources``, in its manifest's order, which
    is its pieces' order) into their boxes of ``targets`` (whole tensors by name)."""
    for piece, source in zip(part.pieces, sources, strict=True):
        target = targets[piece.name]
        if piece.whole:
            target.copy_(source)
        else:
            target[piece.slices()].copy_(source)
