"""A chain worker's receive buffers: what it derives from a buffer to apply
an update (the layout's views over it, the copy plan into the model) is
made once per buffer, layout and model, and made again where any of them
changes; every update still lands bit for bit."""

from __future__ import annotations

import torch

from weightsync._packet import Manifest
from weightsync._transports._distributed._host_share import ReceiveBuffers
from weightsync._transports._distributed._relay import ChainUpdate


def _model() -> dict[str, torch.Tensor]:
    return {
        "a": torch.zeros(3, 5),
        "b": torch.zeros(7, dtype=torch.float64),
        "c": torch.zeros(2, dtype=torch.int32),
    }


def _arrive(
    buffers: ReceiveBuffers, slot: int, version: int, manifest: Manifest, src: list[torch.Tensor]
) -> ChainUpdate:
    """Version ``version`` of ``src`` received into buffer ``slot``, as the relay leaves it."""
    buffer, _ = buffers.get(slot, manifest.nbytes, False)
    view = buffer[: manifest.nbytes]
    for dst, tensor in zip(manifest.views(view), src, strict=True):
        dst.copy_(tensor)
    return ChainUpdate(version, manifest.layout_id, None, None, 1, view, slot, buffers.reads[slot])


def test_an_update_from_a_receive_buffer_reuses_its_views_and_plan_and_lands_exactly() -> None:
    model = _model()
    manifest = Manifest.of(model)
    targets = manifest.ordered(model)
    buffers = ReceiveBuffers()
    try:
        seen = []
        for version in range(1, 7):
            slot = version % 2
            src = [torch.full_like(t, version * 10 + i) for i, t in enumerate(targets)]
            update = _arrive(buffers, slot, version, manifest, src)
            update.apply(None, targets, manifest)
            assert all(torch.equal(t, s) for t, s in zip(targets, src, strict=True)), version
            seen.append(
                (slot, update.sources(manifest), update.reads.plan(targets, update.sources(manifest)))
            )
        # One list of views and one plan per buffer, every update after the first alike.
        for slot in (0, 1):
            mine = [(views, plan) for s, views, plan in seen if s == slot]
            assert all(views is mine[0][0] and plan is mine[0][1] for views, plan in mine)
        assert seen[0][1] is not seen[1][1]

        # A target re-pointed to other memory of its shape: the plan is made
        # again, and the update lands in the new memory.
        targets[0].data = torch.zeros(3, 5)
        src = [torch.full_like(t, -1 - i) for i, t in enumerate(targets)]
        update = _arrive(buffers, 1, 7, manifest, src)
        update.apply(None, targets, manifest)
        assert (
            torch.equal(targets[0], src[0])
            and update.reads.plan(targets, update.sources(manifest)) is not seen[-1][2]
        )

        # A buffer grown for a larger layout: what was made for the old one is let go.
        before = buffers.reads[0]
        bigger = dict(model, d=torch.zeros(1000))
        bigger_manifest = Manifest.of(bigger)
        bigger_targets = bigger_manifest.ordered(bigger)
        src = [torch.full_like(t, 5 + i) for i, t in enumerate(bigger_targets)]
        update = _arrive(buffers, 0, 8, bigger_manifest, src)
        assert buffers.reads[0] is not before and update.reads is buffers.reads[0]
        update.apply(None, bigger_targets, bigger_manifest)
        assert all(torch.equal(t, s) for t, s in zip(bigger_targets, src, strict=True))
    finally:
        buffers.close()
