"""A pipelined chain over a group of a link (``_link``: gloo's today, see
``_gloo``): one buffer from a source to several ranks, each passing every
chunk on to the next as soon as it has it, so every rank's link carries the
bytes about once each way and the last rank finishes about (ranks - 1)
chunks after the first. Only the link's point-to-point calls are used
(``PeerGroup.send`` / ``recv`` and their ``wait``): any link runs it.

The unit that moves is a *frame*. Two kinds of chain carry them:

- a chain of the buffer's bytes (:func:`send_chain`, :func:`relay_chain`):
  a frame is a span of the buffer, sent as one gloo message; every frame
  but the last is ``chunk`` bytes (see :func:`frame_spans`), so a receiver
  knows each frame's size from the total and the chunk its notice carries;
- a chain of encoded frames (:func:`send_frames`, :func:`relay_frames`),
  each of its own size (a delta frame, see ``_delta``), gathered into
  batches of about :data:`BATCH_BYTES`: a batch goes as two messages, a
  fixed-size head (tag 1) that says how many bytes and frames follow, then
  the frames, each with its own header (tag 2). A frame of a sparse delta
  is tens of KiB, and every gloo message costs each end about 0.1 ms of
  CPU on the project's machine, as much as the link takes for the frame:
  a batch pays it once for several frames. The next head's receive is
  posted before the batch arrives, so a relay never waits for a round
  trip between two batches.

The chain driver above (``_driver``) and both transports know nothing of how
a frame is cut; this module knows nothing of either transport, nor of the
link under it.
"""

from __future__ import annotations

import datetime
import itertools
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..._copy import copy_tensors
from ..._frames import frame_spans, piece_spans

__all__ = [
    "BATCH_BYTES",
    "ChainBroken",
    "relay_chain",
    "relay_frames",
    "send_chain",
    "send_frames",
    "seconds",
    "short_message",
]


class ChainBroken(RuntimeError):
    """A hop of the chain failed: the message says which frame and why
    (``stalled N s`` when the peer took or gave nothing for a stall limit)."""


def _failure(exc: BaseException, started: float, limit: float, what: str) -> str:
    """Why a gloo wait begun at ``started`` (``time.monotonic()``) with
    limit ``limit`` failed: a stall when it waited out (most of) its limit
    or gloo says a timeout closed the connection (another wait's, on the
    same pair), else gloo's own word."""
    waited = time.monotonic() - started
    message = short_message(exc)
    if waited >= 0.9 * limit or "timeout" in message.lower() or "timed out" in message.lower():
        return f"stalled {max(waited, limit):.1f} s ({what})"
    return f"{message} ({what})"


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(value, 0.001))


def _within(stall: float, until: float | None, what: str, stopped: Callable[[], bool] | None = None) -> float:
    """How long the next wait of a chain may take: its stall limit, cut to
    what is left before ``until`` (the send's deadline).

    :raises ChainBroken: ``until`` passed, or ``stopped()`` (the send is over).
    """
    if stopped is not None and stopped():
        raise ChainBroken(f"the send was over ({what})")
    if until is None:
        return stall
    left = until - time.monotonic()
    if left <= 0:
        raise ChainBroken(f"the send's deadline passed ({what})")
    return min(stall, left)


def send_chain(
    group: Any,
    sources: Sequence[torch.Tensor],
    chunk: int,
    dst: int,
    stall: float,
    ready: Callable[[int], object] | None = None,
    until: float | None = None,
    stopped: Callable[[], bool] | None = None,
) -> None:
    """Send the concatenation of ``sources`` (flat uint8 tensors) to rank
    ``dst`` in frames of ``chunk`` bytes; a frame spanning several sources
    is gathered first. Two frames are in flight at most. ``ready(n)``, if
    given, is called before each frame with the bytes of the concatenation
    up to its end, and returns once they are all there (the copies into
    the sources may still be running when the chain starts). ``until``
    (``time.monotonic()``): the send's deadline, past which no frame
    starts and none is waited for; nor once ``stopped()`` (the send is
    over for the trainer).

    :raises ChainBroken: a frame did not leave within ``stall`` seconds, or
        by ``until``, or the peer is gone (gloo's error).
    :raises RuntimeError: what ``ready`` raised.
    """
    in_flight: list[tuple[Any, torch.Tensor, int]] = []
    spans = piece_spans([s.numel() for s in sources], chunk)
    last = len(spans)

    def wait(work: Any, index: int) -> None:
        started = time.monotonic()
        limit = _within(stall, until, f"sending frame {index + 1} of {last}", stopped)
        try:
            work.wait(seconds(limit))
        except RuntimeError as exc:
            raise ChainBroken(_failure(exc, started, limit, f"sending frame {index + 1} of {last}")) from exc

    # Where each source begins in the concatenation.
    starts = list(itertools.accumulate((s.numel() for s in sources), initial=0)) if ready else []
    for index, pieces in enumerate(spans):
        _within(stall, until, f"sending frame {index + 1} of {last}", stopped)
        if ready is not None:
            i, _, stop = pieces[-1]
            ready(starts[i] + stop)
        if len(pieces) == 1:
            i, start, stop = pieces[0]
            data = sources[i][start:stop]
        else:
            # Gathered by memmove on this thread (torch.cat would wake the
            # intra-op pool, whose cores belong to the caller's own work).
            data = torch.empty(sum(b - a for _, a, b in pieces), dtype=torch.uint8)
            cuts = [0]
            for _, a, b in pieces:
                cuts.append(cuts[-1] + b - a)
            copy_tensors(
                [data[cuts[k] : cuts[k + 1]] for k in range(len(pieces))],
                [sources[i][a:b] for i, a, b in pieces],
            )
        try:
            in_flight.append((group.send([data], dst, 0), data, index))
        except RuntimeError as exc:
            what = f"sending frame {index + 1} of {last}"
            raise ChainBroken(_failure(exc, time.monotonic(), stall, what)) from exc
        if len(in_flight) > 2:
            work, _, k = in_flight.pop(0)
            wait(work, k)
    for work, _, k in in_flight:
        wait(work, k)


def relay_chain(
    group: Any,
    buffer: torch.Tensor,
    chunk: int,
    src: int,
    dst: int | None,
    stall: float,
    first: float,
    progress: Callable[[int], None] | None = None,
) -> tuple[bool, str | None]:
    """Receive ``buffer`` from rank ``src`` frame by frame (see
    :func:`frame_spans`), passing each on to rank ``dst`` (if any) as soon
    as it is in. Blocks until every frame is in and passed on, or a hop
    fails. ``first``: how long to wait for the first frame (the chain may
    still be filling); ``stall`` for each one after. ``progress``: called
    with the number of leading bytes of ``buffer`` in, after each frame.

    Returns (whether all of ``buffer`` arrived, why a hop failed or None):
    a host whose next host failed still holds the whole send. Never raises
    for a failed hop.
    """
    frames = frame_spans(buffer.numel(), chunk)
    if not frames:
        return True, None
    sends: list[tuple[Any, int]] = []
    received = 0
    forwarding = dst is not None
    error: str | None = None
    last = len(frames)

    def wait_send(work: Any, index: int) -> None:
        started = time.monotonic()
        try:
            work.wait(seconds(stall))
        except RuntimeError as exc:
            raise ChainBroken(
                _failure(exc, started, stall, f"passing frame {index + 1} of {last} on")
            ) from exc

    try:
        pending = group.recv([buffer[frames[0][0] : frames[0][1]]], src, 0)
        for k, (start, stop) in enumerate(frames):
            limit, started = first if k == 0 else stall, time.monotonic()
            try:
                pending.wait(seconds(limit))
            except RuntimeError as exc:
                raise ChainBroken(
                    _failure(exc, started, limit, f"receiving frame {k + 1} of {last}")
                ) from exc
            received = k + 1
            if k + 1 < last:
                pending = group.recv([buffer[frames[k + 1][0] : frames[k + 1][1]]], src, 0)
            if progress is not None:
                progress(stop)
            if forwarding:
                try:
                    sends.append((group.send([buffer[start:stop]], dst, 0), k))
                    if len(sends) > 2:
                        wait_send(*sends.pop(0))
                except RuntimeError as exc:
                    # The next host is gone: keep receiving, for this host.
                    what = f"passing frame {k + 1} of {last} on"
                    why = (
                        str(exc)
                        if isinstance(exc, ChainBroken)
                        else _failure(exc, time.monotonic(), stall, what)
                    )
                    forwarding, sends, error = False, [], why
        for work, k in sends:
            wait_send(work, k)
    except RuntimeError as exc:
        what = f"receiving frame {received + 1} of {last}"
        error = str(exc) if isinstance(exc, ChainBroken) else _failure(exc, time.monotonic(), stall, what)
    return received == last, error


# Tags of an encoded frame's two messages (a chain of bytes uses tag 0).
_HEAD_TAG, _BODY_TAG = 1, 2


#: The bytes of encoded frames :func:`send_frames` gathers into one batch
#: (a frame larger than that is a batch of its own).
BATCH_BYTES = 128 * 1024
# A batch's head: the bytes of its frames, and how many frames.
_BATCH = struct.Struct("<qq")


def send_frames(
    group: Any,
    frames: Iterable[bytes],
    header_size: int,
    dst: int,
    stall: float,
    count: int,
    *,
    batch_bytes: int = BATCH_BYTES,
    until: float | None = None,
    stopped: Callable[[], bool] | None = None,
) -> None:
    """Send ``count`` encoded ``frames`` (each ``header_size`` bytes of header,
    then its payload) to rank ``dst``, in batches: each batch leaves once
    its frames reach ``batch_bytes`` (or the frames end), while the next
    frames are produced. Two batches are in flight at most.

    :raises ChainBroken: a batch did not leave within ``stall`` seconds, or
        by ``until`` (as :func:`send_chain`), or the peer is gone (gloo's error).
    """
    in_flight: list[tuple[list[Any], tuple[torch.Tensor, torch.Tensor], int]] = []
    batch: list[bytes] = []
    size = sent = 0

    def wait(works: list[Any], last: int) -> None:
        started = time.monotonic()
        what = f"sending frame {last + 1} of {count}"
        try:
            for work in works:
                limit = _within(stall, until, what, stopped)
                work.wait(seconds(limit))
        except RuntimeError as exc:
            if isinstance(exc, ChainBroken):
                raise
            raise ChainBroken(_failure(exc, started, stall, what)) from exc

    def flush() -> None:
        nonlocal batch, size, sent
        _within(stall, until, f"sending frame {sent + 1} of {count}", stopped)
        head = torch.frombuffer(bytearray(_BATCH.pack(size, len(batch))), dtype=torch.uint8)
        body = torch.frombuffer(bytearray().join(batch), dtype=torch.uint8)
        last = sent + len(batch) - 1
        try:
            works = [group.send([head], dst, _HEAD_TAG), group.send([body], dst, _BODY_TAG)]
        except RuntimeError as exc:
            what = f"sending frame {last + 1} of {count}"
            raise ChainBroken(_failure(exc, time.monotonic(), stall, what)) from exc
        in_flight.append((works, (head, body), last))
        sent, batch, size = last + 1, [], 0
        if len(in_flight) > 2:
            works, _, k = in_flight.pop(0)
            wait(works, k)

    for frame in frames:
        batch.append(frame)
        size += len(frame)
        if size >= batch_bytes:
            flush()
    if batch:
        flush()
    for works, _, k in in_flight:
        wait(works, k)


def relay_frames(
    group: Any,
    count: int,
    header_size: int,
    payload_length: Callable[[torch.Tensor], int],
    src: int,
    dst: int | None,
    stall: float,
    first: float,
    on_frame: Callable[[int, torch.Tensor], None],
) -> tuple[bool, str | None]:
    """Receive ``count`` encoded frames from rank ``src`` (in the batches of
    :func:`send_frames`), pass each batch on to rank ``dst`` (if any) as
    soon as it is in, and hand each frame (header and payload, one tensor)
    to ``on_frame(index, frame)``, in order. ``payload_length(header)``
    reads a header's payload length. Waits ``first`` seconds for the first
    batch, ``stall`` for each after.

    Returns (whether every frame arrived, why a hop failed or None), as
    :func:`relay_chain`; an error raised by ``on_frame`` is the caller's
    (it should catch its own). Never raises for a failed hop.
    """
    if count == 0:
        return True, None
    sends: list[tuple[list[Any], tuple[torch.Tensor, torch.Tensor], int]] = []
    received = 0
    forwarding = dst is not None
    error: str | None = None

    def wait(work: Any, limit: float, what: str) -> None:
        started = time.monotonic()
        try:
            work.wait(seconds(limit))
        except RuntimeError as exc:
            raise ChainBroken(_failure(exc, started, limit, what)) from exc

    try:
        head = torch.empty(_BATCH.size, dtype=torch.uint8)
        pending = group.recv([head], src, _HEAD_TAG)
        while received < count:
            what = f"receiving frame {received + 1} of {count}"
            wait(pending, first if received == 0 else stall, what)
            nbytes, many = _BATCH.unpack(head.numpy().tobytes())
            if not 0 < many <= count - received or nbytes < many * header_size:
                raise ChainBroken(f"a damaged batch head ({many} frames in {nbytes} bytes)")
            body = torch.empty(nbytes, dtype=torch.uint8)
            work = group.recv([body], src, _BODY_TAG)
            this_head = head
            if received + many < count:
                head = torch.empty(_BATCH.size, dtype=torch.uint8)
                pending = group.recv([head], src, _HEAD_TAG)
            wait(work, stall, what)
            if forwarding:
                try:
                    works = [group.send([this_head], dst, _HEAD_TAG), group.send([body], dst, _BODY_TAG)]
                    sends.append((works, (this_head, body), received + many - 1))
                    if len(sends) > 2:
                        old, _, j = sends.pop(0)
                        for one in old:
                            wait(one, stall, f"passing frame {j + 1} of {count} on")
                except RuntimeError as exc:
                    # The next host is gone: keep receiving, for this host.
                    what = f"passing frame {received + 1} of {count} on"
                    why = (
                        str(exc)
                        if isinstance(exc, ChainBroken)
                        else _failure(exc, time.monotonic(), stall, what)
                    )
                    forwarding, sends, error = False, [], why
            at = 0
            for _ in range(many):
                if at + header_size > nbytes:
                    raise ChainBroken(f"a batch of {many} frames ends inside frame {received + 1}")
                end = at + header_size + payload_length(body[at : at + header_size])
                if end > nbytes:
                    raise ChainBroken(f"frame {received + 1} of {count} runs past its batch")
                received += 1
                on_frame(received - 1, body[at:end])
                at = end
            if at != nbytes:
                raise ChainBroken(f"{nbytes - at} bytes past the last frame of a batch")
        for works, _, j in sends:
            for one in works:
                wait(one, stall, f"passing frame {j + 1} of {count} on")
    except RuntimeError as exc:
        what = f"receiving frame {received + 1} of {count}"
        error = str(exc) if isinstance(exc, ChainBroken) else _failure(exc, time.monotonic(), stall, what)
    return received == count, error


def short_message(exc: BaseException) -> str:
    """The last line of a (gloo) error's message: the one that says what failed."""
    lines = str(exc).strip().splitlines()
    return lines[-1] if lines else type(exc).__name__
