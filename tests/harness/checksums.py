"""The tests' one weight checksum: whether a worker holds, bit for bit, the
weights that were sent.

It is the bench's (:func:`weightsync.bench.tensor_checksums`: CRC32 of each
tensor's bytes, a GPU tensor copied to the CPU first), by name, so that a
mismatch names the tensors that differ. Tensors of any dtype (bfloat16
included) and shape (0-d included) are compared by their bytes: equal
checksums mean equal dtypes' bits, not merely equal values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from weightsync.bench import tensor_checksums


def weight_checksums(weights: nn.Module | Mapping[str, Any]) -> dict[str, int]:
    """``{name: checksum}`` of every tensor of ``weights`` (a module's
    parameters and buffers, a TensorDict's leaves, a dict of tensors)."""
    tensors = _tensors(weights)
    return dict(zip(sorted(tensors), tensor_checksums(tensors), strict=True))


def _tensors(weights: nn.Module | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    if isinstance(weights, nn.Module):
        return dict(weights.state_dict(keep_vars=True))
    if hasattr(weights, "flatten_keys"):  # a TensorDict: its leaves, by their dotted names
        return dict(weights.flatten_keys(".").items())
    return dict(weights)
