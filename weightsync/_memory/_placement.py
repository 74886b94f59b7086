"""Where weights live, and what that asks of a send.

A worker announces the devices its model's tensors are on (with its layout,
when it says hello), each named so that another process can tell whether it
is the same device: ``"cpu"``, or ``"cuda:"`` followed by the GPU's UUID (an
index names another GPU under another ``CUDA_VISIBLE_DEVICES``, a UUID never
does). The sender knows the devices of the trainer's tensors, and from both
chooses a :class:`Placement` per worker: what kind of memory a send to it
stages through and what copies it costs. ``SendReport.placements`` says
which one each worker's send took.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .._packet import Packet

__all__ = [
    "Placement",
    "caller_stream",
    "choose",
    "current_stream",
    "device_name",
    "devices_of",
    "gpu_stream",
    "on_caller_stream",
    "on_gpu",
    "on_stream",
    "reachable",
    "route",
]

_UUIDS: dict[int, str] = {}


def device_name(device: torch.device) -> str:
    """``device`` named for another process: ``"cpu"``, ``"cuda:<uuid>"``
    (the GPU's UUID, as ``nvidia-smi -L`` shows it), or the device type
    (``"meta"``, ``"mps"``)."""
    if device.type != "cuda":
        return device.type
    index = torch.cuda.current_device() if device.index is None else device.index
    uuid = _UUIDS.get(index)
    if uuid is None:
        raw = str(torch.cuda.get_device_properties(index).uuid)
        uuid = _UUIDS[index] = raw if raw.startswith("GPU-") else f"GPU-{raw}"
    return f"cuda:{uuid}"


def devices_of(tensors: Iterable[torch.Tensor]) -> tuple[str, ...]:
    """The devices ``tensors`` are on, each once, in the order first met
    (see :func:`device_name`)."""
    seen: dict[torch.device, None] = {}
    for tensor in tensors:
        seen.setdefault(tensor.device, None)
    return tuple(dict.fromkeys(device_name(d) for d in seen))


def reachable(devices: tuple[str, ...]) -> tuple[str, ...]:
    """The GPUs (named as :func:`device_name` names them) that this process
    can copy from, device to device, into a model on ``devices``: each GPU
    it sees that is one of them or that every one of them can access peer
    to peer. Empty for a model in host memory (no CUDA is touched then)."""
    if not on_gpu(devices) or not torch.cuda.is_available():
        return ()
    count = torch.cuda.device_count()
    names = {index: device_name(torch.device("cuda", index)) for index in range(count)}
    mine = [index for index, name in names.items() if name in devices]
    return tuple(
        name
        for index, name in names.items()
        if all(index == own or torch.cuda.can_device_access_peer(own, index) for own in mine)
    )


def on_gpu(devices: Iterable[str]) -> bool:
    """Whether any of ``devices`` (as :func:`devices_of` names them) is a GPU."""
    return any(d.startswith("cuda:") for d in devices)


class Placement(enum.Enum):
    """Where the trainer's weights are and where a worker's model is, as a
    send sees it."""

    #: Both in host memory: one shared host staging, each worker copies
    #: (or, under the zero-copy scheme, maps) it.
    HOST = "host"
    #: Trainer on a GPU, worker on the CPU: a device-to-host copy into the
    #: host staging, which the worker then reads as from a CPU trainer.
    DEVICE_TO_HOST = "device-to-host"
    #: Trainer on the CPU, worker on a GPU: the worker copies from the host
    #: staging into its device (host-to-device).
    HOST_TO_DEVICE = "host-to-device"
    #: Both on the same GPU: device-to-device copies.
    SAME_DEVICE = "same-device"
    #: On two GPUs: device to device across them (peer to peer where the
    #: GPUs allow it, else through host memory).
    PEER = "peer"
    #: Both on GPUs, through host memory: a verified send (digests are
    #: taken of host bytes), a worker that cannot reach the trainer's GPU
    #: device to device, or a scheme that stages in host memory (Ray,
    #: torch.distributed).
    THROUGH_HOST = "through-host"
    #: A side spans several devices, or one weightsync does not stage for:
    #: through host memory, each tensor copied to its own device.
    MIXED = "mixed"

    @property
    def on_device(self) -> bool:
        """Whether the worker reads GPU memory of the trainer's (device to device)."""
        return self in (Placement.SAME_DEVICE, Placement.PEER)


def choose(trainer: tuple[str, ...], worker: tuple[str, ...] | None) -> Placement:
    """The placement of a send from tensors on the ``trainer`` devices to a
    worker whose model is on the ``worker`` devices (None: it did not say;
    an older or a pushing endpoint is taken as host memory)."""
    worker = worker or ("cpu",)
    if len(trainer) != 1 or len(worker) != 1:
        return Placement.MIXED
    (source,), (target,) = trainer, worker
    if source == "cpu" and target == "cpu":
        return Placement.HOST
    on_gpu = source.startswith("cuda:"), target.startswith("cuda:")
    if on_gpu == (True, False) and target == "cpu":
        return Placement.DEVICE_TO_HOST
    if on_gpu == (False, True) and source == "cpu":
        return Placement.HOST_TO_DEVICE
    if on_gpu == (True, True):
        return Placement.SAME_DEVICE if source == target else Placement.PEER
    return Placement.MIXED


def route(
    trainer: tuple[str, ...],
    worker: tuple[str, ...] | None,
    reach: tuple[str, ...],
    *,
    device_staging: bool,
) -> Placement:
    """How one send reaches one worker: the one decision, made once per
    (send, worker) by the send; the staging follows it and the report
    says it. ``reach``: the GPUs the worker can copy from device to device
    (:func:`reachable`); ``device_staging``: whether this send may stage on
    the trainer's GPU (the scheme's staging can, and the send is not
    verified). A worker on a GPU that this send cannot serve device to
    device goes through host memory."""
    key = (trainer, worker, reach, device_staging)
    placement = _ROUTES.get(key)
    if placement is None:
        placement = choose(trainer, worker)
        if placement.on_device and not (device_staging and trainer[0] in reach):
            placement = Placement.THROUGH_HOST
        if len(_ROUTES) < 4096:  # (a handful of device tuples in any real run)
            _ROUTES[key] = placement
    return placement


# Routes decided before, by their inputs: a send asks once per worker.
_ROUTES: dict[tuple[tuple[str, ...], tuple[str, ...] | None, tuple[str, ...], bool], Placement] = {}


# The stream objects handed out, by what torch names a stream by (its id,
# device index and device type): the same stream is the same object, so
# "is it current?" is one C call and an identity test. torch's own
# ``current_stream`` and ``stream`` context go through several Python
# layers per call (device index lookups, availability checks), and a send
# on a GPU asks several times.
_STREAMS: dict[tuple[int, int, int], Any] = {}


def current_stream(index: int | None = None) -> Any:
    """This thread's current CUDA stream on GPU ``index`` (the current GPU
    where None), as ``torch.cuda.current_stream`` gives it; the same object
    each time for the same stream. CUDA is initialised by the caller."""
    key = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice() if index is None else index)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        if len(_STREAMS) < 1024:  # (a handful of streams in any real run)
            _STREAMS[key] = stream
    return stream


def caller_stream() -> Any:
    """The calling thread's current CUDA stream (on its current device), or
    None where this process has not used CUDA. Taken when a send is
    planned, on the caller's thread: the send's copies out of the trainer's
    tensors are enqueued on it, after the work the caller enqueued before,
    whichever thread makes them."""
    return current_stream() if torch.cuda.is_initialized() else None


def gpu_stream(caller: Any, device: torch.device) -> Any:
    """The stream a copy out of a send's tensors on ``device`` runs on: the
    caller's (``caller``, :func:`caller_stream`, a packet's ``stream``)
    where it is on that device, else that device's current stream."""
    if caller is not None and caller.device_index == device.index:
        return caller
    return current_stream(device.index)


# The context of every copy from host memory, and of one on the stream that
# is current already: one, as a nullcontext holds no state.
_NO_STREAM = contextlib.nullcontext()


def on_stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """A context in which work on ``stream``'s GPU is enqueued on
    ``stream``: torch's stream context where another stream is current
    there (a send driven from another thread than the caller's), else a
    no-op (the common case: the caller's thread and stream)."""
    if current_stream(stream.device_index) is stream:
        return _NO_STREAM
    return torch.cuda.stream(stream)


def on_caller_stream(packet: Packet) -> contextlib.AbstractContextManager[Any]:
    """A context in which copies out of ``packet``'s tensors run on the
    caller's stream (:func:`gpu_stream`); a no-op for tensors in host
    memory (a packet holds a stream only for tensors on a GPU)."""
    if packet.stream is None or not packet.tensors:
        return _NO_STREAM
    return on_stream(gpu_stream(packet.stream, packet.tensors[0].device))
