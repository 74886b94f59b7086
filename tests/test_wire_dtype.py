"""``wire_dtype=torch.bfloat16``: float32 weights travel and land cast, and each
worker holds, bit for bit, ``trainer_tensor.to(torch.bfloat16)``."""

from __future__ import annotations

import copy
from multiprocessing.connection import Connection

import pytest
import torch
from harness import reap, start_pipe_worker
from torch import nn

import weightsync as ws
from weightsync._copy import WireCast


def _trainer_model() -> nn.Module:
    torch.manual_seed(3)
    # A BatchNorm brings an int64 buffer (num_batches_tracked): it travels as it is.
    return nn.Sequential(nn.Linear(300, 200), nn.BatchNorm1d(200), nn.Linear(200, 7))


def _worker_model() -> nn.Module:
    torch.manual_seed(4)
    return _trainer_model().to(torch.bfloat16)


def _bits(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor's raw bits (numpy has no bfloat16)."""
    out = {}
    for name, t in state.items():
        t = t.detach().contiguous()
        out[name] = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return out


def test_the_cast_is_torchs_bit_for_bit() -> None:
    special = torch.tensor(
        [0.0, -0.0, 1.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4e38, 1.00390625, 1.01171875]
    )
    values = torch.cat([special, torch.randn(100_003) * 1e3, torch.randn(70_000) * 1e-30])
    strided = torch.randn(64, 512).t()  # not contiguous
    out = WireCast(torch.bfloat16).cast([values, torch.arange(5), strided], threads=2)
    assert out[0].dtype == torch.bfloat16
    assert torch.equal(out[0].view(torch.int16), values.to(torch.bfloat16).view(torch.int16))
    assert out[1].dtype == torch.int64 and torch.equal(out[1], torch.arange(5))
    assert torch.equal(out[2].view(torch.int16), strided.to(torch.bfloat16).view(torch.int16))


def test_a_wire_dtype_must_be_a_narrower_float() -> None:
    for bad in (torch.float32, torch.float64, torch.int16):
        with pytest.raises(ValueError, match="wire_dtype"):
            ws.MultiProcessWeightSyncScheme(wire_dtype=bad)


def _worker(scheme: ws.WeightSyncScheme, pipe: Connection, out: Connection, device: str = "cpu") -> None:
    model = _worker_model().to(device)
    scheme.init_on_worker("policy", pipe=pipe, model=model)
    try:
        while True:
            version = scheme.receive(timeout=30.0)
            if version is None:
                return
            state = {k: v.cpu() for k, v in model.state_dict().items()}
            devices = sorted({str(v.device) for v in model.state_dict().values()})
            out.send((version, {k: v.numpy().copy() for k, v in _bits(state).items()}, devices))
    except ws.SenderClosedError:
        pass
    finally:
        scheme.shutdown()


_ON_GPU = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]


@pytest.mark.parametrize("scheme_class", [ws.MultiProcessWeightSyncScheme, ws.SharedMemWeightSyncScheme])
@pytest.mark.parametrize(
    "trainer_device, worker_devices",
    [
        pytest.param("cpu", ("cpu", "cpu"), id="host"),
        # A trainer on a GPU casts there; its workers on the GPU and on the host.
        pytest.param("cuda", ("cuda", "cpu"), id="gpu", marks=_ON_GPU),
    ],
)
def test_workers_hold_the_trainers_weights_cast(
    scheme_class: type[ws.WeightSyncScheme], trainer_device: str, worker_devices: tuple[str, ...]
) -> None:
    scheme = scheme_class(wire_dtype=torch.bfloat16, timeout=60)
    pipes, outs, procs = [], [], []
    for device in worker_devices:
        proc, ours, out_r = start_pipe_worker(_worker, lambda pipe, out, d=device: (scheme, pipe, out, d))
        pipes.append(ours)
        outs.append(out_r)
        procs.append(proc)
    trainer = _trainer_model().to(trainer_device)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
    scheme.init_on_sender("policy", pipes=pipes, model=trainer)
    try:
        # (Every worker first: a worker on the GPU starts later than one on
        # the host, and one that announces itself once the weights were
        # staged for the others, reached another way, gets the next send.)
        scheme.wait_for_workers()
        for step in range(3):
            report = scheme.get_sender().send()
            expected = {
                name: (t.to(torch.bfloat16) if t.dtype == torch.float32 else t).cpu()
                for name, t in trainer.state_dict().items()
            }
            for out, device in zip(outs, worker_devices, strict=True):
                version, got, devices = out.recv()
                assert version == report.version
                assert devices == [device if device == "cpu" else f"{device}:0"], devices
                for name, bits in _bits(expected).items():
                    assert torch.equal(torch.from_numpy(got[name]), bits), (step, name)
            # Each send moves the cast bytes only.
            assert report.nbytes < sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
            trainer(torch.randn(16, 300, device=trainer_device)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        scheme.shutdown()
        reap(procs)


def test_a_float32_worker_is_refused_before_anything_moves() -> None:
    trainer, worker_model = nn.Linear(8, 8), nn.Linear(8, 8)
    before = copy.deepcopy(worker_model.state_dict())
    scheme = ws.InProcessWeightSyncScheme(wire_dtype=torch.bfloat16)
    scheme.init_on_sender("policy", model=trainer, num_workers=1)
    worker = copy.copy(scheme)
    worker.init_on_worker("policy", model=worker_model, worker_idx=0)
    try:
        with pytest.raises(ws.WeightMismatchError, match="bfloat16"):
            scheme.get_sender().send(timeout=10)
        for name, tensor in worker_model.state_dict().items():
            assert torch.equal(tensor, before[name])
    finally:
        worker.shutdown()
        scheme.shutdown()


def test_a_kept_read_casts_into_the_same_list_and_a_callers_own_is_not_held() -> None:
    """A module's read, kept from send to send, casts into the same list
    object (so the staging's copy plan for it is kept, not made again per
    send); the caller's own tensors are cast into a new list each time and
    not held once the call returned."""
    import gc
    import weakref

    wire = WireCast(torch.bfloat16)
    kept = [torch.randn(64), torch.arange(4)]
    first = wire.cast(kept, keep=True)
    assert wire.cast(kept, keep=True) is first
    assert first[1] is kept[1] and first[0].dtype == torch.bfloat16
    assert torch.equal(first[0], kept[0].to(torch.bfloat16))
    own = [torch.randn(64), torch.arange(4)]
    alive = weakref.ref(own[1])
    cast = wire.cast(own)
    assert cast is not wire.cast(own) and torch.equal(cast[0], own[0].to(torch.bfloat16))
    del own, cast
    gc.collect()
    assert alive() is None
