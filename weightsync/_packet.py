"""The packet: what one send moves.

A send is prepared once into a flat layout: every tensor gets a fixed,
64-byte-aligned slice of one contiguous byte buffer. The :class:`Manifest`
(names, dtypes, shapes, offsets) depends only on the layout, so it is built
and sent to a worker once per layout and cached by its ``layout_id``; a
routine send carries only the version and the bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ._exceptions import WeightMismatchError
from ._strategy import describe_mismatch

__all__ = ["ALIGNMENT", "CopyPlan", "Manifest", "Packet", "TensorSpec", "copy_tensors", "usable_cores"]

# Every slice starts on a cache line, so a byte view can be reinterpreted as
# any dtype and two tensors never share a line.
ALIGNMENT = 64

Signature = tuple[tuple[str, str, tuple[int, ...]], ...]


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightMismatchError(f"unknown dtype {name!r} in a manifest")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives in the packet's byte buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class Manifest:
    """The layout of a packet: one :class:`TensorSpec` per tensor, sorted by name.

    Two manifests with the same names, dtypes and shapes have the same
    ``layout_id`` and offsets, on any process.
    """

    signature: Signature
    specs: tuple[TensorSpec, ...] = field(repr=False)
    nbytes: int
    layout_id: str

    @classmethod
    def from_signature(cls, signature: Signature) -> Manifest:
        specs = []
        offset = 0
        for name, dtype_name, shape in signature:
            dtype = _dtype_from_name(dtype_name)
            numel = 1
            for dim in shape:
                numel *= dim
            nbytes = numel * dtype.itemsize
            specs.append(TensorSpec(name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
        digest = hashlib.blake2b(repr(signature).encode(), digest_size=12).hexdigest()
        return cls(signature, tuple(specs), offset, digest)

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Manifest:
        """The manifest of a flat ``{name: tensor}`` mapping."""
        return cls.from_signature(signature_of(tensors))

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def ordered(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The tensors of ``tensors`` in manifest order."""
        return [tensors[spec.name] for spec in self.specs]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of each tensor's slice of a flat ``uint8`` buffer."""
        return [buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.specs]

    def check_matches(self, other: Manifest, *, model_id: str | None, where: str) -> None:
        """Raise :class:`WeightMismatchError` unless ``other`` has this layout."""
        if other.layout_id == self.layout_id:
            return
        mine = {name: (dtype, shape) for name, dtype, shape in self.signature}
        theirs = {name: (dtype, shape) for name, dtype, shape in other.signature}
        missing = [n for n in theirs if n not in mine]
        extra = [n for n in mine if n not in theirs]
        wrong = [
            f"{n}: {mine[n][1]} {mine[n][0]} vs {theirs[n][1]} {theirs[n][0]}"
            for n in mine
            if n in theirs and mine[n] != theirs[n]
        ]
        raise WeightMismatchError(describe_mismatch(missing, extra, wrong, where=where), model_id=model_id)


def signature_of(tensors: Mapping[str, torch.Tensor]) -> Signature:
    return tuple(
        (name, str(tensors[name].dtype).removeprefix("torch."), tuple(tensors[name].shape))
        for name in sorted(tensors)
    )


@dataclass(frozen=True, eq=False)
class Packet:
    """One prepared send: a version, its manifest, and the source tensors in
    manifest order (not yet copied anywhere)."""

    version: int
    manifest: Manifest
    tensors: Sequence[torch.Tensor] = field(repr=False)
    #: How many workers this packet goes to; each may copy with
    #: ``usable_cores() // fanout`` threads without oversubscribing the host.
    fanout: int = 1

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes


# Copies are plain memcpy (``ctypes.memmove``, which releases the GIL), split
# across ``threads`` short-lived threads when large. torch's own parallel copy
# would use its intra-op threads, which spin-wait after each copy; on a
# machine with as many processes as cores that spinning takes the core from
# the very workers the copy is for, and torch cannot be told per call how many
# threads to use. Below this size one thread is faster than starting others.
PARALLEL_COPY_BYTES = 4 << 20


def _plain(tensor: torch.Tensor) -> bool:
    return tensor.is_cpu and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def _memmove_spans(spans: list[tuple[int, int, int]]) -> None:
    for dst, src, size in spans:
        ctypes.memmove(dst, src, size)


def _split(spans: list[tuple[int, int, int]], total: int, parts: int) -> list[list[tuple[int, int, int]]]:
    """Cut a list of (dst, src, size) copies into ``parts`` lists of about equal bytes."""
    share = -(-total // parts)
    out: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for dst, src, size in spans:
        while size > 0:
            if room == 0:
                out.append([])
                room = share
            step = min(size, room)
            out[-1].append((dst, src, step))
            dst, src, size, room = dst + step, src + step, size - step, room - step
    return out


class CopyPlan:
    """A copy of ``sources`` into ``destinations`` (same shapes and dtypes),
    worked out once and run as often as the tensors stay the same.

    Contiguous CPU pairs become byte copies, run on up to ``threads`` threads
    for large totals; anything else (strided views, other devices) goes
    through torch.
    """

    def __init__(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        self.spans: list[tuple[int, int, int]] = []
        self.total = 0
        self.slow_dst: list[torch.Tensor] = []
        self.slow_src: list[torch.Tensor] = []
        for dst, src in zip(destinations, sources, strict=True):
            if dst.shape != src.shape or dst.dtype != src.dtype:
                # Raw copies trust sizes: never make one between tensors that differ.
                raise ValueError(
                    f"cannot copy {src.dtype}{tuple(src.shape)} into {dst.dtype}{tuple(dst.shape)}"
                )
            if _plain(dst) and _plain(src):
                size = dst.numel() * dst.element_size()
                if size:
                    self.spans.append((dst.data_ptr(), src.data_ptr(), size))
                    self.total += size
            else:
                self.slow_dst.append(dst)
                self.slow_src.append(src)
        # The plan holds raw addresses: keep the tensors alive with it, and
        # remember where the destinations' data was.
        self._keep = (list(destinations), list(sources))
        self._where = [t.data_ptr() for t in self._keep[0]]

    def still_valid(self) -> bool:
        """False if a destination's data moved since the plan was made (e.g.
        ``param.data = other``): the plan must then be made again."""
        return [t.data_ptr() for t in self._keep[0]] == self._where

    def run(self, threads: int = 1) -> None:
        """Copy every byte; blocks until done."""
        parts = max(1, min(threads, self.total // PARALLEL_COPY_BYTES))
        if parts == 1:
            _memmove_spans(self.spans)
        else:
            shares = _split(self.spans, self.total, parts)
            helpers = [
                threading.Thread(target=_memmove_spans, args=(share,), name="weightsync-copy", daemon=True)
                for share in shares[1:]
            ]
            for helper in helpers:
                helper.start()
            _memmove_spans(shares[0])
            for helper in helpers:
                helper.join()
        if self.slow_dst:
            with torch.inference_mode():
                torch._foreach_copy_(self.slow_dst, self.slow_src)


def copy_tensors(
    destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], *, threads: int = 1
) -> None:
    """Copy ``sources`` into ``destinations`` once (see :class:`CopyPlan`)."""
    CopyPlan(destinations, sources).run(threads)


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
