"""Page-locked staging: a staging segment that a GPU copies to or from is
registered with CUDA once (``Segment.pin``), read-only where the process
maps it read-only, and let go at ``close()``. Without CUDA it stays pageable
and nothing else changes.

The cross-host schemes' host buffers likewise (``_pinned.PageLocks``): the
torch.distributed trainer's staging buffer, which takes turns with the
delta base, and a worker's receive buffers. Without a GPU their bookkeeping
runs against a stand-in for CUDA's registrations (:class:`FakeRegistry`),
which refuses, as CUDA does, a range whose pages are registered already.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import weightsync._memory._pinned as pinned
import weightsync._memory._segment as segment_module
import weightsync._transports._distributed._transport as distributed
from weightsync._memory._pinned import PageLocks, copy_to_host, host_buffer
from weightsync._memory._segment import Segment
from weightsync._packet import Manifest, Packet
from weightsync._transports._chain._pipeline import send_chain
from weightsync._transports._distributed._host_share import ReceiveBuffers

HAS_CUDA = torch.cuda.is_available()
PAGE = os.sysconf("SC_PAGE_SIZE")


class FakeRegistry:
    """CUDA's page-locked registrations, as far as weightsync relies on
    them: a range is registered by whole pages, a second registration of
    any of its pages fails, and a range is let go by its first address."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}  # first address -> bytes
        self.registered: list[int] = []  # every registration, in order

    @staticmethod
    def _pages(ptr: int, size: int) -> range:
        return range(ptr // PAGE, (ptr + max(size, 1) - 1) // PAGE + 1)

    def register(self, ptr: int, size: int, *, read_only: bool = False, what: str = "") -> bool:
        pages = set(self._pages(ptr, size))
        for held, nbytes in self.held.items():
            assert not pages & set(self._pages(held, nbytes)), f"{what}: pages registered twice"
        self.held[ptr] = size
        self.registered.append(ptr)
        return True

    def unregister(self, ptr: int) -> None:
        assert ptr in self.held, "let go of a range that is not registered"
        del self.held[ptr]


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> FakeRegistry:
    fake = FakeRegistry()
    for module in (pinned, segment_module):
        monkeypatch.setattr(module, "register", fake.register)
        monkeypatch.setattr(module, "unregister", fake.unregister)
    return fake


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


def test_without_cuda_host_buffers_stay_pageable() -> None:
    if HAS_CUDA:
        pytest.skip("a CUDA device is visible")
    locks = PageLocks()
    buffer = host_buffer(1 << 16)
    assert locks.lock(buffer) is False and locks.lock(buffer) is False
    buffer.fill_(5)
    assert int(buffer.sum()) == 5 << 16
    locks.release()
    assert len(locks) == 0


def test_host_buffers_are_registered_once_and_let_go(registry: FakeRegistry) -> None:
    locks = PageLocks()
    a, b = host_buffer(3 * PAGE + 5), host_buffer(100)
    assert a.data_ptr() % PAGE == 0 and b.data_ptr() % PAGE == 0  # pages of their own
    # Any view of a memory, a numpy array over it included, is the same memory.
    assert locks.lock(a) and locks.lock(a[PAGE:]) and locks.lock(b)
    assert locks.lock(torch.from_numpy(a.numpy()))
    assert registry.registered == [a.data_ptr(), b.data_ptr()]
    locks.keep_only(None, a[7:].numpy())
    assert list(registry.held) == [a.data_ptr()]
    locks.release()
    assert registry.held == {} and len(locks) == 0


def test_each_frame_of_the_chain_leaves_once_its_bytes_are_in() -> None:
    """The chain's sender asks for each frame's bytes (the end of the frame,
    over the concatenation of its sources) before it sends the frame."""
    said: list[tuple[str, int]] = []

    class Work:
        def wait(self, timeout: Any) -> None:
            pass

    class Group:
        def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
            said.append(("sent", tensors[0].numel()))
            return Work()

    sources = [torch.zeros(2500, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)]
    send_chain(Group(), sources, 1000, 1, 1.0, ready=lambda n: said.append(("in", n)))
    assert said == [
        ("in", 1000), ("sent", 1000), ("in", 2000), ("sent", 1000),
        ("in", 3000), ("sent", 1000), ("in", 3500), ("sent", 500),
    ]  # fmt: skip


def test_copies_to_the_host_are_marked_chunk_by_chunk() -> None:
    """copy_to_host cuts a send's bytes into chunks (across tensors), each
    marked by the buffer's leading bytes it completes; tensors in host
    memory are copied at once (on a GPU, each chunk's mark is an event)."""
    tensors = {
        "a": torch.randn(1000),
        "b": torch.randn(30, 20).t(),  # strided
        "c": torch.arange(7),
        "d": torch.empty(0),
    }
    manifest = Manifest.of(tensors)
    views = manifest.views(host_buffer(manifest.nbytes))
    packet = Packet(1, manifest, manifest.ordered(tensors))
    copies = copy_to_host(views, packet, chunk=1024)
    ends = [end for end, _ in copies._marks]
    total = sum(t.numel() * t.element_size() for t in packet.tensors)
    assert len(ends) == -(-total // 1024) and ends == sorted(ends)
    assert ends[-1] == max(spec.offset + spec.nbytes for spec in manifest.specs if spec.nbytes)
    assert copies.wait_for(1) and copies.wait_for(1 << 40)
    copies.wait()
    for view, tensor in zip(views, packet.tensors, strict=True):
        assert torch.equal(view, tensor)


def test_a_workers_receive_buffers_for_a_gpu_model_are_registered_once(registry: FakeRegistry) -> None:
    buffers = ReceiveBuffers()
    buffers.pin = True
    try:
        first, _ = buffers.get(0, 10_000, False)
        again, _ = buffers.get(0, 8_000, False)
        assert again.data_ptr() == first.data_ptr() and registry.registered == [first.data_ptr()]
        _, shared = buffers.get(1, 10_000, True)  # a host leader's: its segment, registered itself
        assert shared is not None and len(registry.held) == 2
        grown, _ = buffers.get(0, 20_000, False)  # the smaller one is let go
        assert grown.data_ptr() in registry.held and first.data_ptr() not in registry.held
        assert len(registry.held) == 2
    finally:
        buffers.close()
    assert registry.held == {}


def test_a_workers_receive_buffers_for_a_cpu_model_are_not_registered(registry: FakeRegistry) -> None:
    buffers = ReceiveBuffers()
    buffers.get(0, 10_000, False)
    buffers.get(1, 10_000, True)
    buffers.close()
    assert registry.registered == []


@pytest.mark.extended
def test_a_gpu_trainers_staging_buffers_are_registered_once_across_delta_sends(
    registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.distributed with delta=True: the staging buffer and the delta
    base take turns, each registered once for as long as it is used, and
    both let go at shutdown; every worker gets the weights bit for bit. (The
    trainer's tensors are taken as on a GPU: its copies into the buffer go
    the GPU's way, but in host memory.)"""
    pytest.importorskip("blosc2")
    from test_delta_distributed import delta_workers, exact, nudge

    monkeypatch.setattr(distributed, "pins", lambda devices: True)
    monkeypatch.setattr(pinned, "pins", lambda devices: True)
    with delta_workers(2) as w:
        w.scheme.connect()
        for step in range(4):
            nudge(w, seed=step)
            report = w.scheme.send()
            assert w.scheme.last_delta == [True]
            exact(w, report.version, range(2))
            # The buffer staged into and the base: never more, each registered once.
            assert len(registry.held) <= 2
        assert len(registry.registered) == 2, "a buffer was registered again"
        w.scheme.shutdown()
        assert registry.held == {}
