"""The parts of a sharded trainer's send: which piece of which tensor each
trainer rank sends, what of it each worker takes, and how a worker puts
the pieces together.

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

A worker holds each tensor whole, or its own box of it (a tensor-parallel
worker's local shard, :class:`Want`). Workers that hold the same boxes
form a *class*; rank r sends each class its :func:`sub_part`, each piece
cut to the class's box, over a chain of its own: a worker takes in only
the bytes it holds.

Pure functions of the tensors' layouts: every rank computes the same parts
with no message, and so does the test, with no process at all.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._copy import copy_tensors
from ._exceptions import InvalidWeightsError
from ._packet import Manifest, Signature
from ._plan import Box, TensorLayout, intersect, layout_of
from ._strategy import is_dtensor

__all__ = [
    "Part",
    "Piece",
    "Want",
    "classes_of",
    "local_tensors",
    "part_signature",
    "parts_of",
    "pieces_misfit",
    "place",
    "sub_part",
    "want_of",
    "whole_part",
]


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


@dataclass(frozen=True)
class Part:
    """What trainer rank ``rank`` sends: its pieces, by name (at most one
    piece of a tensor per rank)."""

    rank: int
    pieces: tuple[Piece, ...]


#: What a worker holds of each tensor it takes, by name: its box of the
#: global tensor (a tensor-parallel worker's local shard), or the whole.
Boxes = tuple[tuple[str, Box], ...]


@dataclass(frozen=True)
class Want:
    """What a worker takes of a sender group's sends, as it says at init:
    its model's global layout (``signature``: names, dtypes, global shapes),
    the box it holds of each tensor (``boxes``; None: every tensor whole),
    and the workers that switch versions together with it (``members``,
    worker ranks, itself among them: the ranks of its tensor-parallel
    group; ``(rank,)`` alone); ``host``: where it runs (its address towards
    the trainer's store, and its host name; None: not said), which tells
    whether it can map memory of the trainer's ranks."""

    signature: Signature
    boxes: Boxes | None
    members: tuple[int, ...]
    host: tuple[str, str] | None = None

    @functools.cached_property
    def _by_name(self) -> dict[str, Box]:
        return dict(self.boxes or ())

    def box(self, name: str, shape: tuple[int, ...]) -> Box:
        """The box of tensor ``name`` (of global ``shape``) this worker holds."""
        held = self._by_name.get(name)
        return tuple((0, n) for n in shape) if held is None else held


def want_of(tensors: Mapping[str, Any], members: tuple[int, ...], index: int) -> Want:
    """The :class:`Want` of a worker whose model holds ``tensors`` (DTensors
    over its group's mesh, where ``index`` is its place in the mesh, and
    plain tensors, which it holds whole), in a group of ``members``.

    :raises InvalidWeightsError: a DTensor placed ``Partial``.
    """
    signature: list[tuple[str, str, tuple[int, ...]]] = []
    boxes: list[tuple[str, Box]] = []
    for name, tensor in tensors.items():
        shape = tuple(int(n) for n in tensor.shape)
        signature.append((name, str(tensor.dtype).removeprefix("torch."), shape))
        if is_dtensor(tensor):
            try:
                boxes.append((name, layout_of(tensor).box(index)))
            except ValueError as exc:
                raise InvalidWeightsError(f"weight {name!r}: {exc}") from exc
    return Want(tuple(sorted(signature)), tuple(sorted(boxes)) or None, members)


def classes_of(wants: Mapping[int, Want]) -> tuple[tuple[Boxes | None, tuple[int, ...]], ...]:
    """The workers (by rank) that take the same bytes, by the boxes they
    hold: one class of each, in the order of their first worker. Each
    class is one chain per trainer rank."""
    classes: dict[Boxes | None, list[int]] = {}
    for rank in sorted(wants):
        classes.setdefault(wants[rank].boxes, []).append(rank)
    return tuple((boxes, tuple(ranks)) for boxes, ranks in classes.items())


def sub_part(part: Part, want: Want) -> Part:
    """What of ``part`` a worker that wants ``want`` takes: each piece cut
    to the box the worker holds (pieces it holds nothing of left out)."""
    pieces = []
    for piece in part.pieces:
        cut = intersect(piece.box, want.box(piece.name, piece.shape))
        if cut is not None:
            pieces.append(Piece(piece.name, piece.shape, piece.dtype, cut))
    return Part(part.rank, tuple(pieces))


def whole_part(parts: Sequence[Part], want: Want) -> Part | None:
    """What a class of workers (``want``) takes of all ``parts`` together,
    as one part of rank 0: each tensor it takes anything of, as the box it
    holds (the pieces of every rank, cut to that box, fill it). What a
    sender group's ranks on one host write into one buffer and rank 0
    sends from there. None where the cut pieces do not fill the boxes
    exactly (then each rank sends its own)."""
    pieces: dict[str, Piece] = {}
    filled: dict[str, int] = {}
    for part in parts:
        for piece in sub_part(part, want).pieces:
            box = want.box(piece.name, piece.shape)
            pieces[piece.name] = Piece(piece.name, piece.shape, piece.dtype, box)
            filled[piece.name] = filled.get(piece.name, 0) + math.prod(piece.local_shape)
    if any(filled[name] != math.prod(piece.local_shape) for name, piece in pieces.items()):
        return None
    return Part(0, tuple(pieces[name] for name in sorted(pieces)))


def _within(box: Box, origin: Box) -> tuple[slice, ...]:
    """``box`` as slices of a tensor that holds ``origin`` of the same global tensor."""
    return tuple(slice(lo - start, hi - start) for (lo, hi), (start, _) in zip(box, origin, strict=True))


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


def local_tensors(tensors: Mapping[str, Any], part: Part, sub: Part | None = None) -> dict[str, torch.Tensor]:
    """The tensors this rank sends as ``part`` (or as ``sub``, a
    :func:`sub_part` of it): each piece's local shard (a DTensor's
    ``to_local()``, never its global view) or whole tensor, cut to the
    sub-part's box (a view: no copy)."""
    out: dict[str, torch.Tensor] = {}
    held = {piece.name: piece.box for piece in part.pieces}
    for piece in part.pieces if sub is None else sub.pieces:
        value = tensors[piece.name]
        local = (value.to_local() if is_dtensor(value) else value).detach()
        box = held[piece.name]
        out[piece.name] = local if piece.box == box else local[_within(piece.box, box)]
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


def place(
    targets: Mapping[str, torch.Tensor],
    parts: Sequence[tuple[Part, Sequence[torch.Tensor]]],
    want: Want | None = None,
    *,
    threads: int = 1,
) -> None:
    """Write each part's pieces (its ``sources``, in its manifest's order,
    which is its pieces' order) into their boxes of ``targets`` (by name:
    whole tensors, or the boxes ``want`` says the worker holds), all parts
    in one copy on up to ``threads`` threads: byte copies where a box is
    contiguous, as a whole update's copy is (never torch's intra-op pool,
    whose cores belong to the worker's own work)."""
    boxes: list[torch.Tensor] = []
    froms: list[torch.Tensor] = []
    for part, sources in parts:
        for piece, source in zip(part.pieces, sources, strict=True):
            target = targets[piece.name]
            origin = tuple((0, n) for n in piece.shape) if want is None else want.box(piece.name, piece.shape)
            boxes.append(target if piece.box == origin else target[_within(piece.box, origin)])
            froms.append(source)
    copy_tensors(boxes, froms, threads=threads)
