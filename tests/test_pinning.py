"""Page-locked staging: a staging segment that a GPU copies to or from is
registered with CUDA once (``Segment.pin``), read-only where the process
maps it read-only, and let go at ``close()``. Without CUDA it stays pageable
and nothing else changes."""

from __future__ import annotations

import os

import pytest
import torch

from weightsync._packet import Manifest
from weightsync._segment import Segment

HAS_CUDA = torch.cuda.is_available()


def test_without_cuda_a_segment_stays_pageable_and_works() -> None:
    if HAS_CUDA:
        pytest.skip("a CUDA device is visible: the pinned case is tested below")
    segment = Segment.create(1 << 16)
    try:
        assert segment.pin() is False
        assert segment.pin() is False  # tried once, answered the same
        assert segment.data is not None
        segment.data.fill_(7)
        reader = Segment.attach(os.getpid(), segment.fd, segment.nbytes, segment.token)
        assert reader.pin() is False
        assert reader.data is not None and bool((reader.data == 7).all())
        reader.close()
    finally:
        segment.close()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device; none is visible")
def test_a_segment_is_page_locked_once_and_copies_exactly_both_ways() -> None:
    source = torch.randn(1 << 18, device="cuda")
    manifest = Manifest.of({"w": source})
    segment = Segment.create(manifest.nbytes)
    reader = Segment.attach(os.getpid(), segment.fd, segment.nbytes, segment.token)
    try:
        assert segment.pin() is True and segment.pin() is True  # registered once
        assert segment.data is not None and reader.data is not None
        (staged,) = manifest.views(segment.data)
        staged.copy_(source)  # device to host, into page-locked memory
        assert torch.equal(staged, source.cpu())
        # The reader's read-only mapping is registered read-only where the
        # device supports it; either way the copy to the device is exact.
        reader.pin()
        (view,) = manifest.views(reader.data)
        target = torch.empty_like(source)
        target.copy_(view)
        assert torch.equal(target, source)
    finally:
        reader.close()
        segment.close()
    torch.cuda.synchronize()  # no error left behind by the registrations
