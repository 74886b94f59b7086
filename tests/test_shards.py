"""A sender group's parts (``weightsync._shards``), with no process: which
rank sends which piece, a worker's check of its model against the parts,
and the placing of pieces into whole tensors. (DTensors themselves, with
real ranks: tests/test_sender_group.py.)"""

from __future__ import annotations

import torch

from weightsync._packet import Manifest
from weightsync._shards import Part, Piece, part_signature, parts_of, pieces_misfit, place


def test_whole_tensors_are_each_sent_once_by_the_least_loaded_rank() -> None:
    tensors = {"a": torch.zeros(100), "b": torch.zeros(60), "c": torch.zeros(50), "d": torch.zeros(10)}
    parts = parts_of(tensors, 2)
    sent = sorted(p.name for part in parts for p in part.pieces)
    assert sent == ["a", "b", "c", "d"]
    loads = [sum(p.local_shape[0] for p in part.pieces) for part in parts]
    # Biggest first, each to the lighter rank: 100 | 60 + 50, then 10 to the first.
    assert loads == [110, 110]
    assert all(p.whole for part in parts for p in part.pieces)


def test_a_part_signature_is_its_pieces_local_shapes() -> None:
    part = Part(0, (Piece("w", (5, 3), "float32", ((0, 3), (0, 3))), Piece("b", (5,), "float32", ((3, 5),))))
    assert dict((n, s) for n, _, s in part_signature(part)) == {"w": (3, 3), "b": (2,)}


def test_a_model_that_does_not_fit_the_parts_is_told_why() -> None:
    parts = (
        Part(0, (Piece("w", (4, 2), "float32", ((0, 2), (0, 2))),)),
        Part(1, (Piece("w", (4, 2), "float32", ((2, 4), (0, 2))),)),
    )
    fits = Manifest.of({"w": torch.zeros(4, 2)})
    assert pieces_misfit(fits, parts) is None
    wrong = pieces_misfit(Manifest.of({"w": torch.zeros(5, 2), "extra": torch.zeros(1)}), parts)
    assert wrong is not None
    assert "'w' is (5, 2) float32, the trainer's (4, 2) float32" in wrong
    assert "the trainer sends no 'extra'" in wrong


def test_pieces_are_written_into_their_boxes() -> None:
    part = Part(1, (Piece("w", (4, 3), "float32", ((0, 4), (1, 3))),))
    target = {"w": torch.zeros(4, 3)}
    place(target, part, [torch.ones(4, 2)])
    assert torch.equal(target["w"][:, 0], torch.zeros(4)) and torch.equal(
        target["w"][:, 1:], torch.ones(4, 2)
    )
