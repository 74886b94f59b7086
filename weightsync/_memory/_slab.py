"""Device slabs: GPU memory that the trainer stages into and workers on
GPUs copy out of, shared once through CUDA IPC.

A slab is one ``cudaMalloc`` block on the trainer's GPU, allocated once per
size, exported once per worker process (torch's CUDA reductions give the IPC
handle and count who holds it), opened once per worker process and cached
by its token. Its published version
lives in host memory, in a header-only :class:`~weightsync._memory._segment.Segment`,
so a device slab is read under the same version check as a host segment: a
reader checks the published version before its copy and again once its
copy has finished (its stream synchronized), and discards a copy that the
next send overwrote meanwhile.

The trainer publishes a version only once its copy into the slab has
completed on the GPU (it waits on an event recorded on its stream after the
copy), so a worker needs no interprocess event: torch's own IPC rebuild
waits on the producer's event only when a storage is first opened, and a
slab is opened once, so relying on it would be wrong from the second send
on.

Within one process (the in-process scheme) a reader takes the slab's tensor
itself: CUDA cannot open an IPC handle in the process that exported it.

A GPU is named by its UUID (``_placement.device_name``): a worker maps the
UUID to its own device index, which differs from the trainer's under
another ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .._exceptions import ResourceExhaustedError, out_of_resources
from .._packet import Manifest
from ._placement import device_name, on_stream
from ._segment import Segment, SegmentRef
from ._views import LayoutViews

__all__ = ["AttachedSlabs", "DeviceSlab", "SlabRef", "copy_on_stream", "local_index"]


class SlabRef(NamedTuple):
    """What a worker needs to open a sender's device slab: small, picklable."""

    #: The host header holding the slab's published version.
    header: SegmentRef
    #: The slab's GPU, as ``_placement.device_name`` names it (by UUID).
    device: str
    #: torch's CUDA IPC reduction of the slab (pickled ``(rebuild, args)``).
    handle: bytes
    nbytes: int
    token: bytes
    #: Device slots (the shared scheme): the tokens of every slot the
    #: sender still keeps, so a worker lets go of the others; a worker on
    #: the slab's GPU may run on a slot (re-point its parameters to it).
    #: None: a single slab, which workers copy out of.
    live: tuple[bytes, ...] | None = None


def local_index(device: str) -> int:
    """This process's index of the GPU named ``device`` (``cuda:GPU-...``).

    :raises ValueError: no GPU of that UUID is visible to this process.
    """
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            if device_name(torch.device("cuda", index)) == device:
                return index
    raise ValueError(
        f"the trainer stages on the GPU {device.removeprefix('cuda:')}, which this process cannot "
        "see (CUDA_VISIBLE_DEVICES); a worker on a GPU must see the trainer's GPU"
    )


def copy_on_stream(
    destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], stream: torch.cuda.Stream
) -> None:
    """Enqueue the copies of ``sources`` into ``destinations`` on ``stream``
    and wait until they are done (only this stream, not the whole device)."""
    with on_stream(stream), torch.inference_mode():
        torch._foreach_copy_(list(destinations), list(sources), non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()


class DeviceSlab:
    """The sender's slab on one GPU: written with :meth:`write`, exported
    with :meth:`ref`, freed with :meth:`close`."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self.token = secrets.token_bytes(16)
        with out_of_resources(f"allocate a staging slab of {nbytes} bytes on {device}"):
            self.data: torch.Tensor | None = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        try:
            self.header = Segment.create(0)
        except BaseException:
            self.data = None
            raise
        # One export per worker process (see ref).
        self._refs: dict[int, SlabRef] = {}
        _MINE[self.token] = self

    def write(
        self, views: list[torch.Tensor], sources: Sequence[torch.Tensor], version: int, stream: Any
    ) -> None:
        """Copy ``sources`` into ``views`` (of this slab) on ``stream`` (the
        trainer's, so the copy follows the work it enqueued before), wait
        for the copy, and publish ``version``. Blocks the calling thread
        for the copy."""
        self.header.begin_write()
        copy_on_stream(views, sources, stream)
        self.header.publish(version)

    def ref(self, worker_id: int) -> SlabRef:
        """How worker ``worker_id`` opens this slab; made once per worker
        process (:meth:`forget` when a new process takes the id).

        Each export carries a reference count that torch sets to one and
        the one process that opens it takes back when it lets go; the
        block is freed once every export is back. An export shared by two
        processes would be taken back twice and never free the block."""
        ref = self._refs.get(worker_id)
        if ref is None:
            assert self.data is not None, "the slab is closed"
            from torch.multiprocessing.reductions import reduce_tensor

            # Every update to this worker carries the same handle, and it
            # opens it once (AttachedSlabs caches it by token).
            handle = pickle.dumps(reduce_tensor(self.data))
            ref = SlabRef(self.header.ref(), device_name(self.device), handle, self.nbytes, self.token)
            self._refs[worker_id] = ref
        return ref

    def forget(self, worker_id: int) -> None:
        """Worker ``worker_id`` is a new process (or gone): its next
        :meth:`ref` is a new export."""
        self._refs.pop(worker_id, None)

    def close(self) -> None:
        """Free the slab (torch keeps the block until every worker that
        opened it let go) and its header. Idempotent."""
        self.data = None
        self._refs = {}
        _MINE.pop(self.token, None)
        self.header.close()


#: The slabs this process made, by token: a reader in the same process (the
#: in-process scheme) takes the tensor itself, as CUDA cannot open an IPC
#: handle in the process that exported it.
_MINE: weakref.WeakValueDictionary[bytes, DeviceSlab] = weakref.WeakValueDictionary()


class _Opened(NamedTuple):
    header: Segment
    data: torch.Tensor


def _rebuild(ref: SlabRef) -> torch.Tensor:
    """Open the slab ``ref`` names (its IPC handle), on this process's index
    of its GPU.

    :raises ResourceExhaustedError: the GPU is not visible here, or CUDA
        could not open the handle (out of memory, a broken context): the
        update is refused with this reason, the model untouched.
    """
    mine = _MINE.get(ref.token) if ref.header.pid == os.getpid() else None
    if mine is not None and mine.data is not None:
        return mine.data
    try:
        index = local_index(ref.device)
        rebuild, args = pickle.loads(ref.handle)
        args = list(args)
        # torch's reduction names the trainer's device index (its 7th
        # argument); this process's index of the same GPU may differ.
        if len(args) > 6 and isinstance(args[6], int):
            args[6] = index
        with torch.cuda.device(index):
            return rebuild(*args)
    except (RuntimeError, ValueError) as exc:
        memory = isinstance(exc, torch.cuda.OutOfMemoryError)
        raise ResourceExhaustedError(
            f"cannot open the trainer's staging slab on {ref.device}: {exc}",
            resource="GPU memory" if memory else "a GPU it can open",
        ) from exc


class AttachedSlabs:
    """A worker's opened slabs, with typed views cached per layout: the
    newest only for a single slab (the sender keeps one per GPU), those the
    sender still keeps for device slots (``SlabRef.live``), so that a slot
    used again is not opened again."""

    def __init__(self) -> None:
        self._opened: dict[bytes, _Opened] = {}
        self._views = LayoutViews()

    def _open(self, ref: SlabRef) -> _Opened:
        opened = self._opened.get(ref.token)
        if opened is None:
            # A new slab replaces the last (the sender grew it); the slots
            # the sender let go of are let go of here too.
            self.retain(ref.live or ())
            header = Segment.attach(*ref.header)
            try:
                data = _rebuild(ref)
            except BaseException:
                header.close()
                raise
            opened = self._opened[ref.token] = _Opened(header, data)
        return opened

    def published(self, ref: SlabRef) -> int:
        """The version the slab holds now (-1 while the sender writes it).

        :raises OSError: the sender is gone.
        :raises ValueError: the descriptor names another segment now.
        :raises ResourceExhaustedError: the slab cannot be opened here (see
            ``_rebuild``).
        """
        return self._open(ref).header.published()

    def views(self, ref: SlabRef, manifest: Manifest) -> list[torch.Tensor]:
        """Typed views (on the slab's GPU) of ``manifest``'s tensors; the
        same list object for as long as the slab and layout stay."""
        return self._views.of(ref.token, manifest, lambda: self._open(ref).data)

    def retain(self, tokens: Sequence[bytes]) -> None:
        """Let go of every slab but those of ``tokens`` (torch closes an IPC
        mapping once no view of it is left: a tensor still running on a
        slab keeps it mapped)."""
        gone = [token for token in self._opened if token not in tokens]
        if not gone:
            return
        self._views.forget_all_but(tokens)
        for token in gone:
            with contextlib.suppress(Exception):
                self._opened.pop(token).header.close()

    def close(self) -> None:
        """Let go of every slab. Idempotent."""
        self.retain(())
