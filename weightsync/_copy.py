"""The copy engine: tensors into tensors, as plain memcpy where it can.

Copies are ``ctypes.memmove`` (which releases the GIL), split across
short-lived threads when large. torch's own parallel copy would use its
intra-op threads, which spin-wait after each copy; on a machine with as many
processes as cores that spinning takes the core from the very workers the
copy is for, and torch cannot be told per call how many threads to use.

A copy never outlives the call that started it: an interruption (Ctrl-C)
waits for the helper threads before it goes on, so no memory is written after
its owner believes the copy is over, and none is unmapped under a copy.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ._exceptions import WeightMismatchError
from ._memory._placement import gpu_stream, on_stream

__all__ = [
    "PARALLEL_COPY_BYTES",
    "CopyPlan",
    "PlanCache",
    "WireCast",
    "byte_view",
    "check_same_layout",
    "check_writable_in_place",
    "copy_tensors",
    "plain",
    "run_on_threads",
    "split_evenly",
    "usable_cores",
]

# Below this size one thread is faster than starting others.
PARALLEL_COPY_BYTES = 4 << 20

Span = tuple[int, int, int]  # (destination address, source address, bytes)


def plain(tensor: torch.Tensor) -> bool:
    """A dense CPU tensor whose bytes are its values (no lazy conj or neg bit)."""
    return tensor.is_cpu and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def _memmove_spans(spans: list[Span]) -> None:
    for dst, src, size in spans:
        ctypes.memmove(dst, src, size)


# In a plan of at most PARALLEL_COPY_BYTES, a span up to this size is
# copied by a memoryview slice assignment: a tenth of ``ctypes.memmove``'s
# cost per call (its arguments converted on each call, about 0.5 us), which
# is most of a small tensor's copy. Such a copy holds the GIL: a few us per
# span, a few hundred us for a whole plan at most. Larger spans, and every
# span of a larger plan, go through ``memmove``, which lets go of it.
_VIEW_SPAN = 64 << 10


def _byte_views(span: Span) -> tuple[memoryview, memoryview]:
    """Writable byte views of a span's destination and source (made once
    per plan: the plan keeps the memory behind both alive)."""
    dst, src, size = span
    kind = ctypes.c_char * size
    return memoryview(kind.from_address(dst)).cast("B"), memoryview(kind.from_address(src)).cast("B")


def _split(spans: list[Span], total: int, parts: int) -> list[list[Span]]:
    """Cut a list of (dst, src, size) copies into ``parts`` lists of about equal bytes."""
    share = -(-total // parts)
    out: list[list[Span]] = [[]]
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


def _wait_for(helper: threading.Thread, began: threading.Event, done: threading.Event) -> None:
    # ``Thread.join()`` is not used: on Python 3.11 a KeyboardInterrupt that
    # lands inside it can mark a still running thread as stopped, and every
    # later join then returns at once. Events survive an interruption and
    # are simply waited on again.
    if not began.wait(0.1) and helper not in threading.enumerate():
        # Interrupted inside ``start()`` before the thread was made: it
        # never runs.
        return
    if not began.wait(10.0):
        # Interrupted between ``start()`` listing the thread and making it
        # (a few bytecodes): it never runs either.
        return
    done.wait()
    # The job is over; wait for the thread itself to leave (microseconds),
    # so none is found running after the copy returned.
    while helper in threading.enumerate():
        time.sleep(0.0005)


def _join_all(helpers: Iterable[tuple[threading.Thread, threading.Event, threading.Event]]) -> None:
    """Wait for every helper that began, even when interrupted meanwhile;
    then re-raise the interruption."""
    interruption: BaseException | None = None
    for helper, began, done in helpers:
        while True:
            try:
                _wait_for(helper, began, done)
                break
            except BaseException as exc:  # KeyboardInterrupt: the work still runs, wait for it
                interruption = interruption or exc
    if interruption is not None:
        raise interruption


def _helper(
    job: Callable[[], None], began: threading.Event, done: threading.Event, keep_alive: object
) -> None:
    # ``keep_alive`` holds the tensors behind the job's raw addresses for as
    # long as it runs: their memory cannot be freed or unmapped under it.
    began.set()
    try:
        job()
    finally:
        done.set()


def run_on_threads(
    jobs: Sequence[Callable[[], None]], keep_alive: object = None, name: str = "weightsync-copy"
) -> None:
    """Run ``jobs[0]`` on the calling thread and each other job on a helper
    thread of its own; return once every job ended. An interruption
    (KeyboardInterrupt) is raised only after every helper ended, so no job
    touches memory its owner believes is free again."""
    helpers: list[tuple[threading.Thread, threading.Event, threading.Event]] = []
    try:
        for job in jobs[1:]:
            began, done = threading.Event(), threading.Event()
            helper = threading.Thread(
                target=_helper, args=(job, began, done, keep_alive), name=name, daemon=True
            )
            helpers.append((helper, began, done))
            helper.start()
        if jobs:
            jobs[0]()
    finally:
        _join_all(helpers)


def split_evenly(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut the items of ``sizes`` into at most ``parts`` runs ``[lo, hi)`` of
    consecutive items with about equal sums."""
    total = sum(sizes)
    share = max(1, -(-total // max(parts, 1)))
    runs: list[tuple[int, int]] = []
    lo, acc = 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= share and len(runs) < parts - 1:
            runs.append((lo, i + 1))
            lo, acc = i + 1, 0
    if lo < len(sizes) or not runs:
        runs.append((lo, len(sizes)))
    return runs


# (Unbound: mapped over a plan's tensors, one C call each, no Python frame.)
_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_is_conj = torch.Tensor.is_conj


def check_same_layout(dst: torch.Tensor, src: torch.Tensor) -> None:
    """:raises ValueError: the two differ in shape or dtype. Raw copies
    trust sizes: never make one between tensors that differ."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"cannot copy {src.dtype}{tuple(src.shape)} into {dst.dtype}{tuple(dst.shape)}")


class _Side:
    """One side of a copy plan: its tensors, kept alive with the plan (it
    holds raw addresses), and what the plan relies on about them."""

    def __init__(self, tensors: Sequence[torch.Tensor], byte_copied: list[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self._where = list(map(_data_ptr, self.tensors))
        # Those copied byte for byte must stay plain: the same bytes viewed
        # with other strides (or, complex, as their conjugate) at the same
        # address would read them otherwise. (Only a complex tensor can
        # turn conjugate with its dtype unchanged.)
        self._plain = byte_copied
        self._complex = [t for t in byte_copied if t.is_complex()]

    def unchanged(self) -> bool:
        """Whether every tensor's data is where it was, and those copied
        byte for byte are plain still. (Shapes and dtypes are the callers'
        to check: a plan is made for one layout.)"""
        return (
            list(map(_data_ptr, self.tensors)) == self._where
            and all(map(_is_contiguous, self._plain))
            and not any(map(_is_conj, self._complex))
        )


class CopyPlan:
    """A copy of ``sources`` into ``destinations`` (same shapes and dtypes),
    worked out once and run as often as the tensors stay the same.

    Contiguous CPU pairs become byte copies, run on up to ``threads`` threads
    for large totals (a pair over the same bytes is left out); anything
    else (strided views, other devices) goes through torch.
    """

    def __init__(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        self.spans: list[Span] = []
        self.total = 0
        self.slow_dst: list[torch.Tensor] = []
        self.slow_src: list[torch.Tensor] = []
        plain_dst: list[torch.Tensor] = []
        plain_src: list[torch.Tensor] = []
        for dst, src in zip(destinations, sources, strict=True):
            check_same_layout(dst, src)
            if plain(dst) and plain(src):
                plain_dst.append(dst)
                plain_src.append(src)
                size = dst.numel() * dst.element_size()
                # (A pair over the same bytes holds them already: a sender
                # group's rank 0 sends from the buffer its ranks wrote.)
                if size and dst.data_ptr() != src.data_ptr():
                    self.spans.append((dst.data_ptr(), src.data_ptr(), size))
                    self.total += size
            else:
                self.slow_dst.append(dst)
                self.slow_src.append(src)
        # Run on one thread: the small spans through byte views, the others by memmove.
        viewed = self.total <= PARALLEL_COPY_BYTES
        self._views = [_byte_views(span) for span in self.spans if viewed and span[2] <= _VIEW_SPAN]
        self._moves = [span for span in self.spans if not viewed or span[2] > _VIEW_SPAN]
        self._sides = (_Side(destinations, plain_dst), _Side(sources, plain_src))

    def still_valid(self, *, sources: bool = False) -> bool:
        """False if a destination's data (with ``sources``, also a source's)
        moved since the plan was made (e.g. ``param.data = other``), or one
        copied byte for byte is no longer plain (the same bytes viewed with
        other strides): the plan must then be made again."""
        return self._sides[0].unchanged() and (not sources or self._sides[1].unchanged())

    def run(self, threads: int = 1) -> None:
        """Copy every byte; blocks until done, and an interruption
        (KeyboardInterrupt) is raised only once every helper thread ended."""
        parts = max(1, min(threads, self.total // PARALLEL_COPY_BYTES))
        if parts == 1:
            for dst, src in self._views:
                dst[:] = src
            _memmove_spans(self._moves)
        else:
            shares = _split(self.spans, self.total, parts)
            run_on_threads([functools.partial(_memmove_spans, share) for share in shares], self._sides)
        if self.slow_dst:
            with torch.inference_mode():
                torch._foreach_copy_(self.slow_dst, self.slow_src)


class PlanCache:
    """The copy plan of the last (destinations, sources) pair, made again
    when either list is another object, or a tensor's data moved
    (``param.data = other``; with ``sources_move``, a source's too).

    Callers pass the same list objects for as long as neither side changes
    (a reader's views of a segment, a worker's targets, a sender's last read
    of its model), so identity tells when to plan again; the cache holds
    both lists, so that identity cannot be a new list's."""

    def __init__(self, *, sources_move: bool = False) -> None:
        self._sources_move = sources_move
        self._last: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], CopyPlan] | None = None

    def plan(
        self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], *, unmoved: bool = False
    ) -> CopyPlan:
        """The plan for these lists. ``unmoved``: the caller checked, just
        now, that no tensor of either list moved since it last passed them
        (a sender's read of its model checks every tensor's address): they
        are not asked again."""
        last = self._last
        if (
            last is None
            or last[0] is not destinations
            or last[1] is not sources
            or (not unmoved and not last[2].still_valid(sources=self._sources_move))
        ):
            last = self._last = (destinations, sources, CopyPlan(destinations, sources))
        return last[2]

    def clear(self) -> None:
        self._last = None


def copy_tensors(
    destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], *, threads: int = 1
) -> None:
    """Copy ``sources`` into ``destinations`` once (see :class:`CopyPlan`)."""
    CopyPlan(destinations, sources).run(threads)


# torch runs an element-wise op on the calling thread alone below this many
# elements (``at::internal::GRAIN_SIZE``), on its intra-op pool above it.
_TORCH_GRAIN = 32768


def _cast_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.inference_mode():
        for dst, src in pieces:
            dst.copy_(src)


class WireCast:
    """Casts a send's float32 tensors to ``dtype`` (``torch.bfloat16``, say)
    into buffers of its own, reused from send to send, exactly as
    ``tensor.to(dtype)`` would (round to nearest even).

    The cast runs in pieces small enough that torch does each on the calling
    thread, spread over threads of weightsync's: never on torch's intra-op
    pool, whose threads belong to the caller's own work. A tensor on a GPU
    is cast there, into a buffer on its GPU, on the caller's stream (so it
    follows the work the caller enqueued before, and what reads the cast
    on that stream follows it): the stagings then move half the bytes.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if not dtype.is_floating_point or dtype.itemsize >= 4:
            raise ValueError(f"wire_dtype must be a floating dtype narrower than float32, not {dtype}")
        self.dtype = dtype
        self._buffers: dict[int, torch.Tensor] = {}
        # The list the last cast returned.
        self._out: list[torch.Tensor] = []

    def wire_dtype_of(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor of ``dtype`` travels as (only float32 is cast)."""
        return self.dtype if dtype == torch.float32 else dtype

    def cast(
        self, tensors: Sequence[torch.Tensor], threads: int = 1, stream: Any = None, *, keep: bool = False
    ) -> list[torch.Tensor]:
        """``tensors`` with every float32 one replaced by its cast (a buffer
        of this object's, valid until the next call). ``stream``: the
        caller's CUDA stream, which casts on a GPU are enqueued on (None:
        that GPU's current stream); they are not waited for. ``keep``:
        ``tensors`` is a read kept from send to send (a module's), and so
        may the list returned be: the same list object while the same
        buffers and tensors make it up (a copy plan kept for it stays).
        Blocks for the casts in host memory; an interruption is raised only
        once every helper thread ended."""
        out: list[torch.Tensor] = []
        last = self._out
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, tensor in enumerate(tensors):
            if tensor.dtype != torch.float32:
                out.append(tensor)
                continue
            buffer = self._buffers.get(index)
            if buffer is None or buffer.shape != tensor.shape or buffer.device != tensor.device:
                buffer = torch.empty(tensor.shape, dtype=self.dtype, device=tensor.device)
                self._buffers[index] = buffer
            out.append(buffer)
            if tensor.is_cuda:
                with on_stream(gpu_stream(stream, tensor.device)), torch.inference_mode():
                    buffer.copy_(tensor.detach())
                continue
            flat_dst, flat_src = buffer.reshape(-1), tensor.detach().reshape(-1)
            for a in range(0, flat_src.numel(), _TORCH_GRAIN):
                pieces.append((flat_dst[a : a + _TORCH_GRAIN], flat_src[a : a + _TORCH_GRAIN]))
        parts = max(1, min(threads, len(pieces) * _TORCH_GRAIN * 4 // PARALLEL_COPY_BYTES))
        shares = [pieces[i::parts] for i in range(parts)]
        run_on_threads([functools.partial(_cast_pieces, share) for share in shares], (tensors, out))
        if not keep:
            self._out = []  # (the caller's own tensors are not held past its send)
            return out
        if len(out) == len(last) and all(a is b for a, b in zip(out, last, strict=True)):
            return last
        self._out = out
        return out


def byte_view(tensor: torch.Tensor) -> Any:
    """``tensor``'s bytes as a flat numpy ``uint8`` array, without a copy
    when it is a plain contiguous CPU tensor (else of a dense CPU copy)."""
    t = tensor.detach()
    if not plain(t):
        t = t.cpu().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def check_writable_in_place(
    tensors: Iterable[tuple[str, torch.Tensor]], *, model_id: str | None = None, where: str = ""
) -> None:
    """:raises WeightMismatchError: a tensor cannot be written in place (not
    dense, or its elements overlap in memory: an expanded or broadcast view)."""
    for name, tensor in tensors:
        if tensor.layout != torch.strided or torch._debug_has_internal_overlap(tensor) == 1:
            raise WeightMismatchError(
                f"{name!r}{where} cannot be written in place: its elements overlap in memory "
                "(an expanded or broadcast tensor)",
                model_id=model_id,
            )


# The cores this process may run on, and when they were last asked for:
# every send asks (its copy threads, each worker's share), and the answer
# is a system call; it changes only when someone sets the affinity.
_CORES: tuple[int, float] = (0, -1.0)
_CORES_FOR = 1.0  # seconds


def usable_cores() -> int:
    """Cores this process may run on (asked of the kernel at most once a second)."""
    global _CORES
    count, asked = _CORES
    now = time.monotonic()
    if now - asked < _CORES_FOR:
        return count
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    _CORES = (count, now)
    return count
