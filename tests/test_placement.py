"""How a send reaches a worker, from where the trainer's tensors and the
worker's model are (``_placement``): the choice over every pair of
devices, named as workers announce them. The announcements themselves are
checked over every scheme (tests/test_conformance.py) and on a GPU
(tests/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from weightsync import ResourceExhaustedError
from weightsync._memory._placement import Placement, choose, devices_of, route
from weightsync._memory._segment import Segment
from weightsync._memory._slab import AttachedSlabs, SlabRef

GPU_A = "cuda:GPU-0b42632a-bc5c-f731-724b-6936a19c4b24"
GPU_B = "cuda:GPU-5e9b0c41-0d8e-2a71-93c4-1f2e3d4c5b6a"


@pytest.mark.parametrize(
    "trainer, worker, expected",
    [
        (("cpu",), ("cpu",), Placement.HOST),
        (("cpu",), None, Placement.HOST),  # a worker that did not say: host memory
        ((GPU_A,), ("cpu",), Placement.DEVICE_TO_HOST),
        (("cpu",), (GPU_A,), Placement.HOST_TO_DEVICE),
        ((GPU_A,), (GPU_A,), Placement.SAME_DEVICE),
        ((GPU_A,), (GPU_B,), Placement.PEER),
        ((GPU_A, "cpu"), ("cpu",), Placement.MIXED),
        (("cpu",), ("cpu", GPU_A), Placement.MIXED),
        (("cpu",), ("mps",), Placement.MIXED),
        (("meta",), ("cpu",), Placement.MIXED),
    ],
)
def test_the_placement_of_every_pair_of_devices(
    trainer: tuple[str, ...], worker: tuple[str, ...] | None, expected: Placement
) -> None:
    assert choose(trainer, worker) is expected


@pytest.mark.parametrize(
    "trainer, worker, reach, device_staging, expected",
    [
        # Device to device where the staging can and the worker reaches the trainer's GPU.
        ((GPU_A,), (GPU_A,), (GPU_A,), True, Placement.SAME_DEVICE),
        ((GPU_A,), (GPU_B,), (GPU_A, GPU_B), True, Placement.PEER),
        # A worker without peer access to the trainer's GPU (or that cannot see it).
        ((GPU_A,), (GPU_B,), (GPU_B,), True, Placement.THROUGH_HOST),
        ((GPU_A,), (GPU_A,), (), True, Placement.THROUGH_HOST),
        # A verified send, or a scheme that stages in host memory.
        ((GPU_A,), (GPU_A,), (GPU_A,), False, Placement.THROUGH_HOST),
        ((GPU_A,), (GPU_B,), (GPU_A, GPU_B), False, Placement.THROUGH_HOST),
        # Host memory on either side is as the plain choice says.
        ((GPU_A,), ("cpu",), (), True, Placement.DEVICE_TO_HOST),
        (("cpu",), (GPU_A,), (GPU_A,), True, Placement.HOST_TO_DEVICE),
        (("cpu",), ("cpu",), (), False, Placement.HOST),
        ((GPU_A, "cpu"), ("cpu",), (), True, Placement.MIXED),
    ],
)
def test_a_send_routes_each_worker_once_by_what_its_staging_and_the_worker_can_do(
    trainer: tuple[str, ...],
    worker: tuple[str, ...],
    reach: tuple[str, ...],
    device_staging: bool,
    expected: Placement,
) -> None:
    """``route`` is the one decision of how a send reaches a worker: the
    staging follows it and the report says it (``SendReport.placements``)."""
    assert route(trainer, worker, reach, device_staging=device_staging) is expected
    assert expected.on_device is (expected in (Placement.SAME_DEVICE, Placement.PEER))


def test_devices_are_named_once_each_in_the_order_met() -> None:
    tensors = [torch.zeros(2), torch.zeros(3, device="meta"), torch.ones(1)]
    assert devices_of(tensors) == ("cpu", "meta")
    assert devices_of([]) == ()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible")
def test_a_gpu_is_named_by_its_uuid_not_its_index() -> None:
    name = devices_of([torch.zeros(1, device="cuda:0")])[0]
    assert name.startswith("cuda:GPU-") and name != "cuda:0"
    assert choose((name,), (name,)) is Placement.SAME_DEVICE


def test_a_slab_on_a_gpu_this_process_cannot_see_is_refused_with_its_name() -> None:
    """A worker that cannot see the trainer's GPU (another
    CUDA_VISIBLE_DEVICES) refuses the update with a reason that names the
    GPU, before it opens anything: the sender reports it for that worker,
    the model untouched."""
    header = Segment.create(0)
    try:
        ref = SlabRef(header.ref(), "cuda:GPU-00000000-0000-0000-0000-000000000000", b"", 1, b"t" * 16)
        slabs = AttachedSlabs()
        with pytest.raises(ResourceExhaustedError, match="GPU-00000000-0000-0000-0000-000000000000"):
            slabs.published(ref)
        slabs.close()
    finally:
        header.close()
