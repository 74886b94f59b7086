"""Frames: how a buffer is cut for the chain and the delta codec.

The chain's unit of pipelining and the codec's unit of encoding are one
size, so a delta frame is a chain frame: both ends of a hop cut the same
spans from the same (size, chunk), which is all a fixed-size frame needs.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CHUNK_BYTES", "frame_spans", "piece_spans"]

#: Bytes per frame. 1 MiB: at 1 Gbit/s a frame takes 8 ms per hop, so
#: filling a chain of 7 hosts costs 50 ms, while gloo's cost per message
#: stays small next to its transfer (4 MiB measured slower: 1.36x the floor
#: against 1.17x at 64 MiB, 5 hosts).
CHUNK_BYTES = 1 << 20


def frame_spans(total: int, chunk: int = CHUNK_BYTES, element_size: int = 1) -> list[tuple[int, int]]:
    """The frames of a buffer of ``total`` bytes: (start, stop) spans, in
    order, of ``chunk`` bytes rounded down to a multiple of
    ``element_size`` (no element straddles two frames); the last frame
    holds the rest. No bytes: no frames.

    :raises ValueError: a size that is not positive.
    """
    if not 0 < chunk < 1 << 32 or element_size <= 0 or total < 0:
        raise ValueError(f"bad sizes: total={total}, chunk={chunk}, element_size={element_size}")
    step = max(element_size, chunk - chunk % element_size)
    return [(start, min(start + step, total)) for start in range(0, total, step)]


def piece_spans(sizes: Sequence[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """Cut the concatenation of buffers of ``sizes`` bytes into frames of at
    most ``chunk`` bytes; each frame is a list of (buffer, start, stop)
    pieces, in order. An empty list for no bytes."""
    frames: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = chunk
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(room, size - start)
            current.append((index, start, start + take))
            start += take
            room -= take
            if room == 0:
                frames.append(current)
                current, room = [], chunk
    if current:
        frames.append(current)
    return frames
