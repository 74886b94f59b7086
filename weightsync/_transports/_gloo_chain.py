"""A pipelined chain over a gloo process group: one buffer from a source
to several ranks, each passing every chunk on to the next as soon as it has
it, so every rank's link carries the bytes about once each way and the last
rank finishes about (ranks - 1) chunks after the first.

Used by the Ray transport's relay across hosts (``_ray_relay``) and by the
torch.distributed transport (``_distributed``); it knows nothing of either.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "CHUNK_BYTES",
    "chunk_spans",
    "connect_store",
    "gloo_group",
    "relay_chain",
    "send_chain",
    "seconds",
    "short_message",
]

#: Bytes per chain message. 1 MiB: at 1 Gbit/s a chunk takes 8 ms per hop,
#: so filling a chain of 7 hosts costs 50 ms, while gloo's cost per message
#: stays small next to its transfer (4 MiB measured slower: 1.36x the floor
#: against 1.17x at 64 MiB, 5 hosts).
CHUNK_BYTES = 1 << 20


def chunk_spans(sizes: Sequence[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """Cut the concatenation of buffers of ``sizes`` bytes into chunks of at
    most ``chunk`` bytes; each chunk is a list of (buffer, start, stop)
    pieces, in order. An empty list for no bytes."""
    chunks: list[list[tuple[int, int, int]]] = []
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
                chunks.append(current)
                current, room = [], chunk
    if current:
        chunks.append(current)
    return chunks


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(value, 0.001))


def connect_store(host: str, port: int, timeout: float) -> Any:
    """A client of the TCPStore at ``host:port``; waits up to ``timeout``
    seconds for it.

    :raises RuntimeError: it did not answer in time.
    """
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=seconds(timeout))


def gloo_group(store: Any, prefix: str, rank: int, size: int, address: str, stall: float) -> Any:
    """This process's member of a new gloo group (rank ``rank`` of ``size``)
    over ``PrefixStore(prefix, store)``: no global state, so a group with a
    dead member is simply dropped and a new one formed under another
    prefix. Its sockets bind to ``address`` and connect to a peer only when
    first used, so a chain connects neighbours only. Blocks until every
    member joined.

    :raises RuntimeError: not every member joined within ``stall`` seconds.
    """
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = seconds(stall)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address, lazy_init=True)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


def send_chain(group: Any, sources: Sequence[torch.Tensor], chunk: int, dst: int, stall: float) -> None:
    """Send the concatenation of ``sources`` (flat uint8 tensors) to rank
    ``dst`` in chunks; a chunk spanning several sources is gathered first.
    Two chunks are in flight at most.

    :raises RuntimeError: a chunk did not leave within ``stall`` seconds, or
        the peer is gone (gloo's error).
    """
    in_flight: list[tuple[Any, torch.Tensor]] = []
    for pieces in chunk_spans([s.numel() for s in sources], chunk):
        if len(pieces) == 1:
            index, start, stop = pieces[0]
            data = sources[index][start:stop]
        else:
            data = torch.cat([sources[i][a:b] for i, a, b in pieces])
        in_flight.append((group.send([data], dst, 0), data))
        if len(in_flight) > 2:
            in_flight.pop(0)[0].wait(seconds(stall))
    for work, _ in in_flight:
        work.wait(seconds(stall))


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
    """Receive ``buffer`` from rank ``src`` in chunks, passing each on to
    rank ``dst`` (if any) as soon as it is in. ``first``: how long to wait
    for the first chunk (the chain may still be filling). ``progress``:
    called with the number of leading bytes of ``buffer`` in, after each chunk.

    Returns (whether all of ``buffer`` arrived, gloo's error or None): a
    host whose next host failed still holds the whole send.
    """
    total = buffer.numel()
    starts = list(range(0, total, chunk))
    if not starts:
        return True, None
    sends: list[Any] = []
    received = 0
    forwarding = dst is not None
    error: str | None = None
    try:
        pending = group.recv([buffer[0 : min(chunk, total)]], src, 0)
        for k, start in enumerate(starts):
            pending.wait(seconds(first if k == 0 else stall))
            received = k + 1
            if k + 1 < len(starts):
                nxt = starts[k + 1]
                pending = group.recv([buffer[nxt : min(nxt + chunk, total)]], src, 0)
            if progress is not None:
                progress(min(start + chunk, total))
            if forwarding:
                try:
                    sends.append(group.send([buffer[start : min(start + chunk, total)]], dst, 0))
                    if len(sends) > 2:
                        sends.pop(0).wait(seconds(stall))
                except RuntimeError as exc:
                    # The next host is gone: keep receiving, for this host.
                    forwarding, sends, error = False, [], short_message(exc)
        for work in sends:
            work.wait(seconds(stall))
    except RuntimeError as exc:
        error = short_message(exc)
    return received == len(starts), error


def short_message(exc: BaseException) -> str:
    """The last line of a (gloo) error's message: the one that says what failed."""
    lines = str(exc).strip().splitlines()
    return lines[-1] if lines else type(exc).__name__
