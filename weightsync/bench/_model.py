"""The model ``weightsync bench`` sends, and how a worker's copy of it is
checked.

The trainer builds a :class:`GeneratedMLP` of the run's dtype filled with a
pattern; each worker builds one of the same layout holding zeros, each on
its own device (the CPU, or a CUDA device). After every send, each
worker's CRC32 per tensor (:func:`tensor_checksums`, over a CPU copy of a
CUDA tensor's bytes) is
compared with the trainer's (:func:`check_applied`); between sends the
trainer changes one tensor (:func:`change_model`), so every send carries
different bytes.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ._types import DTYPES, BenchError, VerificationError

__all__ = [
    "GeneratedMLP",
    "change_model",
    "check_applied",
    "check_on_device",
    "corrupt_model",
    "mlp_shapes",
    "model_nbytes",
    "tensor_checksums",
    "unflatten_into",
]


def mlp_shapes(nbytes: int, tensors: int, item: int = 4) -> dict[str, tuple[int, ...]]:
    """Names and shapes of an MLP of tensors of ``item`` bytes per element
    (4: float32) holding about ``nbytes`` in exactly ``tensors`` tensors.

    Layers are Linear-like pairs (``weight [out, in]``, ``bias [out]``); an
    odd count ends with a weight alone. Row counts are powers of two, so a
    power-of-two size comes out exact; otherwise the total is within a few
    rows of ``nbytes`` (use :func:`model_nbytes` for the exact figure).

    :raises ValueError: ``nbytes`` or ``tensors`` is not positive.
    """
    if nbytes <= 0 or tensors <= 0:
        raise ValueError(f"nbytes and tensors must be positive, got {nbytes} and {tensors}")
    pairs, lone = divmod(tensors, 2)
    matrices = pairs + lone
    per_matrix = max(nbytes // item // matrices, 2)  # elements per weight (+ its bias)
    rows = 1 << (max(math.isqrt(per_matrix), 1).bit_length() - 1)
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(pairs):
        shapes[f"layers.{i}.weight"] = (rows, max((per_matrix - rows) // rows, 1))
        shapes[f"layers.{i}.bias"] = (rows,)
    if lone:
        shapes[f"layers.{pairs}.weight"] = (rows, max(per_matrix // rows, 1))
    return shapes


def model_nbytes(shapes: Mapping[str, tuple[int, ...]], item: int = 4) -> int:
    """Bytes of tensors of these shapes, ``item`` bytes per element."""
    return sum(math.prod(shape) for shape in shapes.values()) * item


class _Layer(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None


_FILL_CHUNK = 1 << 20  # elements: bounds the temporaries of a fill, which the memory probe sees


def _fill_pattern(flat: torch.Tensor, index: int) -> None:
    """A ramp from -1 to 1 plus ``index`` (integer dtypes: a sawtooth from
    ``index``), written in chunks."""
    count = flat.numel()
    step = 2.0 / max(count - 1, 1)
    for lo in range(0, count, _FILL_CHUNK):
        hi = min(lo + _FILL_CHUNK, count)
        positions = torch.arange(lo, hi, dtype=torch.float64)
        if flat.is_floating_point():
            flat[lo:hi].copy_(positions.mul_(step).add_(index - 1.0))
        else:
            flat[lo:hi].copy_(positions.add_(index).remainder_(97))


class GeneratedMLP(nn.Module):
    """A model with the tensors of :func:`mlp_shapes`.

    ``fill="zeros"`` (a worker) or ``"pattern"`` (the trainer: a ramp per
    tensor, offset by its index, so a tensor read from the wrong place or
    shifted within itself changes the checksum). ``dtype`` names a key of
    :data:`DTYPES`; integer dtypes get a sawtooth instead of the ramp.
    ``device`` is where its tensors live (``cpu`` or ``cuda:N``).
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        fill: str = "zeros",
        dtype: str = "float32",
        device: str = "cpu",
    ) -> None:
        super().__init__()
        count = len({name.split(".")[1] for name in shapes})
        made: list[torch.Tensor] = []

        def tensor(name: str) -> torch.Tensor | None:
            shape = shapes.get(name)
            if shape is None:
                return None
            # zeros, not empty: every page is touched now, not inside a timed send.
            t = torch.zeros(shape, dtype=DTYPES[dtype], device=device)
            if fill == "pattern":
                _fill_pattern(t.view(-1), len(made))
            made.append(t)
            return t

        layers = []
        for i in range(count):
            weight = tensor(f"layers.{i}.weight")
            assert weight is not None, "mlp_shapes names every layer's weight"
            layers.append(_Layer(weight, tensor(f"layers.{i}.bias")))
        self.layers = nn.ModuleList(layers)


def unflatten_into(flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors``, in their order
    (how a gloo peer of the benchmark takes one flat buffer into a model)."""
    offset = 0
    with torch.no_grad():
        for target in tensors.values():
            target.view(-1).copy_(flat[offset : offset + target.numel()])
            offset += target.numel()


def tensor_checksums(tensors: Mapping[str, torch.Tensor]) -> list[int]:
    """CRC32 of the bytes of each tensor, in name order; a tensor on a GPU
    is copied to the CPU first (which waits for the work queued on it).

    Position-sensitive, so a shifted, swapped, torn or stale tensor is caught,
    and several GB/s, so verifying every send stays cheap.
    """
    return [tensor_crc(tensors[name]) for name in sorted(tensors)]


def tensor_crc(tensor: torch.Tensor) -> int:
    """CRC32 of the bytes of one tensor (see :func:`tensor_checksums`)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return zlib.crc32(flat.numpy().data)


def corrupt_model(tensors: Mapping[str, torch.Tensor]) -> None:
    """The testing hook: make a worker's model differ from what it applied."""
    with torch.no_grad():
        next(iter(tensors.values())).view(-1)[0] += 1


def change_model(tensors: Sequence[torch.Tensor], step: int) -> None:
    """Make the next send carry new bytes: add 1 to one tensor, a different
    one each time."""
    with torch.no_grad():
        tensors[step % len(tensors)].add_(1)


def check_applied(
    slot: int,
    version: int,
    got_version: int | None,
    got: Sequence[int],
    names: Sequence[str],
    expected: Sequence[int],
) -> None:
    """Check what worker ``slot`` reported after send ``version``: the
    version it applied and its checksums, against the trainer's ``expected``.

    :raises VerificationError: it holds other weights, or another version.
    """
    if got_version != version:
        raise VerificationError(f"worker {slot} reported applying version {got_version} after send {version}")
    if list(got) != list(expected):
        wrong = [n for n, a, b in zip(names, got, expected, strict=True) if a != b]
        raise VerificationError(
            f"worker {slot} does not hold the trainer's weights after version {version}: "
            f"{len(wrong)} of {len(names)} tensors differ (first: {wrong[0]!r}, "
            f"crc32 {got[names.index(wrong[0])]:#010x} != {expected[names.index(wrong[0])]:#010x})"
        )


def check_on_device(tensors: Mapping[str, torch.Tensor], device: str, what: str) -> None:
    """Check that every tensor of a worker's model lives on ``device``
    (``cpu`` or ``cuda:N``, as :func:`weightsync.bench._types.parse_device`
    names it), ``what`` naming the worker in the error: a scheme that
    re-points a model at the tensors it received (torchrl's) could leave it
    elsewhere, and the case would not be the placement asked for.

    :raises BenchError: a tensor lives on another device.
    """
    wanted = torch.device(device)
    elsewhere = sorted({str(t.device) for t in tensors.values() if t.device != wanted})
    if elsewhere:
        raise BenchError(
            f"{what}: the worker's model is on {', '.join(elsewhere)}, not on the worker device {device}"
        )
