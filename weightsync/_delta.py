"""Lossless delta frames of staged weights: what changed since a base version.

Between two RL steps most of a model's bytes do not change (in the bf16
cast of an fp32 master, a few percent of the elements per step), so a send
can carry only the difference from the last version every receiver holds.
This module is the codec only; the transports decide who holds which base
and when a worker must get the full bytes instead.

The staged bytes are cut into chunks (``_frames.frame_spans``); each chunk
becomes one self-describing *frame*: a fixed :data:`HEADER` (mode, element
size, raw length, payload length, XXH3-64 digest of the chunk's bytes), then
the payload. A receiver reads :data:`HEADER_SIZE` bytes, learns the payload's
length, reads it, and decodes the chunk. Each chunk picks its mode:

``SAME``
    equal to the base chunk: no payload.
``SPARSE``
    few elements changed: a bitmap of the changed elements and the XOR of
    each changed element with its base, both compressed. On the measured
    update trajectories this beats both the index/value format (an index
    and a value per changed element) and the dense mode at every bf16
    learning rate measured (``benchmarks/delta_codec.py``).
``DENSE``
    the XOR with the base chunk, split into byte planes (blosc2's shuffle,
    by the element size: equal exponents and high mantissa bytes XOR to
    zero planes), compressed with zstd level 1.
``PACKED``
    no base (a worker that needs the full bytes): the chunk itself, byte
    planes, zstd level 1.
``RAW``
    the chunk's bytes, when encoding would not save at least
    ``1 - RAW_RATIO`` of them (random updates): an incompressible update
    costs a header per chunk and the time to find out, nothing more. A
    dense chunk whose first :data:`PROBE_BYTES` do not compress is not
    compressed further.

The compressor is blosc2 (the ``delta`` extra), zstd level 1 by default
(``compressor='lz4'``: about 3x faster to encode, frames up to 2x larger),
one thread per call; XOR, bitmaps and gathers are numpy. None of it runs on
torch's intra-op pool, which belongs to the user's collectors: work runs on
the calling thread, and :class:`DeltaEncoder` (``threads=N``) encodes up to
N chunks at once on threads of its own. Digests are XXH3-64 (``xxhash``,
also in the extra).

How a transport uses it::

    # trainer, once per model: +S for the base, + threads chunks of scratch
    encoder = DeltaEncoder(nbytes, element_size, chunk_bytes=chunk)
    # each send, after staging (send_async has returned):
    digest = version_digest(staged)          # goes with the notice
    for frame in encoder.frames(staged):     # full bytes while no base
        send(frame)                          # frame k+1 encodes while k goes
    # once every receiver of the send applied it (else keep the old base):
    encoder.commit(staged, version)

    # receiving host, in the buffer that holds its current version:
    decoder = DeltaDecoder(buffer, element_size, chunk_bytes=chunk)
    while not decoder.done:
        header = recv(HEADER_SIZE)
        decoder.feed(header + recv(read_header(header).payload_length))
    decoder.check(digest)                    # before any model is touched

A relay forwards frames as they are; :func:`read_header` tells it each
frame's length. Any :class:`DeltaFrameError` on a host means its buffer no
longer holds a base: it needs the full bytes (``frames(..., full=True)``).
"""

from __future__ import annotations

import concurrent.futures
import enum
import struct
from collections import deque
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

from ._digest import digests
from ._exceptions import DeltaFrameError, import_extra
from ._frames import CHUNK_BYTES, frame_spans

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "HEADER",
    "HEADER_SIZE",
    "PROBE_BYTES",
    "RAW_RATIO",
    "SPARSE_DENSITY",
    "DeltaDecoder",
    "DeltaEncoder",
    "FrameHeader",
    "Mode",
    "decode_frame",
    "encode_frame",
    "read_header",
    "require_codec",
    "version_digest",
]


#: A chunk is sent raw unless encoding makes it smaller than this fraction.
RAW_RATIO = 0.95

#: A chunk in which at most this fraction of the elements changed is sent
#: as a bitmap and values (``SPARSE``); denser ones as ``DENSE``. Measured
#: on bf16 casts of AdamW updates (16 MiB fp32 master), sparse against
#: dense: 0.105 against 0.144 S with 23% of the elements changed, 0.193
#: against 0.217 S with 49%, a tie at 77% (0.294 against 0.299 S): past
#: half, dense is as small and skips the bitmap and the gather.
SPARSE_DENSITY = 0.5

#: The frame header: mode, element size, reserved (0), raw length, payload
#: length, XXH3-64 of the decoded chunk. Little-endian, 20 bytes.
HEADER = struct.Struct("<BBHIIQ")
HEADER_SIZE = HEADER.size

#: A dense chunk whose first this many bytes do not compress is sent raw
#: without trying the rest (a multiple of every element size).
PROBE_BYTES = 64 << 10

#: ``'zstd'`` (level 1): the smaller frames, for links up to a few Gbit/s;
#: ``'lz4'``: about 3x faster to encode, frames up to 2x larger, for links
#: that outrun zstd (see ``benchmarks/delta_codec.py``).
Compressor = Literal["zstd", "lz4"]
_MASK_LENGTH = struct.Struct("<I")
# numpy's names of the unsigned dtypes, so that numpy (part of the delta
# extra) is imported only by the functions that use it.
_UINT = {1: "u1", 2: "u2", 4: "u4", 8: "u8"}


class Mode(enum.IntEnum):
    """How a frame's payload encodes its chunk (see the module's docstring)."""

    RAW = 0
    SAME = 1
    SPARSE = 2
    DENSE = 3
    PACKED = 4

    @property
    def needs_base(self) -> bool:
        """Whether decoding reads the base chunk."""
        return self in (Mode.SAME, Mode.SPARSE, Mode.DENSE)


class FrameHeader(NamedTuple):
    """A frame's header: the frame is ``HEADER_SIZE + payload_length``
    bytes and decodes to ``raw_length`` bytes whose XXH3-64 is ``digest``."""

    mode: Mode
    element_size: int
    raw_length: int
    payload_length: int
    digest: int


def require_codec() -> tuple[Any, Any]:
    """The blosc2 module and XXH3-64 function, imported on first use (with
    numpy, which the rest of this module imports where it uses it).

    :raises MissingExtraError: blosc2, xxhash or numpy is not installed; the
        message names the extra to install.
    """
    try:  # plain imports first: this runs once per chunk
        import blosc2
        import numpy  # noqa: F401
        import xxhash
    except ImportError:
        for module in ("blosc2", "xxhash", "numpy"):
            import_extra(module, extra="delta", needed_by="delta encoding (delta=True)")
        raise
    return blosc2, xxhash.xxh3_64_intdigest


def _flat_bytes(buffer: Any) -> np.ndarray:
    """A flat ``uint8`` numpy view of a tensor or buffer, never a copy (a
    decoder writes through it).

    :raises ValueError: not contiguous, or not on the CPU."""
    import numpy as np

    if isinstance(buffer, torch.Tensor):
        if not (buffer.is_cpu and buffer.is_contiguous()):
            raise ValueError("delta frames need a contiguous CPU tensor")
        return buffer.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("delta frames need a contiguous array")
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8)


def _compress(blosc2: Any, data: np.ndarray, typesize: int, shuffle: bool, compressor: Compressor) -> bytes:
    cparams = {
        "codec": blosc2.Codec.ZSTD if compressor == "zstd" else blosc2.Codec.LZ4,
        "clevel": 1,
        "typesize": typesize,
        "filters": [blosc2.Filter.SHUFFLE if shuffle else blosc2.Filter.NOFILTER],
        "nthreads": 1,
    }
    return bytes(blosc2.compress2(data, cparams=cparams))


def _decompress(blosc2: Any, payload: memoryview, out: np.ndarray) -> None:
    """Decompress a blosc2 frame of exactly ``out.nbytes`` bytes into ``out``.

    :raises DeltaFrameError: the frame is not one, or of another size.
    """
    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(payload)
        if nbytes != out.nbytes or cbytes != len(payload):
            raise DeltaFrameError(f"compressed block of {nbytes} bytes in {cbytes}, expected {out.nbytes}")
        blosc2.decompress2(payload, dst=out, dparams={"nthreads": 1})
    except (ValueError, RuntimeError) as exc:
        raise DeltaFrameError(f"undecodable delta frame: {exc}") from exc


def encode_frame(
    current: np.ndarray,
    base: np.ndarray | None,
    element_size: int,
    scratch: np.ndarray | None = None,
    compressor: Compressor = "zstd",
) -> bytes:
    """One frame for ``current`` (a chunk's bytes, ``uint8``): against
    ``base`` (the same chunk of the base version) when given, else the full
    bytes. ``scratch``, at least as long as ``current``, spares an
    allocation. Blocks the calling thread; touches neither input.

    :raises MissingExtraError: the delta extra is not installed.
    """
    blosc2, xxh3 = require_codec()
    import numpy as np

    size = current.nbytes
    digest = xxh3(current)
    # A tail that is not a multiple of the element size is split by bytes.
    item = element_size if size % element_size == 0 and element_size in _UINT else 1
    if base is None:
        if not _worth_trying(blosc2, current, item, compressor):
            return _raw(item, digest, current)
        packed = _compress(blosc2, current, item, shuffle=True, compressor=compressor)
        return _frame(Mode.PACKED, item, size, digest, packed, current)
    if base.nbytes != size:
        raise ValueError(f"base chunk of {base.nbytes} bytes for a chunk of {size}")
    delta = np.bitwise_xor(current, base, out=None if scratch is None else scratch[:size])
    elements = delta.view(_UINT[item])
    nonzero = elements != 0
    changed = int(np.count_nonzero(nonzero))
    if changed == 0:
        return HEADER.pack(Mode.SAME, item, 0, size, 0, digest)
    if changed <= SPARSE_DENSITY * elements.size:
        # Indices then take(): numpy's boolean gather is twice as slow.
        values = elements.take(np.flatnonzero(nonzero))
        bitmap = _compress(blosc2, np.packbits(nonzero), 1, shuffle=False, compressor=compressor)
        payload = (
            _MASK_LENGTH.pack(len(bitmap))
            + bitmap
            + _compress(blosc2, values, item, shuffle=True, compressor=compressor)
        )
        return _frame(Mode.SPARSE, item, size, digest, payload, current)
    if not _worth_trying(blosc2, delta, item, compressor):
        return _raw(item, digest, current)
    return _frame(
        Mode.DENSE,
        item,
        size,
        digest,
        _compress(blosc2, delta, item, shuffle=True, compressor=compressor),
        current,
    )


def _worth_trying(blosc2: Any, data: np.ndarray, item: int, compressor: Compressor) -> bool:
    """Whether the first :data:`PROBE_BYTES` of a large chunk compress.

    Random-looking bytes are then sent raw without compressing all of them,
    so an incompressible update costs a fraction of an encode, not a whole
    one. A chunk that is random only past its sample is still caught by
    :func:`_frame`."""
    if data.nbytes < 4 * PROBE_BYTES:
        return True
    sample = _compress(blosc2, data[:PROBE_BYTES], item, shuffle=True, compressor=compressor)
    return len(sample) < RAW_RATIO * PROBE_BYTES


def _raw(item: int, digest: int, current: np.ndarray) -> bytes:
    return HEADER.pack(Mode.RAW, item, 0, current.nbytes, current.nbytes, digest) + current.tobytes()


def _frame(mode: Mode, item: int, size: int, digest: int, payload: bytes, current: np.ndarray) -> bytes:
    if len(payload) >= RAW_RATIO * size:
        return _raw(item, digest, current)
    return HEADER.pack(mode, item, 0, size, len(payload), digest) + payload


def read_header(frame: Any) -> FrameHeader:
    """The header at the start of ``frame`` (at least :data:`HEADER_SIZE`
    bytes); ``HEADER_SIZE + payload_length`` is the whole frame's size.

    :raises DeltaFrameError: too short, or not a header (unknown mode,
        impossible sizes).
    """
    view = memoryview(frame).cast("B")
    if len(view) < HEADER_SIZE:
        raise DeltaFrameError(f"a frame header is {HEADER_SIZE} bytes, got {len(view)}")
    code, item, reserved, size, length, digest = HEADER.unpack_from(view)
    try:
        mode = Mode(code)
    except ValueError:
        mode = None
    if mode is None or item not in _UINT or reserved != 0:
        raise DeltaFrameError(f"not a delta frame header (mode {code}, element size {item})")
    if (mode is Mode.RAW and length != size) or (mode is Mode.SAME and length != 0) or size % item:
        raise DeltaFrameError(f"impossible frame: {mode.name}, {size} bytes in {length}")
    return FrameHeader(mode, item, size, length, digest)


def decode_frame(frame: Any, out: np.ndarray) -> FrameHeader:
    """Decode ``frame`` (header and payload) into ``out``, the chunk's
    ``uint8`` bytes, in place: for the modes that need a base
    (:attr:`Mode.needs_base`), ``out`` must hold the base chunk on entry.
    Checks the digest of the result. Blocks the calling thread.

    :raises DeltaFrameError: a damaged or misplaced frame (bad header,
        payload of the wrong length, undecodable payload, a chunk of
        another length than ``out``), or a result whose digest differs
        from the trainer's (a damaged payload, or ``out`` did not hold the
        base the frame was taken against). After an error the bytes of
        ``out`` are undefined: the base is lost.
    """
    blosc2, xxh3 = require_codec()
    import numpy as np

    view = memoryview(frame).cast("B")
    head = read_header(view)
    if head.raw_length != out.nbytes:
        raise DeltaFrameError(f"a frame of a {head.raw_length}-byte chunk for a {out.nbytes}-byte one")
    if len(view) != HEADER_SIZE + head.payload_length:
        raise DeltaFrameError(f"frame of {len(view)} bytes, header says {HEADER_SIZE + head.payload_length}")
    payload = view[HEADER_SIZE:]
    if head.mode is Mode.RAW:
        out[:] = np.frombuffer(payload, dtype=np.uint8)
    elif head.mode in (Mode.PACKED, Mode.DENSE):
        if head.mode is Mode.PACKED:
            _decompress(blosc2, payload, out)
        else:
            delta = np.empty_like(out)
            _decompress(blosc2, payload, delta)
            np.bitwise_xor(out, delta, out=out)
    elif head.mode is Mode.SPARSE:
        _apply_sparse(blosc2, payload, out.view(_UINT[head.element_size]))
    if xxh3(out) != head.digest:
        raise DeltaFrameError(f"decoded {head.mode.name} chunk differs from the trainer's (digest mismatch)")
    return head


def _apply_sparse(blosc2: Any, payload: memoryview, elements: np.ndarray) -> None:
    import numpy as np

    if len(payload) < _MASK_LENGTH.size:
        raise DeltaFrameError("sparse frame too short")
    (mask_length,) = _MASK_LENGTH.unpack_from(payload)
    start = _MASK_LENGTH.size
    if start + mask_length > len(payload):
        raise DeltaFrameError("sparse frame's bitmap runs past its end")
    packed = np.empty((elements.size + 7) // 8, dtype=np.uint8)
    _decompress(blosc2, payload[start : start + mask_length], packed)
    # flatnonzero of a bool view: six times faster than of the uint8 bits.
    changed = np.flatnonzero(np.unpackbits(packed, count=elements.size).view(np.bool_))
    values = np.empty(changed.size, dtype=elements.dtype)
    _decompress(blosc2, payload[start + mask_length :], values.view(np.uint8))
    elements[changed] ^= values


class DeltaEncoder:
    """The trainer's side: holds one base copy (``nbytes``, +S of memory) of
    the last version every receiver applied, and encodes staged versions
    against it, chunk by chunk.

    Not thread-safe: one send at a time. The encoder never reads torch's
    intra-op pool; with ``threads > 1`` it encodes up to ``threads`` chunks
    at once on threads of its own, started and ended within each
    :meth:`frames` iteration.
    """

    def __init__(
        self,
        nbytes: int,
        element_size: int,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        threads: int = 1,
        compressor: Compressor = "zstd",
    ) -> None:
        """:raises MissingExtraError: the delta extra is not installed.
        :raises ValueError: a size that is not positive."""
        require_codec()
        self.nbytes = nbytes
        self.element_size = element_size
        self.spans = frame_spans(nbytes, chunk_bytes, element_size)
        self.threads = max(1, threads)
        self.compressor: Compressor = compressor
        self._base: np.ndarray | None = None
        self.base_version: int | None = None

    @property
    def has_base(self) -> bool:
        """Whether a base is held (else every frame carries the full bytes)."""
        return self._base is not None

    def frames(self, current: Any, *, full: bool = False) -> Generator[bytes, None, None]:
        """Yield one frame per chunk of ``current`` (a flat buffer or CPU
        tensor of ``nbytes`` bytes, read while iterating: it must not change
        until the iteration ends), in chunk order: against the base, or the
        full bytes (``PACKED``/``RAW``) when there is none or with ``full``.
        Each ``next()`` blocks until that chunk is encoded; a chunk is
        encoded while the caller sends the previous one when
        ``threads > 1``. Closing the iterator early waits for the chunks in
        progress.

        :raises ValueError: ``current`` is not ``nbytes`` long.
        """
        data = _flat_bytes(current)
        if data.nbytes != self.nbytes:
            raise ValueError(f"{data.nbytes} bytes staged for an encoder of {self.nbytes}")
        import numpy as np

        base = None if full else self._base
        size = self.spans[0][1] - self.spans[0][0] if self.spans else 0

        def encode(index: int, scratch: np.ndarray) -> bytes:
            start, stop = self.spans[index]
            chunk = data[start:stop]
            before = None if base is None else base[start:stop]
            return encode_frame(chunk, before, self.element_size, scratch, self.compressor)

        if self.threads == 1:
            scratch = np.empty(size, dtype=np.uint8)
            for index in range(len(self.spans)):
                yield encode(index, scratch)
            return
        # Each thread owns a scratch; at most ``threads`` chunks in flight.
        scratches = [np.empty(size, dtype=np.uint8) for _ in range(self.threads)]
        pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="weightsync-delta")
        pending: deque[concurrent.futures.Future[bytes]] = deque()
        try:
            submitted = 0
            for _ in range(len(self.spans)):
                while submitted < len(self.spans) and len(pending) < self.threads:
                    pending.append(pool.submit(encode, submitted, scratches[submitted % self.threads]))
                    submitted += 1
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True)

    def commit(self, current: Any, version: int | None = None) -> None:
        """Make ``current`` (the version just sent, still staged) the base:
        call once every receiver of the send applied it. Allocates the base
        on first use. Blocks for one copy of ``nbytes``.

        :raises ValueError: ``current`` is not ``nbytes`` long.
        """
        data = _flat_bytes(current)
        if data.nbytes != self.nbytes:
            raise ValueError(f"{data.nbytes} bytes staged for an encoder of {self.nbytes}")
        if self._base is None:
            import numpy as np

            self._base = np.empty(self.nbytes, dtype=np.uint8)
        self._base[:] = data
        self.base_version = version

    def adopt(self, current: Any, version: int | None = None) -> np.ndarray | None:
        """Make ``current`` the base without copying it, as :meth:`commit`
        does with a copy: the encoder keeps ``current``'s memory (the
        caller must not write it again) and hands back the previous base's
        array (None: there was none), which the caller may reuse, e.g. as
        the buffer it stages the next version in.

        :raises ValueError: ``current`` is not ``nbytes`` long.
        """
        data = _flat_bytes(current)
        if data.nbytes != self.nbytes:
            raise ValueError(f"{data.nbytes} bytes staged for an encoder of {self.nbytes}")
        previous, self._base, self.base_version = self._base, data, version
        return previous

    def forget(self) -> None:
        """Drop the base (and its memory): the next send carries full bytes."""
        self._base = None
        self.base_version = None


class DeltaDecoder:
    """A receiving host's side: rebuilds a version, in place, in ``buffer``
    (a flat buffer or CPU tensor that holds the base the frames were taken
    against, or anything when every frame is full), from frames fed in
    chunk order. Costs no memory beyond ``buffer`` and one chunk.
    """

    def __init__(
        self, buffer: Any, element_size: int, *, chunk_bytes: int = CHUNK_BYTES, base: Any = None
    ) -> None:
        """``base``: another buffer of the same size that holds the base
        (read only; each chunk a frame needs it for is copied into
        ``buffer`` first), when ``buffer`` does not hold it itself.

        :raises MissingExtraError: the delta extra is not installed.
        :raises ValueError: ``base`` is not as long as ``buffer``.
        """
        require_codec()
        self._data = _flat_bytes(buffer)
        self._base = None if base is None else _flat_bytes(base)
        if self._base is not None and self._base.nbytes != self._data.nbytes:
            raise ValueError(f"a base of {self._base.nbytes} bytes for a buffer of {self._data.nbytes}")
        self.spans = frame_spans(self._data.nbytes, chunk_bytes, element_size)
        self._next = 0

    @property
    def done(self) -> bool:
        """Whether every chunk has been decoded."""
        return self._next == len(self.spans)

    def feed(self, frame: Any) -> FrameHeader:
        """Decode the next chunk's frame into the buffer (see
        :func:`decode_frame`). Blocks the calling thread.

        :raises DeltaFrameError: a damaged frame, a frame past the last
            chunk, or a result that is not the trainer's; the buffer no
            longer holds the base.
        """
        if self.done:
            raise DeltaFrameError(f"a frame past the last of {len(self.spans)} chunks")
        start, stop = self.spans[self._next]
        out = self._data[start:stop]
        if self._base is not None and read_header(frame).mode.needs_base:
            out[:] = self._base[start:stop]
        head = decode_frame(frame, out)
        self._next += 1
        return head

    @property
    def decoded(self) -> int:
        """The leading bytes of the buffer rebuilt so far."""
        return self.spans[self._next - 1][1] if self._next else 0

    def check(self, expected: Sequence[int], threads: int = 1) -> None:
        """Check that the whole rebuilt version is the trainer's: its
        :func:`version_digest` equals ``expected``. Call before a worker's
        model is touched. Blocks the calling thread.

        :raises DeltaFrameError: chunks are missing, or a digest differs.
        """
        if not self.done:
            raise DeltaFrameError(f"{len(self.spans) - self._next} of {len(self.spans)} chunks never came")
        if version_digest(self._data, threads) != tuple(expected):
            raise DeltaFrameError("the rebuilt version differs from the trainer's (digest mismatch)")


def version_digest(buffer: Any, threads: int = 1) -> tuple[int, ...]:
    """The digest of a whole version's bytes: XXH3-64 of each 1 MiB block,
    the same digests as ``verify=True`` (``weightsync._digest``). The
    trainer sends it with a delta; a receiver compares it with that of what
    it rebuilt. Blocks the calling thread (about 16 GB/s a thread).

    :raises MissingExtraError: xxhash or numpy is not installed.
    """
    data = _flat_bytes(buffer)
    return digests([torch.from_numpy(data)], threads)
