"""A sender group's parts (``weightsync._shards``), with no process: which
rank sends which piece, a worker's check of its model against the parts,
and the placing of pieces into whole tensors. (DTensors themselves, with
real ranks: tests/test_sender_group.py.)"""

from __future__ import annotations

import torch

from weightsync._packet import Manifest
from weightsync._shards import (
    Part,
    Piece,
    Want,
    classes_of,
    local_tensors,
    part_signature,
    parts_of,
    pieces_misfit,
    place,
    sub_part,
    whole_part,
)


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
    place(target, [(part, [torch.ones(4, 2)])])
    assert torch.equal(target["w"][:, 0], torch.zeros(4)) and torch.equal(
        target["w"][:, 1:], torch.ones(4, 2)
    )


def test_a_tensor_parallel_worker_takes_only_the_box_it_holds() -> None:
    # Rank 0 of the trainer holds rows 0..3 of an 8 x 4 weight; a worker
    # holds columns 2..4 (a column-sharded tensor-parallel rank) and the
    # bias whole.
    part = Part(0, (Piece("b", (4,), "float32", ((0, 4),)), Piece("w", (8, 4), "float32", ((0, 4), (0, 4)))))
    want = Want((("b", "float32", (4,)), ("w", "float32", (8, 4))), (("w", ((0, 8), (2, 4))),), (1, 2))
    sub = sub_part(part, want)
    assert [(p.name, p.box) for p in sub.pieces] == [("b", ((0, 4),)), ("w", ((0, 4), (2, 4)))]
    assert dict((n, s) for n, _, s in part_signature(sub)) == {"b": (4,), "w": (4, 2)}
    # The trainer sends a view of its local shard's columns 2..4 ...
    local = torch.arange(16.0).reshape(4, 4)
    sent = local_tensors({"b": torch.ones(4), "w": local}, part, sub)
    assert torch.equal(sent["w"], local[:, 2:4]) and sent["w"].data_ptr() == local[:, 2:].data_ptr()
    # ... which the worker writes into rows 0..3 of its 8 x 2 local shard.
    targets = {"b": torch.zeros(4), "w": torch.zeros(8, 2)}
    place(targets, [(sub, [sent["b"], sent["w"].contiguous()])], want)
    assert torch.equal(targets["w"][:4], local[:, 2:4]) and torch.equal(targets["w"][4:], torch.zeros(4, 2))
    assert torch.equal(targets["b"], torch.ones(4))
    # A worker holding rows 4..8 takes nothing of this rank's weight.
    other = Want(want.signature, (("w", ((4, 8), (0, 4))),), (3,))
    assert [p.name for p in sub_part(part, other).pieces] == ["b"]


def test_workers_holding_the_same_boxes_are_one_class() -> None:
    sig = (("w", "float32", (8, 4)),)
    left, right = (("w", ((0, 8), (0, 2))),), (("w", ((0, 8), (2, 4))),)
    wants = {
        1: Want(sig, left, (1, 2)),
        2: Want(sig, right, (1, 2)),
        3: Want(sig, left, (3, 4)),
        4: Want(sig, right, (3, 4)),
        5: Want(sig, None, (5,)),
    }
    assert classes_of(wants) == ((left, (1, 3)), (right, (2, 4)), (None, (5,)))


def test_a_class_takes_every_ranks_pieces_as_one_part_of_the_boxes_it_holds() -> None:
    # Two ranks' rows of an uneven 5 x 4 weight, and a bias rank 1 sends whole.
    parts = (
        Part(0, (Piece("w", (5, 4), "float32", ((0, 3), (0, 4))),)),
        Part(1, (Piece("b", (4,), "float32", ((0, 4),)), Piece("w", (5, 4), "float32", ((3, 5), (0, 4))))),
    )
    sig = (("b", "float32", (4,)), ("w", "float32", (5, 4)))
    whole = whole_part(parts, Want(sig, None, (1,)))
    assert whole == Part(
        0, (Piece("b", (4,), "float32", ((0, 4),)), Piece("w", (5, 4), "float32", ((0, 5), (0, 4))))
    )
    # A tensor-parallel member's: its columns of the weight, the bias whole.
    member = Want(sig, (("w", ((0, 5), (2, 4))),), (1, 2))
    taken = whole_part(parts, member)
    assert taken is not None and [(p.name, p.local_shape) for p in taken.pieces] == [
        ("b", (4,)),
        ("w", (5, 2)),
    ]
    # Every rank writes its pieces into the one buffer's boxes: rows of both
    # ranks fill the member's columns.
    views = {"b": torch.zeros(4), "w": torch.zeros(5, 2)}
    w = torch.arange(20.0).reshape(5, 4)
    for part, local in ((parts[0], {"w": w[:3]}), (parts[1], {"b": torch.ones(4), "w": w[3:]})):
        sub = sub_part(part, member)
        place(views, [(sub, list(local_tensors(local, part, sub).values()))], member)
    assert torch.equal(views["w"], w[:, 2:]) and torch.equal(views["b"], torch.ones(4))
    # Pieces that leave a box short (rank 0's rows missing) make no whole part.
    assert whole_part(parts[1:], Want(sig, None, (1,))) is None
