"""Lossless delta frames of staged weights: what changed since a base version.

Between two RL steps most of a model's bytes do not change (in the bf16
cast of an fp32 master, a few percent of the elements per step), so a send
can carry only the difference from the last version every receiver holds.
This module is the codec only; the transports decide who holds which base
and when a worker must get the full bytes instead.

The staged bytes are cut into chunks (``_frames.frame_spans``); each chunk
becomes one self-describing *frame*: a fixed :data:`HEADER` (mode, element
size, format version, raw length, payload length, XXH3-64 digest of the
chunk's bytes), then the payload. A receiver reads :data:`HEADER_SIZE`
bytes, learns the payload's length, reads it, and decodes the chunk; a
frame of another format version is refused. Each chunk picks its mode:

``SAME``
    equal to the base chunk (one compare pass): no payload.
``SPARSE``
    few elements changed: the gaps between changed elements (a byte each,
    long ones in 4) and each changed element's difference from its base,
    zigzagged (a step of -1 is 1, +1 is 2), both compressed. The changed
    elements are found by one subtraction pass and a search of the 8-byte
    words that are not zero; only what changed is compressed.
``DENSE``
    the zigzagged difference of every element from its base, compressed.
``PACKED``
    no base (a worker that needs the full bytes): the chunk itself,
    compressed on bit planes.
``RAW``
    the chunk's bytes, when encoding would not save at least
    ``1 - RAW_RATIO`` of them (random updates): an incompressible update
    costs a header per chunk and the time to find out, nothing more. A
    dense chunk whose first :data:`PROBE_BYTES` do not compress is not
    compressed further.

The compressor is blosc2 (the ``delta`` extra), one thread per call, with
its own SIMD shuffles: LZ4 on bit or byte planes by default, zstd level 1
with ``compressor='zstd'`` (smaller frames, half the speed; see
:data:`Compressor`); subtraction, search and gathers are numpy. None of it
runs on torch's intra-op pool, which belongs to the user's collectors: work
runs on the calling thread, and :class:`DeltaEncoder` and
:class:`DeltaDecoder` (``threads=N``, :func:`default_threads` for a scheme
that does not say) work on up to N chunks at once on threads of their own,
with blosc2 told to release the GIL while it compresses. Most of a chunk's
numpy steps hold the GIL, or take it back between short calls, so threads
gain less than cores (``benchmarks/delta_codec.py --threads``). Digests
are XXH3-64 (``xxhash``, also in the extra).

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
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar

import torch

from ._copy import usable_cores
from ._digest import digests
from ._exceptions import DeltaFrameError, import_extra
from ._frames import CHUNK_BYTES, frame_spans

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "FORMAT",
    "HEADER",
    "HEADER_SIZE",
    "PROBE_BYTES",
    "RAW_RATIO",
    "SPARSE_DENSITY",
    "DeltaDecoder",
    "DeltaEncoder",
    "FrameHeader",
    "Mode",
    "check_delta",
    "decode_frame",
    "default_threads",
    "encode_frame",
    "read_header",
    "require_codec",
    "version_digest",
]


T = TypeVar("T")

#: A chunk is sent raw unless encoding makes it smaller than this fraction.
RAW_RATIO = 0.95

#: A chunk in which at most this fraction of the elements changed is sent
#: as positions and values (``SPARSE``); denser ones as ``DENSE``. Measured
#: on bf16 casts of AdamW updates (``benchmarks/delta_codec.py
#: --crossover --size 16``), sparse against dense: 0.137 against 0.201 S
#: with 23% of the elements changed, 0.266 against 0.293 S with 49%, a tie
#: at 77% (0.407 against 0.404 S): past half, dense is as small and skips
#: the search and the gathers.
SPARSE_DENSITY = 0.5

#: The version of the frame format, in every header: a frame of another
#: version (another release of weightsync) is refused, never misread.
FORMAT = 1

#: The frame header: mode, element size, format (:data:`FORMAT`), reserved
#: (0), raw length, payload length, XXH3-64 of the decoded chunk.
#: Little-endian, 20 bytes.
HEADER = struct.Struct("<BBBBIIQ")
HEADER_SIZE = HEADER.size

#: A dense chunk whose first this many bytes do not compress is sent raw
#: without trying the rest (a multiple of every element size).
PROBE_BYTES = 64 << 10

#: The compressor of every payload. ``'lz4'`` (the default): LZ4 on bit
#: planes (byte planes for dense chunks of wider elements), about 2 GB/s of
#: a sparse bf16 update per core; ``'zstd'``: zstd level 1 on byte planes,
#: frames a sixth to a quarter smaller at 0.4 to 0.75 times the speed, for
#: links much slower than the encoding cores (``benchmarks/delta_codec.py``).
Compressor = Literal["zstd", "lz4"]
#: ``SPARSE`` payload: changed elements, long gaps, length of the
#: compressed gap bytes.
_SPARSE = struct.Struct("<III")
# numpy's names of the unsigned and signed dtypes, so that numpy (part of
# the delta extra) is imported only by the functions that use it.
_UINT = {1: "u1", 2: "u2", 4: "u4", 8: "u8"}
_INT = {1: "i1", 2: "i2", 4: "i4", 8: "i8"}
# A chunk whose first this many elements changed in more than this
# fraction goes dense untried as sparse.
_SAMPLE = 16 << 10
_DENSE_SAMPLE = 0.9
# The bytes compared first to tell a changed chunk from an equal one.
_PREFIX = 4 << 10
# A gap of this many unchanged elements or more takes 4 bytes more (_gaps).
_LONG = 255


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


def _compress(
    blosc2: Any, data: np.ndarray, typesize: int, codec: Compressor, bits: bool | None = None
) -> bytes:
    """One blosc2 frame (self-describing: the decoder learns codec and
    filter from it), on the calling thread only.

    ``'zstd'``: zstd level 1 on byte planes. ``'lz4'``: LZ4 on bit planes
    for elements of up to 2 bytes (in a zigzagged difference the high bit
    planes are zero, and LZ4 passes over them at memory speed), on byte
    planes for wider ones: the low two bytes of an fp32 difference are
    noise either way, and bit planes cost 1.5x the time for 8% less
    (``benchmarks/delta_codec.py``, fp32 lr 3e-4). ``bits`` forces bit
    planes (True) or byte planes (False) for LZ4."""
    if codec == "lz4":
        name = blosc2.Codec.LZ4
        bits = typesize <= 2 if bits is None else bits
        shuffle = blosc2.Filter.BITSHUFFLE if bits else blosc2.Filter.SHUFFLE
        # Byte planes in one stream, bit planes in several: each measured
        # the faster (by a third).
        split = blosc2.SplitMode.FORWARD_COMPAT_SPLIT if bits else blosc2.SplitMode.NEVER_SPLIT
        # One block per chunk: blosc2's smaller default blocks cost LZ4 a
        # quarter more time, and compress less.
        block = data.nbytes
    else:
        name, split, block = blosc2.Codec.ZSTD, blosc2.SplitMode.FORWARD_COMPAT_SPLIT, 0
        shuffle = blosc2.Filter.SHUFFLE if typesize > 1 else blosc2.Filter.NOFILTER
    cparams = {
        "codec": name,
        "clevel": 1,
        "typesize": typesize,
        "filters": [shuffle],
        "splitmode": split,
        "nthreads": 1,
        "blocksize": block,
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


class _Scratch:
    """Per-thread work buffers of one chunk's size, kept across chunks:
    a fresh megabyte per chunk costs more in page faults than the pass
    that fills it."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, size: int, dtype: str) -> np.ndarray:
        """An array of ``size`` elements of ``dtype``, its contents undefined."""
        import numpy as np

        nbytes = size * np.dtype(dtype).itemsize
        array = self._arrays.get(name)
        if array is None or array.nbytes < nbytes:
            array = self._arrays[name] = np.empty(nbytes, dtype=np.uint8)
        return array[:nbytes].view(dtype)


def _equal(current: np.ndarray, base: np.ndarray) -> bool:
    """Whether two chunks are equal: one compare pass at memory speed for
    an equal chunk, a few microseconds for a changed one (its first
    :data:`_PREFIX` bytes differ: any chunk of a real update does)."""
    import numpy as np

    if current[:_PREFIX].tobytes() != base[:_PREFIX].tobytes():
        return False
    words = _UINT[8] if current.nbytes % 8 == 0 else _UINT[1]
    return bool(np.array_equal(current.view(words), base.view(words)))


def _changes(difference: np.ndarray, work: _Scratch) -> tuple[np.ndarray, np.ndarray]:
    """The positions of the nonzero elements of ``difference`` (unsigned,
    a chunk's difference from its base), ascending, and their values.

    The difference is read 8 bytes at a time, and only the words that are
    not zero are looked into: numpy's ``flatnonzero`` spends about a
    nanosecond an element on a sparse mask, and this way it sees a word of
    4 bf16 elements where it would see 4 elements (a sixth of the words are
    not zero when 4% of the elements changed)."""
    import numpy as np

    item = difference.itemsize
    raw = difference.view(np.uint8)
    head = raw.size - raw.size % 8
    words = raw[:head].view(_UINT[8])
    hit = np.flatnonzero(np.not_equal(words, 0, out=work.get("changed", words.size, "?")))
    rows = words.take(hit).view(difference.dtype)
    inside = np.flatnonzero(rows != 0)
    # Shifts, not numpy's integer division (ten times slower): the lanes
    # of a word are a power of 2.
    lanes = 8 // item
    shift = lanes.bit_length() - 1
    positions = hit[inside >> shift]
    positions <<= shift
    positions += inside & (lanes - 1)
    values = rows.take(inside)
    if head == raw.size:
        return positions, values
    tail = difference[head // item :]
    more = np.flatnonzero(tail)
    return np.concatenate((positions, head // item + more)), np.concatenate((values, tail.take(more)))


def _gaps(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ascending positions as gaps: a byte per position, its distance from
    the previous one less one (from -1 for the first), and, where that is
    :data:`_LONG` or more, :data:`_LONG` and the rest in a ``uint32`` of
    its own. The bytes of the typical gap (tens of elements) compress near
    their information content; a bitmap would cost a bit per element."""
    import numpy as np

    gaps = np.empty_like(positions)
    if gaps.size == 0:
        return gaps.astype(np.uint8), gaps.astype(np.uint32)
    gaps[0] = positions[0]
    np.subtract(positions[1:], positions[:-1], out=gaps[1:])
    gaps[1:] -= 1
    if int(gaps.max()) < _LONG:
        return gaps.astype(np.uint8), np.empty(0, dtype=np.uint32)
    long = np.flatnonzero(gaps >= _LONG)
    rest = (gaps[long] - _LONG).astype(np.uint32)
    gaps[long] = _LONG
    return gaps.astype(np.uint8), rest


def _ungaps(stream: np.ndarray, rest: np.ndarray, elements: int) -> np.ndarray:
    """The positions of :func:`_gaps`' bytes and rests, checked to be
    ascending positions below ``elements``.

    :raises DeltaFrameError: they are not such positions."""
    import numpy as np

    gaps = stream.astype(np.int64)
    long = np.flatnonzero(stream == _LONG)
    if long.size != rest.size:
        raise DeltaFrameError(f"sparse frame with {long.size} long gaps and {rest.size} rests")
    gaps[long] += rest
    gaps += 1
    positions = np.cumsum(gaps)
    positions -= 1
    if positions.size and int(positions[-1]) >= elements:
        raise DeltaFrameError(f"sparse frame changes element {int(positions[-1])} of {elements}")
    return positions


def _zigzag(difference: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """The unsigned zigzag form of signed differences, in place: 0, -1, 1,
    -2 ... become 0, 1, 2, 3 ..., so a small change of either sign has
    zero high bits (its two's complement would have them all ones)."""
    import numpy as np

    sign = np.right_shift(difference, difference.itemsize * 8 - 1, out=scratch)
    np.left_shift(difference, 1, out=difference)
    np.bitwise_xor(difference, sign, out=difference)
    return difference.view(_UINT[difference.itemsize])


def _unzigzag(encoded: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """The (wrapping, unsigned) differences of :func:`_zigzag`'s form, in place."""
    import numpy as np

    sign = np.bitwise_and(encoded, 1, out=scratch)
    np.negative(sign, out=sign)
    np.right_shift(encoded, 1, out=encoded)
    np.bitwise_xor(encoded, sign, out=encoded)
    return encoded


def encode_frame(
    current: np.ndarray,
    base: np.ndarray | None,
    element_size: int,
    scratch: _Scratch | None = None,
    compressor: Compressor = "lz4",
) -> bytes:
    """One frame for ``current`` (a chunk's bytes, ``uint8``): against
    ``base`` (the same chunk of the base version) when given, else the full
    bytes. ``scratch`` (a ``_Scratch``) keeps work buffers from one call to
    the next. Blocks the calling thread; touches neither input.

    :raises MissingExtraError: the delta extra is not installed.
    """
    blosc2, xxh3 = require_codec()
    import numpy as np

    size = current.nbytes
    digest = xxh3(current)
    # A tail that is not a multiple of the element size is split by bytes.
    item = element_size if size % element_size == 0 and element_size in _UINT else 1
    if base is None:
        if not _worth_trying(blosc2, current, item, compressor, bits=True):
            return _raw(item, digest, current)
        # Bit planes: the sign and exponent bits of weights compress, the
        # bytes that hold them less so.
        packed = _compress(blosc2, current, item, compressor, bits=True)
        return _frame(Mode.PACKED, item, size, digest, packed, current)
    if base.nbytes != size:
        raise ValueError(f"base chunk of {base.nbytes} bytes for a chunk of {size}")
    if _equal(current, base):
        return HEADER.pack(Mode.SAME, item, FORMAT, 0, size, 0, digest)
    work = scratch or _Scratch()
    elements = size // item
    # The difference modulo 2**bits: one pass over both chunks, and all
    # that is read after it (read as signed, an update's small steps are
    # small numbers of either sign).
    difference = np.subtract(
        current.view(_UINT[item]), base.view(_UINT[item]), out=work.get("difference", elements, _UINT[item])
    )
    # Nearly every element changed in its first elements (a dense update,
    # random bytes): dense, without looking for what changed.
    sample = min(elements, _SAMPLE)
    if np.count_nonzero(difference[:sample]) <= _DENSE_SAMPLE * sample:
        positions, values = _changes(difference, work)
        count = positions.size
        if count <= SPARSE_DENSITY * elements:
            stream, rest = _gaps(positions)
            gaps = _compress(blosc2, stream, 1, compressor)
            zigzag = _compress(blosc2, _zigzag(values.view(_INT[item])), item, compressor)
            payload = b"".join(
                (_SPARSE.pack(count, rest.size, len(gaps)), gaps, rest.astype("<u4").tobytes(), zigzag)
            )
            return _frame(Mode.SPARSE, item, size, digest, payload, current)
    # Whether it compresses, from its first elements alone: random bytes
    # then cost no pass more.
    head = _zigzag(difference[: PROBE_BYTES // item].view(_INT[item]).copy())
    if not _worth_trying(blosc2, head, item, compressor, zigzagged=True, whole=elements * item):
        return _raw(item, digest, current)
    encoded = _zigzag(difference.view(_INT[item]), work.get("sign", elements, _INT[item]))
    return _frame(Mode.DENSE, item, size, digest, _compress(blosc2, encoded, item, compressor), current)


def _worth_trying(
    blosc2: Any,
    data: np.ndarray,
    item: int,
    compressor: Compressor,
    zigzagged: bool = False,
    bits: bool | None = None,
    whole: int | None = None,
) -> bool:
    """Whether the first :data:`PROBE_BYTES` of a large chunk compress.

    Random-looking bytes are then sent raw without compressing all of them,
    so an incompressible update costs a fraction of an encode, not a whole
    one. A chunk that is random only past its sample is still caught by
    :func:`_frame`. ``zigzagged`` differences of elements of 2 bytes or
    more whose high byte is mostly zero (a real update: random bytes have
    it zero once in 256) are worth it without the trial compression.
    ``whole``: the chunk's size, when ``data`` is only its first bytes."""
    import numpy as np

    if (data.nbytes if whole is None else whole) < 4 * PROBE_BYTES:
        return True
    head = data[: PROBE_BYTES // data.itemsize]
    if zigzagged and item > 1 and np.count_nonzero(head >> (8 * item - 8)) < head.size // 2:
        return True
    sample = _compress(blosc2, head, item, compressor, bits)
    return len(sample) < RAW_RATIO * PROBE_BYTES


def _raw(item: int, digest: int, current: np.ndarray) -> bytes:
    return HEADER.pack(Mode.RAW, item, FORMAT, 0, current.nbytes, current.nbytes, digest) + current.tobytes()


def _frame(mode: Mode, item: int, size: int, digest: int, payload: bytes, current: np.ndarray) -> bytes:
    if len(payload) >= RAW_RATIO * size:
        return _raw(item, digest, current)
    return HEADER.pack(mode, item, FORMAT, 0, size, len(payload), digest) + payload


def read_header(frame: Any) -> FrameHeader:
    """The header at the start of ``frame`` (at least :data:`HEADER_SIZE`
    bytes); ``HEADER_SIZE + payload_length`` is the whole frame's size.

    :raises DeltaFrameError: too short, of another format version, or not
        a header (unknown mode, impossible sizes).
    """
    view = memoryview(frame).cast("B")
    if len(view) < HEADER_SIZE:
        raise DeltaFrameError(f"a frame header is {HEADER_SIZE} bytes, got {len(view)}")
    code, item, version, reserved, size, length, digest = HEADER.unpack_from(view)
    if version != FORMAT:
        raise DeltaFrameError(f"a frame of format {version}; this weightsync reads format {FORMAT}")
    try:
        mode = Mode(code)
    except ValueError:
        mode = None
    if mode is None or item not in _UINT or reserved != 0:
        raise DeltaFrameError(f"not a delta frame header (mode {code}, element size {item})")
    if (mode is Mode.RAW and length != size) or (mode is Mode.SAME and length != 0) or size % item:
        raise DeltaFrameError(f"impossible frame: {mode.name}, {size} bytes in {length}")
    return FrameHeader(mode, item, size, length, digest)


def decode_frame(frame: Any, out: np.ndarray, scratch: _Scratch | None = None) -> FrameHeader:
    """Decode ``frame`` (header and payload) into ``out``, the chunk's
    ``uint8`` bytes, in place: for the modes that need a base
    (:attr:`Mode.needs_base`), ``out`` must hold the base chunk on entry.
    Checks the digest of the result. ``scratch`` (a ``_Scratch``) keeps
    work buffers from one call to the next. Blocks the calling thread.

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
    elements = out.view(_UINT[head.element_size])
    if head.mode is Mode.RAW:
        out[:] = np.frombuffer(payload, dtype=np.uint8)
    elif head.mode is Mode.PACKED:
        _decompress(blosc2, payload, out)
    elif head.mode is Mode.DENSE:
        work = scratch or _Scratch()
        difference = work.get("difference", elements.size, elements.dtype.str)
        _decompress(blosc2, payload, difference.view(np.uint8))
        _unzigzag(difference, work.get("sign", elements.size, elements.dtype.str))
        np.add(elements, difference, out=elements)
    elif head.mode is Mode.SPARSE:
        _apply_sparse(blosc2, payload, elements)
    if xxh3(out) != head.digest:
        raise DeltaFrameError(f"decoded {head.mode.name} chunk differs from the trainer's (digest mismatch)")
    return head


def _apply_sparse(blosc2: Any, payload: memoryview, elements: np.ndarray) -> None:
    import numpy as np

    if len(payload) < _SPARSE.size:
        raise DeltaFrameError("sparse frame too short")
    count, longs, gaps_length = _SPARSE.unpack_from(payload)
    start = _SPARSE.size
    rests = start + gaps_length
    if longs > count or count > elements.size or rests + 4 * longs > len(payload):
        raise DeltaFrameError(f"sparse frame of {count} changes, {longs} long gaps: impossible")
    stream = np.empty(count, dtype=np.uint8)
    _decompress(blosc2, payload[start:rests], stream)
    rest = np.frombuffer(payload[rests : rests + 4 * longs], dtype="<u4")
    positions = _ungaps(stream, rest, elements.size)
    values = np.empty(count, dtype=elements.dtype)
    _decompress(blosc2, payload[rests + 4 * longs :], values.view(np.uint8))
    changed = elements.take(positions)
    changed += _unzigzag(values)
    elements[positions] = changed


def check_delta(setting: object, threads: int, history: int = 0) -> None:
    """Check a scheme's ``delta``, ``delta_threads`` and ``delta_history``.

    :raises ValueError: ``setting`` is not True, False or ``"always"``, or
        ``threads`` or ``history`` is negative."""
    if not (setting is True or setting is False or setting == "always"):
        raise ValueError(f"delta is True, False or 'always', not {setting!r}")
    if not isinstance(threads, int) or threads < 0:
        raise ValueError(f"delta_threads is 0 (the default) or a number of threads, not {threads!r}")
    if not isinstance(history, int) or isinstance(history, bool) or history < 0:
        raise ValueError(f"delta_history is a number of older versions (0: none), not {history!r}")


#: The most codec threads a scheme uses when it does not say.
MAX_DEFAULT_THREADS = 1


def default_threads() -> int:
    """The codec threads of a scheme that does not say: one. Most of a
    chunk's numpy steps (the search for what changed, the gathers, the
    digest) hold the GIL, so a second thread slowed the encode on a
    2-core machine (``benchmarks/delta_codec.py --threads 2``: 0.43x to
    0.93x the wall clock of one thread, bf16 lr 3e-6 and fp32 lr 3e-4);
    the one thread already works while the chain sends (the frames are
    produced as they go). At most :data:`MAX_DEFAULT_THREADS`, and the
    usable cores."""
    return max(1, min(MAX_DEFAULT_THREADS, usable_cores()))


def _gil_free_compression() -> None:
    """Let blosc2 release the GIL while it compresses and decompresses
    (process-wide, once; only the GIL's handling changes): without it a
    codec thread's compression holds every other Python thread, the
    other codec threads included."""
    global _GIL_RELEASED
    if not _GIL_RELEASED:
        blosc2, _ = require_codec()
        blosc2.set_releasegil(True)
        _GIL_RELEASED = True


_GIL_RELEASED = False


class _Scratches:
    """Work buffers of a codec's threads, one :class:`_Scratch` per chunk in
    progress (at most ``threads``), kept from send to send."""

    def __init__(self) -> None:
        self._free: list[_Scratch] = []
        self._lock = threading.Lock()

    def run(self, work: Callable[[_Scratch], T]) -> tuple[T, float]:
        """``work(scratch)`` on this thread; its result and this thread's CPU seconds."""
        with self._lock:
            scratch = self._free.pop() if self._free else _Scratch()
        try:
            started = time.thread_time()
            result = work(scratch)
            return result, time.thread_time() - started
        finally:
            with self._lock:
                self._free.append(scratch)


class DeltaEncoder:
    """The trainer's side: holds one base copy (``nbytes``, +S of memory) of
    the last version every receiver applied, and encodes staged versions
    against it, chunk by chunk.

    Not thread-safe: one send at a time. The encoder never reads torch's
    intra-op pool; with ``threads > 1`` it encodes up to ``2 x threads``
    chunks ahead on threads of its own (named ``weightsync-delta``),
    started and ended within each :meth:`frames` iteration, so the first
    frame leaves while the later chunks are encoded.
    """

    def __init__(
        self,
        nbytes: int,
        element_size: int,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        threads: int = 1,
        compressor: Compressor = "lz4",
    ) -> None:
        """:raises MissingExtraError: the delta extra is not installed.
        :raises ValueError: a size that is not positive."""
        require_codec()
        self.nbytes = nbytes
        self.element_size = element_size
        self.spans = frame_spans(nbytes, chunk_bytes, element_size)
        self.threads = max(1, threads)
        self.compressor: Compressor = compressor
        self._scratches = _Scratches()
        self._base: np.ndarray | None = None
        self.base_version: int | None = None
        #: Of the last :meth:`frames` iteration that ended: the CPU seconds
        #: its chunks took, over all threads, and its wall seconds from the
        #: first ``next()`` to the last frame.
        self.last_cpu = 0.0
        self.last_wall = 0.0

    @property
    def has_base(self) -> bool:
        """Whether a base is held (else every frame carries the full bytes)."""
        return self._base is not None

    @property
    def base(self) -> np.ndarray | None:
        """The base's bytes (None: none), to be read only: the memory its
        owner handed over (:meth:`adopt`), which it may keep page-locked."""
        return self._base

    def encode(self, current: Any, index: int, *, full: bool = False) -> tuple[bytes, float]:
        """The frame of chunk ``index`` of ``current`` (see :meth:`frames`),
        on the calling thread; with the CPU seconds it took."""
        data = _flat_bytes(current)
        if data.nbytes != self.nbytes:
            raise ValueError(f"{data.nbytes} bytes staged for an encoder of {self.nbytes}")
        return self._encode(data, None if full else self._base, index)

    def _encode(self, data: np.ndarray, base: np.ndarray | None, index: int) -> tuple[bytes, float]:
        start, stop = self.spans[index]
        chunk = data[start:stop]
        before = None if base is None else base[start:stop]
        return self._scratches.run(
            lambda scratch: encode_frame(chunk, before, self.element_size, scratch, self.compressor)
        )

    def frames(
        self, current: Any, *, full: bool = False, ready: dict[int, bytes] | None = None
    ) -> Generator[bytes, None, None]:
        """Yield one frame per chunk of ``current`` (a flat buffer or CPU
        tensor of ``nbytes`` bytes, read while iterating: it must not change
        until the iteration ends), in chunk order: against the base, or the
        full bytes (``PACKED``/``RAW``) when there is none or with ``full``.
        ``ready``: frames already encoded (by :meth:`encode`, of this
        ``current`` and base), by chunk index. Each ``next()`` blocks until
        that chunk is encoded; with ``threads > 1`` the chunks after it are
        encoded meanwhile. Closing the iterator early waits for the chunks
        in progress.

        :raises ValueError: ``current`` is not ``nbytes`` long.
        """
        data = _flat_bytes(current)
        if data.nbytes != self.nbytes:
            raise ValueError(f"{data.nbytes} bytes staged for an encoder of {self.nbytes}")
        base = None if full else self._base
        ready = ready or {}
        count = len(self.spans)
        self.last_cpu = self.last_wall = 0.0
        started: float | None = None

        def frame(index: int) -> tuple[bytes, float]:
            done = ready.get(index)
            return (done, 0.0) if done is not None else self._encode(data, base, index)

        if self.threads == 1 or count - len(ready) <= 1:
            for index in range(count):
                started = time.perf_counter() if started is None else started
                out, cpu = frame(index)
                self.last_cpu += cpu
                yield out
            self.last_wall = 0.0 if started is None else time.perf_counter() - started
            return
        _gil_free_compression()
        # Up to two chunks a thread in flight: a thread that finished one
        # starts the next while the caller sends.
        pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="weightsync-delta")
        pending: deque[concurrent.futures.Future[tuple[bytes, float]]] = deque()
        try:
            submitted = 0
            for _ in range(count):
                started = time.perf_counter() if started is None else started
                while submitted < count and len(pending) < 2 * self.threads:
                    pending.append(pool.submit(frame, submitted))
                    submitted += 1
                out, cpu = pending.popleft().result()
                self.last_cpu += cpu
                yield out
            self.last_wall = 0.0 if started is None else time.perf_counter() - started
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

    def base_chunk(self, index: int) -> np.ndarray | None:
        """The base's bytes of chunk ``index`` (None: no base), read only."""
        if self._base is None:
            return None
        start, stop = self.spans[index]
        return self._base[start:stop]

    def forget(self) -> None:
        """Drop the base (and its memory): the next send carries full bytes."""
        self._base = None
        self.base_version = None


class DeltaDecoder:
    """A receiving host's side: rebuilds a version, in place, in ``buffer``
    (a flat buffer or CPU tensor that holds the base the frames were taken
    against, or anything when every frame is full), from frames fed in
    chunk order. Costs no memory beyond ``buffer`` and a chunk a thread
    (and the frames not yet rebuilt).

    With ``threads > 1``, or with ``background``, :meth:`feed` hands each
    chunk to one of ``threads`` threads of its own (named
    ``weightsync-delta``) and returns: chunks are rebuilt in parallel (or,
    one thread in the background, one after the other), while the caller
    receives and passes on the next frame; :meth:`finish` (or
    :meth:`check`) waits for them and ends the threads.
    """

    def __init__(
        self,
        buffer: Any,
        element_size: int,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        base: Any = None,
        threads: int = 1,
        background: bool = False,
    ) -> None:
        """``base``: another buffer of the same size that holds the base
        (read only; each chunk a frame needs it for is copied into
        ``buffer`` first), when ``buffer`` does not hold it itself.
        ``background``: rebuild off the calling thread even with one
        thread, for a caller that receives the frames: the next frame's
        transfer then overlaps this one's rebuild (a receiver busy
        rebuilding posts no receive, and the sender waits for one).

        :raises MissingExtraError: the delta extra is not installed.
        :raises ValueError: ``base`` is not as long as ``buffer``.
        """
        require_codec()
        self._data = _flat_bytes(buffer)
        self._base = None if base is None else _flat_bytes(base)
        if self._base is not None and self._base.nbytes != self._data.nbytes:
            raise ValueError(f"a base of {self._base.nbytes} bytes for a buffer of {self._data.nbytes}")
        self.spans = frame_spans(self._data.nbytes, chunk_bytes, element_size)
        self.threads = max(1, threads)
        self._inline = self.threads == 1 and not background
        self._next = 0
        self._scratches = _Scratches()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: deque[concurrent.futures.Future[tuple[FrameHeader, float]]] = deque()
        # Chunks rebuilt in order from the first (the others may be in progress).
        self._rebuilt = 0
        #: CPU seconds the chunks took so far, over all threads.
        self.cpu = 0.0

    @property
    def done(self) -> bool:
        """Whether every chunk's frame has been fed."""
        return self._next == len(self.spans)

    def _rebuild(self, index: int, frame: Any) -> tuple[FrameHeader, float]:
        start, stop = self.spans[index]
        out = self._data[start:stop]

        def work(scratch: _Scratch) -> FrameHeader:
            if self._base is not None and read_header(frame).mode.needs_base:
                out[:] = self._base[start:stop]
            return decode_frame(frame, out, scratch)

        return self._scratches.run(work)

    def feed(self, frame: Any) -> FrameHeader:
        """Rebuild the next chunk from its frame into the buffer (see
        :func:`decode_frame`): on the calling thread, or with
        ``threads > 1`` or ``background`` on the decoder's threads (returns its header at
        once; an error of an earlier chunk is raised here or by
        :meth:`finish`). Blocks the calling thread while ``2 x threads``
        chunks are in progress.

        :raises DeltaFrameError: a damaged frame, a frame past the last
            chunk, or a result that is not the trainer's; the buffer no
            longer holds the base.
        """
        if self.done:
            raise DeltaFrameError(f"a frame past the last of {len(self.spans)} chunks")
        index = self._next
        self._next += 1
        if self._inline:
            head, cpu = self._rebuild(index, frame)
            self.cpu += cpu
            self._rebuilt = self._next
            return head
        head = read_header(frame)
        if self._pool is None:
            _gil_free_compression()
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="weightsync-delta"
            )
        self._pending.append(self._pool.submit(self._rebuild, index, frame))
        self._collect(wait=len(self._pending) > 2 * self.threads)
        return head

    def _collect(self, wait: bool) -> None:
        """Take the chunks rebuilt in order (waiting for the first one in
        progress with ``wait``); raises the first one's error."""
        while self._pending and (wait or self._pending[0].done()):
            wait = False
            try:
                _, cpu = self._pending.popleft().result()
            except BaseException:
                self._stop()
                raise
            self.cpu += cpu
            self._rebuilt += 1

    def _stop(self) -> None:
        for future in self._pending:
            future.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool, self._pending = None, deque()

    def finish(self) -> None:
        """Wait for every chunk in progress, and end the decoder's threads.
        Idempotent.

        :raises DeltaFrameError: a chunk could not be rebuilt.
        """
        try:
            while self._pending:
                self._collect(wait=True)
        finally:
            self._stop()

    def finish_quietly(self) -> None:
        """Stop: drop the chunks not started, wait for those in progress,
        end the threads; no error is raised (the buffer holds no base)."""
        self._stop()

    @property
    def decoded(self) -> int:
        """The leading bytes of the buffer rebuilt so far."""
        if self._pending:
            self._collect(wait=False)
        return self.spans[self._rebuilt - 1][1] if self._rebuilt else 0

    def check(self, expected: Sequence[int], threads: int = 1) -> None:
        """Check that the whole rebuilt version is the trainer's: its
        :func:`version_digest` equals ``expected``. Call before a worker's
        model is touched. Blocks the calling thread (see :meth:`finish`).

        :raises DeltaFrameError: chunks are missing, or a digest differs.
        """
        self.finish()
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
