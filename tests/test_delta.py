"""Delta frames (weightsync._delta) on real update trajectories: bit-exact
over many steps, every mode, damaged frames caught, the missing extra named."""

from __future__ import annotations

import collections
import datetime
import functools
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from weightsync._delta import (
    FORMAT,
    HEADER,
    HEADER_SIZE,
    PROBE_BYTES,
    Compressor,
    DeltaDecoder,
    DeltaEncoder,
    Mode,
    decode_frame,
    encode_frame,
    read_header,
    version_digest,
)
from weightsync._exceptions import DeltaFrameError, MissingExtraError
from weightsync._frames import CHUNK_BYTES, frame_spans, piece_spans
from weightsync.bench import TRAJECTORIES, update_trajectory

pytest.importorskip("blosc2")

CHUNK = 64 << 10


@functools.cache
def _steps(name: str) -> tuple[np.ndarray, ...]:
    kind = TRAJECTORIES[name]
    return tuple(t.numpy() for t in update_trajectory(kind, 1 << 20, 5, d_model=128, warmup=1))


def _trajectory(name: str, steps: int) -> list[np.ndarray]:
    """The first ``steps + 1`` sends of a trajectory (copies: tests write them)."""
    return [a.copy() for a in _steps(name)[: steps + 1]]


def _send(encoder: DeltaEncoder, host: np.ndarray, current: np.ndarray) -> collections.Counter[str]:
    """One send: encode, decode on the host in place, check, commit."""
    frames = list(encoder.frames(current))
    decoder = DeltaDecoder(host, encoder.element_size, chunk_bytes=CHUNK)
    modes = collections.Counter(decoder.feed(frame).mode.name for frame in frames)
    decoder.check(version_digest(current))
    encoder.commit(current)
    return modes


@pytest.mark.parametrize(
    ("name", "expected"),
    [("bf16-lr1e-5", "SPARSE"), ("bf16-lr1e-6", "SPARSE"), ("fp32-lr3e-4", "DENSE"), ("random", "RAW")],
)
def test_bit_exact_over_a_trajectory(name: str, expected: str) -> None:
    steps = _trajectory(name, 5)
    encoder = DeltaEncoder(steps[0].nbytes, TRAJECTORIES[name].element_size, chunk_bytes=CHUNK)
    host = np.zeros(steps[0].nbytes, dtype=np.uint8)
    seen: collections.Counter[str] = collections.Counter()
    for k, current in enumerate(steps):
        modes = _send(encoder, host, current)
        assert np.array_equal(host, current)
        if k == 0:  # no base yet: the full bytes
            assert set(modes) <= {"PACKED", "RAW"}
        else:
            seen += modes
    assert expected in seen
    if name.startswith("bf16"):
        sent = sum(len(f) for f in encoder.frames(steps[-1]))
        assert sent == HEADER_SIZE * len(encoder.spans)  # the base is the last step: all SAME


def test_threads_give_the_same_frames() -> None:
    a, b = _trajectory("bf16-lr1e-5", 1)
    one = DeltaEncoder(a.nbytes, 2, chunk_bytes=CHUNK)
    two = DeltaEncoder(a.nbytes, 2, chunk_bytes=CHUNK, threads=2)
    for encoder in (one, two):
        encoder.commit(a)
    assert list(one.frames(b)) == list(two.frames(b))
    # Closing the iterator early is clean.
    frames = two.frames(b)
    next(frames)
    frames.close()


def _modes_case() -> dict[str, tuple[np.ndarray, np.ndarray | None, int]]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(CHUNK // 4, dtype=np.float32).view(np.uint8)
    sparse = base.view(np.uint16).copy()
    sparse[rng.choice(sparse.size, sparse.size // 50, replace=False)] ^= 1
    far = base.view(np.uint16).copy()  # changes hundreds of elements apart
    far[[0, 300, 301, 9000, far.size - 1]] += np.uint16(3)
    dense = (base.view(np.float32) * np.float32(1.001)).view(np.uint8)
    odd = rng.integers(0, 4, 999, dtype=np.uint8)  # a tail of 999 bytes of 2-byte elements
    odd_new = odd.copy()
    odd_new[::7] ^= 1
    big = rng.standard_normal(CHUNK_BYTES // 4, dtype=np.float32).view(np.uint8)
    noise = rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8)
    # Compressible where the sample is taken, random after it: tried, then raw.
    half = noise.copy()
    half[:PROBE_BYTES] = (big.view(np.float32) * np.float32(1.001)).view(np.uint8)[:PROBE_BYTES]
    return {
        "RAW-probed": (noise, big, 4),
        "RAW-probed-full": (noise, None, 4),
        "RAW-after-trying": (half, big, 4),
        "SAME": (base.copy(), base, 4),
        "SPARSE-long-gaps": (far.view(np.uint8), base, 2),
        "SPARSE": (sparse.view(np.uint8), base, 2),
        "DENSE": (dense, base, 4),
        "RAW": (rng.integers(0, 256, CHUNK, dtype=np.uint8), base, 4),
        "PACKED": (dense, None, 4),
        "tail": (odd_new, odd, 2),
    }


MODE_CASES = [
    "SAME",
    "SPARSE",
    "SPARSE-long-gaps",
    "DENSE",
    "RAW",
    "RAW-probed",
    "RAW-probed-full",
    "RAW-after-trying",
    "PACKED",
    "tail",
]


@pytest.mark.parametrize("compressor", ["lz4", "zstd"])
@pytest.mark.parametrize("case", MODE_CASES)
def test_each_mode_round_trips(case: str, compressor: Compressor) -> None:
    current, base, item = _modes_case()[case]
    frame = encode_frame(current, base, item, compressor=compressor)
    head = read_header(frame)
    if case == "tail":
        assert head.element_size == 1 and head.mode is Mode.SPARSE
    elif case.startswith("SPARSE"):
        assert head.mode is Mode.SPARSE
    elif case.startswith("RAW"):
        assert head.mode is Mode.RAW
    else:
        assert head.mode.name == case
    assert len(frame) == HEADER_SIZE + head.payload_length
    if case.startswith("RAW"):
        assert head.payload_length == current.nbytes
    elif case == "SAME":
        assert len(frame) == HEADER_SIZE
    elif case == "PACKED":  # fp32 normals: the exponent bytes compress
        assert len(frame) < 0.95 * current.nbytes
    else:  # a multiplicative change of every element still gains a third
        assert len(frame) < 0.7 * current.nbytes
    out = np.zeros_like(current) if base is None else base.copy()
    decode_frame(frame, out)
    assert np.array_equal(out, current)


def test_tail_chunk_not_a_multiple_of_the_element_size() -> None:
    assert frame_spans(10, 4, 2) == [(0, 4), (4, 8), (8, 10)]
    assert frame_spans(11, 5, 2) == [(0, 4), (4, 8), (8, 11)]
    assert frame_spans(0) == []
    # Several buffers cut into frames of pieces, for the chain's sender.
    assert piece_spans([3, 0, 4], 4) == [[(0, 0, 3), (2, 0, 1)], [(2, 1, 4)]]
    assert piece_spans([], 4) == []
    steps = [np.random.default_rng(s).integers(0, 256, 2 * CHUNK + 3, dtype=np.uint8) for s in range(2)]
    steps[1][: 2 * CHUNK] = steps[0][: 2 * CHUNK]
    steps[1][-3:] = steps[0][-3:] ^ 1
    encoder = DeltaEncoder(steps[0].nbytes, 2, chunk_bytes=CHUNK)
    host = np.zeros(steps[0].nbytes, dtype=np.uint8)
    for current in steps:
        _send(encoder, host, current)
        assert np.array_equal(host, current)


@pytest.mark.parametrize("compressor", ["lz4", "zstd"])
@pytest.mark.parametrize("case", ["SAME", "SPARSE", "SPARSE-long-gaps", "DENSE", "RAW", "PACKED", "tail"])
def test_a_flipped_byte_is_never_silent(case: str, compressor: Compressor) -> None:
    current, base, item = _modes_case()[case]
    frame = encode_frame(current, base, item, compressor=compressor)
    rng = np.random.default_rng(1)
    positions = set(range(min(len(frame), 64))) | set(rng.integers(0, len(frame), 200).tolist())
    caught = 0
    for position in sorted(positions):
        damaged = bytearray(frame)
        damaged[position] ^= 0x10
        out = np.zeros_like(current) if base is None else base.copy()
        try:
            decode_frame(damaged, out)
        except DeltaFrameError:
            caught += 1
            continue
        # A flip that changes nothing decoded (a spare bit) must still give
        # exactly the trainer's bytes.
        assert np.array_equal(out, current), position
    # Flips in the compressor's spare header bits decode exactly; the rest raise.
    assert caught >= len(positions) // 2


def test_a_truncated_frame_or_wrong_base_is_caught() -> None:
    current, base, item = _modes_case()["SPARSE"]
    assert base is not None
    frame = encode_frame(current, base, item)
    with pytest.raises(DeltaFrameError):
        decode_frame(frame[:-1], base.copy())
    with pytest.raises(DeltaFrameError):
        decode_frame(frame[:10], base.copy())
    other = base.copy()
    other[5] ^= 1
    with pytest.raises(DeltaFrameError, match="digest"):
        decode_frame(frame, other)
    with pytest.raises(DeltaFrameError):
        decode_frame(frame, np.zeros(base.nbytes // 2, dtype=np.uint8))


def test_a_frame_of_another_format_is_refused() -> None:
    current, base, item = _modes_case()["SPARSE"]
    assert base is not None
    frame = bytearray(encode_frame(current, base, item))
    mode, size, version, reserved, raw, length, digest = HEADER.unpack_from(frame)
    assert version == FORMAT
    for other in (0, FORMAT + 1):
        HEADER.pack_into(frame, 0, mode, size, other, reserved, raw, length, digest)
        with pytest.raises(DeltaFrameError, match="format"):
            decode_frame(frame, base.copy())


def test_long_gaps_and_their_count_are_checked() -> None:
    current, base, item = _modes_case()["SPARSE-long-gaps"]
    assert base is not None
    frame = bytearray(encode_frame(current, base, item))
    # The sparse payload opens with: changes, long gaps, gap bytes' length.
    changes, longs = np.frombuffer(frame, dtype="<u4", count=2, offset=HEADER_SIZE)
    assert (changes, longs) == (5, 3)  # gaps of 299, 8698 and 7083 elements
    for wrong in (2, 4, 6):
        damaged = bytearray(frame)
        damaged[HEADER_SIZE + 4 : HEADER_SIZE + 8] = wrong.to_bytes(4, "little")
        with pytest.raises(DeltaFrameError):
            decode_frame(damaged, base.copy())


def _cast(master: np.ndarray, wire: str) -> np.ndarray:
    """The bytes of an fp32 master cast to the wire dtype."""
    if wire == "bf16":
        return torch.from_numpy(master).to(torch.bfloat16).view(torch.uint8).numpy()
    return master.astype(np.float16 if wire == "fp16" else np.float32).view(np.uint8)


def _random_update(
    rng: np.random.Generator, wire: str, kind: str, nbytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """(base, current) of ``nbytes``: the sent bytes of a random master,
    then of the same after an update of ``kind``."""
    item = 4 if wire == "fp32" else 2
    master = rng.standard_normal(nbytes // item + 1, dtype=np.float32) * np.float32(0.05)
    base = _cast(master, wire)[:nbytes].copy()
    if kind == "random":
        return base, rng.integers(0, 256, nbytes, dtype=np.uint8)
    if kind == "same":
        return base, base.copy()
    # A few elements (sparse), or all of them (dense), take a step of a
    # random size, sign and learning rate.
    share = {"sparse": rng.choice([1e-4, 3e-3, 0.04, 0.3]), "dense": 1.0}[kind]
    lr = np.float32(rng.choice([1e-4, 1e-3, 3e-2]))
    moved = master.copy()
    chosen = rng.random(master.size) < share
    moved[chosen] += lr * rng.standard_normal(int(chosen.sum()), dtype=np.float32) * np.abs(moved[chosen])
    current = _cast(moved, wire)[:nbytes].copy()
    if nbytes % item:  # the odd last byte changes too, sometimes
        current[-1] ^= np.uint8(rng.integers(0, 2))
    return base, current


@pytest.mark.parametrize("compressor", ["lz4", "zstd"])
@pytest.mark.parametrize("wire", ["bf16", "fp16", "fp32"])
def test_random_updates_round_trip_bit_exact(wire: str, compressor: Compressor) -> None:
    # Property-style: many random updates of every kind, sizes that are not
    # a multiple of the element size, of 8 bytes or of the chunk; every send
    # rebuilds the exact bytes, and no flipped byte goes unnoticed.
    rng = np.random.default_rng(["bf16", "fp16", "fp32"].index(wire))
    item = 4 if wire == "fp32" else 2
    seen: collections.Counter[str] = collections.Counter()
    for trial in range(24):
        nbytes = int(rng.choice([1, 7, 4094, 3 * CHUNK + 5, 2 * CHUNK, 70_001]))
        chunk = int(rng.choice([CHUNK, 4094, 1000]))
        kind = ["sparse", "dense", "random", "same"][trial % 4]
        base, current = _random_update(rng, wire, kind, nbytes)
        encoder = DeltaEncoder(nbytes, item, chunk_bytes=chunk, compressor=compressor, threads=1 + trial % 2)
        encoder.commit(base)
        frames = list(encoder.frames(current))
        host = base.copy()
        decoder = DeltaDecoder(host, item, chunk_bytes=chunk)
        seen.update(decoder.feed(frame).mode.name for frame in frames)
        decoder.check(version_digest(current))
        assert np.array_equal(host, current), (trial, kind, nbytes, chunk)
        # The full bytes rebuild it over anything.
        anything = np.full(nbytes, 7, dtype=np.uint8)
        full = DeltaDecoder(anything, item, chunk_bytes=chunk)
        for frame in encoder.frames(current, full=True):
            full.feed(frame)
        assert np.array_equal(anything, current)
        # Damage: a flipped byte in a frame's payload raises, or (a spare
        # bit of the compressor's header) still decodes exactly.
        index = int(rng.integers(0, len(frames)))
        start, stop = encoder.spans[index]
        frame = frames[index]
        if len(frame) > HEADER_SIZE:
            damaged = bytearray(frame)
            damaged[int(rng.integers(HEADER_SIZE, len(frame)))] ^= 1 << int(rng.integers(0, 8))
            out = base[start:stop].copy()
            try:
                decode_frame(damaged, out)
            except DeltaFrameError:
                pass
            else:
                assert np.array_equal(out, current[start:stop])
    assert {"SAME", "SPARSE", "DENSE", "RAW"} <= set(seen), seen


def test_an_uncommitted_send_leaves_the_base() -> None:
    v0, v1, v2 = _trajectory("bf16-lr1e-5", 2)
    encoder = DeltaEncoder(v0.nbytes, 2, chunk_bytes=CHUNK)
    encoder.commit(v0, version=0)
    list(encoder.frames(v1))  # sent, but not applied by everyone: no commit
    assert encoder.base_version == 0
    frames = list(encoder.frames(v2))
    on_v0 = v0.copy()  # a host that missed v1 rebuilds v2 from v0
    decoder = DeltaDecoder(on_v0, 2, chunk_bytes=CHUNK)
    for frame in frames:
        decoder.feed(frame)
    decoder.check(version_digest(v2))
    assert np.array_equal(on_v0, v2)
    on_v1 = DeltaDecoder(v1.copy(), 2, chunk_bytes=CHUNK)  # a host on v1 must not apply it
    with pytest.raises(DeltaFrameError):
        for frame in frames:
            on_v1.feed(frame)
    # In doubt: the full bytes rebuild v2 over anything.
    anything = np.full(v0.nbytes, 7, dtype=np.uint8)
    full = DeltaDecoder(anything, 2, chunk_bytes=CHUNK)
    for frame in encoder.frames(v2, full=True):
        assert not read_header(frame).mode.needs_base
        full.feed(frame)
    full.check(version_digest(v2))
    encoder.forget()
    assert not encoder.has_base


def test_the_decoder_checks_the_whole_version() -> None:
    v0, v1 = _trajectory("bf16-lr1e-5", 1)
    encoder = DeltaEncoder(v0.nbytes, 2, chunk_bytes=CHUNK)
    host = np.zeros(v0.nbytes, dtype=np.uint8)
    decoder = DeltaDecoder(host, 2, chunk_bytes=CHUNK)
    frames = list(encoder.frames(v0))
    decoder.feed(frames[0])
    with pytest.raises(DeltaFrameError, match="never came"):
        decoder.check(version_digest(v0))
    for frame in frames[1:]:
        decoder.feed(frame)
    with pytest.raises(DeltaFrameError, match="past the last"):
        decoder.feed(frames[0])
    with pytest.raises(DeltaFrameError, match="digest"):
        decoder.check(version_digest(v1))
    decoder.check(version_digest(torch.from_numpy(v0)))


@pytest.mark.extended  # a child interpreter of its own
def test_no_torch_intra_op_threads() -> None:
    # torch starts its intra-op pool on first parallel use: a fresh process
    # shows whether the cast, encoding and decoding ever used it.
    code = (
        "import os, numpy as np, torch\n"
        "from weightsync._copy import WireCast\n"
        "from weightsync._delta import DeltaDecoder, DeltaEncoder, require_codec\n"
        "require_codec()  # blosc2's import starts idle threads of its own\n"
        "t = torch.from_numpy(np.random.default_rng(0).standard_normal(4 << 20, dtype=np.float32))\n"
        "count = lambda: len(os.listdir('/proc/self/task'))\n"
        "before = count()\n"
        "cast = WireCast(torch.bfloat16).cast([t], threads=2)[0].view(torch.uint8)\n"
        "encoder = DeltaEncoder(cast.numel(), 2)\n"
        "host = np.zeros(cast.numel(), np.uint8)\n"
        "decoder = DeltaDecoder(host, 2)\n"
        "for frame in encoder.frames(cast):\n    decoder.feed(frame)\n"
        "after = count()\n"
        "t.to(torch.bfloat16)  # torch's own cast: the check can see the pool\n"
        "print(before, after, count(), torch.get_num_threads())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after, with_pool, threads = map(int, run.stdout.split())
    assert after == before
    assert with_pool > before or threads == 1


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # An entry of None in sys.modules makes ``import blosc2`` fail as if it
    # were not installed.
    monkeypatch.setitem(sys.modules, "blosc2", None)
    with pytest.raises(MissingExtraError, match=r"blosc2.*pip install 'weightsync\[delta\]'"):
        DeltaEncoder(10, 2)
    with pytest.raises(MissingExtraError, match=r"pip install 'weightsync\[delta\]'"):
        decode_frame(b"", np.zeros(0, dtype=np.uint8))


@pytest.mark.parametrize("name", ["bf16-lr1e-5", "fp32-lr3e-4"])
def test_lz4_frames_round_trip(name: str) -> None:
    a, b = _trajectory(name, 1)
    item = TRAJECTORIES[name].element_size
    zstd = DeltaEncoder(a.nbytes, item, chunk_bytes=CHUNK, compressor="zstd")
    lz4 = DeltaEncoder(a.nbytes, item, chunk_bytes=CHUNK, compressor="lz4")
    host = np.zeros(a.nbytes, dtype=np.uint8)
    for current in (a, b):
        assert _send(lz4, host, current)
        assert np.array_equal(host, current)
        zstd.commit(current)
    assert sum(map(len, lz4.frames(a, full=True))) > sum(map(len, zstd.frames(a, full=True)))


def test_threads_rebuild_in_parallel_bit_exact() -> None:
    """A decoder with threads rebuilds chunks on its own threads, reports
    only the chunks rebuilt in order, ends its threads, and raises the
    first failed chunk's error (at the latest by finish)."""
    import threading

    v0, v1 = _trajectory("bf16-lr1e-5", 1)
    encoder = DeltaEncoder(v0.nbytes, 2, chunk_bytes=CHUNK, threads=2)
    encoder.commit(v0)
    frames = list(encoder.frames(v1))
    assert encoder.last_cpu > 0 and encoder.last_wall > 0
    host = v0.copy()
    decoder = DeltaDecoder(host, 2, chunk_bytes=CHUNK, threads=3)
    seen = []
    for frame in frames:
        decoder.feed(frame)
        seen.append(decoder.decoded)
    assert seen == sorted(seen)
    decoder.check(version_digest(v1))
    assert np.array_equal(host, v1) and decoder.decoded == v1.nbytes and decoder.cpu > 0
    assert not [t for t in threading.enumerate() if t.name.startswith("weightsync-delta")]
    # A damaged frame in the middle: never silent, and the threads end.
    bad = bytearray(frames[len(frames) // 2])
    bad[-1] ^= 0xFF
    damaged = [*frames[: len(frames) // 2], bytes(bad), *frames[len(frames) // 2 + 1 :]]
    host = v0.copy()
    decoder = DeltaDecoder(host, 2, chunk_bytes=CHUNK, threads=2)
    with pytest.raises(DeltaFrameError):
        for frame in damaged:
            decoder.feed(frame)
        decoder.finish()
    decoder.finish_quietly()
    assert not [t for t in threading.enumerate() if t.name.startswith("weightsync-delta")]


def test_frames_use_the_frames_already_encoded() -> None:
    v0, v1 = _trajectory("bf16-lr1e-5", 1)
    encoder = DeltaEncoder(v0.nbytes, 2, chunk_bytes=CHUNK, threads=2)
    encoder.commit(v0)
    whole = list(encoder.frames(v1))
    ready = {1: encoder.encode(v1, 1)[0], 5: b"sentinel"}
    got = list(encoder.frames(v1, ready=ready))
    assert got[1] == whole[1] and got[5] == b"sentinel"
    assert got[:5] == whole[:5] and got[6:] == whole[6:]


def _route(seconds: float, encoded: bool, broke: str | None = None) -> object:
    from weightsync._transports._chain._driver import Encoded, Route

    route: Route[int] = Route("ns", "g1", (1,), {}, 1.0, CHUNK, encoded=Encoded(0, 2, 1) if encoded else None)
    route.seconds, route.broke = seconds, broke
    return route


def test_the_choice_sends_a_delta_only_where_it_pays() -> None:
    """delta=True weighs each send: the encode, the wire and the rebuild of
    a delta (a pipeline: the longest of them) against the full bytes' time
    per byte seen on recent sends."""
    from weightsync._transports._chain._delta_base import DeltaChoice

    size = 64 << 20
    choice = DeltaChoice()
    # No whole send measured yet: the full bytes, to measure them; a chain
    # that formed its group (and made its connections) is not measured.
    assert not choice.decide(size, 0.03, 0.5e-9) and "measured first" in choice.why
    fresh = _route(10.0, encoded=False)
    fresh.fresh = True  # type: ignore[attr-defined]
    choice.observe(size, fresh, None, [])  # type: ignore[arg-type]
    assert choice.full is None
    # 1 Gbit/s: 537 ms whole (two whole sends measured before any delta).
    choice.observe(size, _route(size / 125e6, encoded=False), None, [])  # type: ignore[arg-type]
    assert not choice.decide(size, 0.03, 0.5e-9)
    choice.observe(size, _route(size / 125e6, encoded=False), None, [])  # type: ignore[arg-type]
    assert choice.decide(size, 0.03, 0.5e-9), choice.why  # bf16 at a low lr: a delta pays
    assert not choice.decide(size, 1.0, 0.4e-9), choice.why  # random: the full bytes
    assert "full bytes: expected" in choice.why
    # fp32 at a high lr (0.75 of the bytes): a delta at 1 Gbit/s, whole at 10.
    assert choice.decide(size, 0.75, 0.8e-9), choice.why
    quicker = DeltaChoice()
    for _ in range(2):
        quicker.observe(size, _route(size / 1.25e9, encoded=False), None, [])  # type: ignore[arg-type]
    assert not quicker.decide(size, 0.75, 0.8e-9), quicker.why
    # A link faster than the codec (10 GB/s): the full bytes.
    fast = DeltaChoice()
    for _ in range(2):
        fast.observe(size, _route(size / 10e9, encoded=False), None, [])  # type: ignore[arg-type]
    assert not fast.decide(size, 0.03, 0.5e-9), fast.why
    # A delta that took three times its guess adds the difference to the
    # next guesses; sends that go whole ease it back.
    assert choice.decide(size, 0.03, 0.5e-9) and choice.guess is not None
    slow = 3 * choice.guess[0]
    # (The first delta, which also paid for what is done once, teaches nothing.)
    choice.observe(size, _route(100.0, encoded=True), None, [(0.2, 1)])  # type: ignore[arg-type]
    assert choice.extra == 0.0
    choice.observe(size, _route(slow, encoded=True), None, [(0.2, 1)])  # type: ignore[arg-type]
    assert choice.extra > 1.5 * choice.guess[0] and choice.rebuild is not None
    corrected = choice.expect(size, 0.03, 0.5e-9)
    assert corrected is not None and corrected[0] > 2.5 * choice.guess[0]
    for _ in range(300):
        choice.observe(size, _route(size / 125e6, encoded=False), None, [])  # type: ignore[arg-type]
    assert choice.extra < 0.001
    # One slow delta among quick ones does not stop the deltas.
    for seconds in (0.1, 5.0):
        assert choice.decide(size, 0.03, 0.5e-9)
        choice.observe(size, _route(seconds, encoded=True), None, [(0.2, 1)])  # type: ignore[arg-type]
    assert choice.decide(size, 0.03, 0.5e-9), choice.why
    # After a run of deltas, one send goes whole to measure the link again.
    choice.streak = 64
    assert not choice.decide(size, 0.03, 0.5e-9) and "measured again" in choice.why
    choice.observe(size, _route(size / 125e6, encoded=False), None, [])  # type: ignore[arg-type]
    assert choice.streak == 0 and choice.decide(size, 0.03, 0.5e-9)
    # One whole send slowed by others' load does not make deltas look good.
    choice.observe(size, _route(10.0, encoded=False), None, [])  # type: ignore[arg-type]
    assert choice.full == 1 / 125e6
    # A broken chain teaches nothing.
    before = list(choice.wholes)
    choice.observe(size, _route(0.001, encoded=False, broke="it broke"), None, [])  # type: ignore[arg-type]
    assert choice.wholes == before


def test_the_delta_base_samples_the_send_and_reuses_the_sample() -> None:
    from weightsync._transports._chain._delta_base import DeltaBase

    v0, v1 = _trajectory("bf16-lr1e-5", 1)
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 256, v0.nbytes, dtype=np.uint8)
    for setting, slow_link, current, goes in [
        (True, True, v1, True),  # pays
        (True, True, noise, False),  # random: whole
        (True, False, v1, False),  # a link faster than the codec: whole
        ("always", False, noise, True),  # "always": never weighed
    ]:
        base = DeltaBase.of(setting, CHUNK, threads=2)
        assert base is not None
        base.fit(v0.nbytes, 2)
        base.adopt(v0.copy(), 1)
        # A slow link: 200 Mbit/s, far below any codec (a 1 Gbit/s one is
        # within reach of a slow machine's codec at this small size).
        base.choice.wholes = [1 / 25e6 if slow_link else 1 / 1e12] * 2
        send = base.chain(current, {7})
        assert (send is not None) == goes, (setting, base.choice.why)
        assert base.choice.went == goes
        if send is not None:
            host = v0.copy()
            decoder = DeltaDecoder(host, 2, chunk_bytes=CHUNK, threads=2)
            for frame in send.frames():
                decoder.feed(frame)
            decoder.check(version_digest(current))
            assert np.array_equal(host, current) and send.encoded.threads == 2
    assert DeltaBase.of(False) is None


def test_a_member_that_fell_behind_gets_a_delta_against_the_version_it_holds() -> None:
    """The base moves on without a member that missed sends: its version is
    kept (``history``), and the next send carries two deltas, each rebuilt
    exactly from the version its members hold; once no member holds the
    old version it is let go, and with ``history=0`` the member that fell
    behind gets the full bytes."""
    from weightsync._transports._chain._delta_base import DeltaBase

    versions = _trajectory("bf16-lr1e-5", 6)
    nbytes = versions[0].nbytes
    base = DeltaBase.of("always", CHUNK, threads=1)
    assert base is not None and base.history == 1
    base.fit(nbytes, 2)
    assert base.adopt(versions[0].copy(), 0, {0}) is None
    # Member "late" stays at version 0 while "kept" acks versions 1 to 4.
    for v in range(1, 5):
        spare = base.adopt(versions[v].copy(), v, {v, 0})
        assert (spare is None) == (v == 1), v  # version 0 is kept, not handed back
        assert set(base.behind) == {0}
    sends = base.chains(versions[5], {"kept": 4, "late": 0, "new": None})
    assert [(s.encoded.base_version, set(s.eligible)) for s in sends] == [(4, {"kept"}), (0, {"late"})]
    assert "1 member(s) behind at version 0" in base.choice.behind[0]
    sizes = {}
    for send, held in zip(sends, (versions[4], versions[0]), strict=True):
        host = held.copy()
        decoder = DeltaDecoder(host, 2, chunk_bytes=CHUNK)
        frames = list(send.frames())
        for frame in frames:
            decoder.feed(frame)
        decoder.check(version_digest(versions[5]))
        assert np.array_equal(host, versions[5])
        sizes[send.encoded.base_version] = sum(len(f) for f in frames)
    # Five versions behind costs more than one, and still less than the full bytes.
    assert sizes[4] < sizes[0] < nbytes, sizes
    # Once no member holds version 0 (it caught up), its memory is handed back.
    spare = base.adopt(versions[5].copy(), 5, {5})
    assert base.behind == {} and spare is not None and spare.nbytes == nbytes
    # history=0: nothing is kept; the member behind gets the full bytes.
    none = DeltaBase.of("always", CHUNK, threads=1, history=0)
    assert none is not None
    none.fit(nbytes, 2)
    none.adopt(versions[0].copy(), 0, {0})
    assert none.adopt(versions[1].copy(), 1, {0, 1}) is not None and none.behind == {}
    assert [s.encoded.base_version for s in none.chains(versions[2], {"kept": 1, "late": 0})] == [1]


def test_only_the_newest_older_versions_are_kept() -> None:
    from weightsync._transports._chain._delta_base import DeltaBase

    versions = _trajectory("bf16-lr1e-5", 4)
    base = DeltaBase.of(True, CHUNK, threads=1, history=2)
    assert base is not None
    base.fit(versions[0].nbytes, 2)
    base.adopt(versions[0].copy(), 0, {0})
    # Members stay behind at 0, 1 and 2 while the base moves on: two are kept, the newest.
    base.adopt(versions[1].copy(), 1, {0, 1})
    base.adopt(versions[2].copy(), 2, {0, 1, 2})
    assert set(base.behind) == {0, 1}
    spare = base.adopt(versions[3].copy(), 3, {0, 1, 2, 3})
    assert set(base.behind) == {1, 2} and spare is not None
    # A new layout starts again: nothing is kept.
    base.fit(versions[0].nbytes // 2, 2)
    assert base.behind == {} and base.version is None


def test_the_schemes_take_delta_threads() -> None:
    import pickle

    import weightsync as ws

    for cls in (ws.DistributedWeightSyncScheme, ws.RayWeightSyncScheme):
        scheme = cls(delta=True, delta_threads=3)
        assert (scheme.delta, scheme.delta_threads, scheme.delta_history) == (True, 3, 1)
        again = pickle.loads(pickle.dumps(cls(delta=True, delta_threads=3, delta_history=4)))
        assert (again.delta, again.delta_threads, again.delta_history) == (True, 3, 4)
        assert cls(delta="always").delta == "always" and cls().delta_threads == 0
        assert scheme.last_delta_choice == {}  # nothing sent
        with pytest.raises(ValueError, match="delta_threads"):
            cls(delta=True, delta_threads=-1)
        with pytest.raises(ValueError, match="delta_history"):
            cls(delta=True, delta_history=-1)
        with pytest.raises(ValueError, match="'always'"):
            cls(delta="sometimes")  # type: ignore[arg-type]


def test_the_first_frame_leaves_before_the_last_chunk_is_encoded() -> None:
    """The chain takes a delta's frames from the encoder as it sends them:
    the first batch is on the wire before the last chunk is encoded (here
    every frame is a batch of its own: this update's frames are smaller
    than one batch together)."""
    from weightsync._delta import HEADER_SIZE
    from weightsync._transports._chain._pipeline import send_frames

    events: list[str] = []

    class Work:
        def wait(self, timeout: object) -> None:
            pass

    class Group:
        def send(self, tensors: object, dst: int, tag: int) -> Work:
            events.append(f"send {tag}")
            return Work()

    v0, v1 = _trajectory("bf16-lr1e-5", 1)
    encoder = DeltaEncoder(v0.nbytes, 2, chunk_bytes=CHUNK)
    encoder.commit(v0)

    def frames() -> Iterator[bytes]:
        for frame in encoder.frames(v1):
            events.append("encoded")
            yield frame

    send_frames(Group(), frames(), HEADER_SIZE, 1, 1.0, len(encoder.spans), batch_bytes=1)
    assert events.index("send 1") < len(events) - 1 - events[::-1].index("encoded")
    assert events.count("encoded") == len(encoder.spans) > 2


@pytest.mark.parametrize("batch_bytes", [1, 8000, 1 << 30], ids=["each", "some", "all"])
def test_frames_cross_a_real_gloo_chain_in_batches_bit_exact(batch_bytes: int) -> None:
    """A delta's frames, gathered into batches (one frame each, a few, all
    in one), go from rank 0 through rank 1, which hands each on and passes
    every batch to rank 2, over a real gloo group of three members (threads
    of this process); both receivers get every frame, in order, and
    rebuild the trainer's version from them."""
    import threading

    import torch.distributed as dist

    from weightsync._delta import HEADER_SIZE, read_header
    from weightsync._transports._chain._gloo import gloo_group
    from weightsync._transports._chain._pipeline import relay_frames, send_frames

    v0, v1 = _trajectory("bf16-lr1e-5", 1)
    encoder = DeltaEncoder(v0.nbytes, 2, chunk_bytes=CHUNK)
    encoder.commit(v0)
    frames = list(encoder.frames(v1))
    # Several frames, several batches of a few of them at 8000 bytes.
    assert len(frames) > 4 and 3 * 8000 < sum(map(len, frames)) < len(frames) * 8000
    store = dist.HashStore()
    got: dict[int, list[bytes]] = {1: [], 2: []}
    results: dict[int, object] = {}

    def length(header: torch.Tensor) -> int:
        return read_header(header.numpy()).payload_length

    def member(rank: int) -> None:
        try:
            group = gloo_group(store, f"batches-{batch_bytes}", rank, 3, "127.0.0.1", 30.0)
            if rank == 0:
                send_frames(group, iter(frames), HEADER_SIZE, 1, 30.0, len(frames), batch_bytes=batch_bytes)
                results[rank] = True
            else:
                results[rank] = relay_frames(
                    group, len(frames), HEADER_SIZE, length, rank - 1, 2 if rank == 1 else None, 30.0, 30.0,
                    lambda k, frame: got[rank].append(frame.numpy().tobytes()),
                )  # fmt: skip
        except Exception as exc:  # reported below, by rank
            results[rank] = exc

    threads = [threading.Thread(target=member, args=(rank,), daemon=True) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a member of the chain did not end"
    assert results == {0: True, 1: (True, None), 2: (True, None)}, results
    for rank in (1, 2):
        assert got[rank] == [bytes(f) for f in frames], f"rank {rank} got other frames"
        rebuilt = v0.copy()
        decoder = DeltaDecoder(rebuilt, 2, chunk_bytes=CHUNK)
        for frame in got[rank]:
            decoder.feed(np.frombuffer(frame, dtype=np.uint8))
        decoder.finish()
        assert np.array_equal(rebuilt, v1), f"rank {rank} did not rebuild the version"


def test_a_damaged_batch_head_is_a_broken_hop_named_as_such() -> None:
    """A batch head that announces more frames than the chain carries (or
    frames that run past their batch) is refused by the receiving member
    with a reason, never read as frames: its hop reports incomplete."""
    import struct
    import threading

    import torch.distributed as dist

    from weightsync._delta import HEADER_SIZE, read_header
    from weightsync._transports._chain._gloo import gloo_group
    from weightsync._transports._chain._pipeline import relay_frames

    store = dist.HashStore()
    results: dict[int, object] = {}
    # 9 frames announced where the chain carries 3; then a frame whose
    # header promises a payload past the end of its batch.
    cases = {"head": struct.pack("<qq", 64, 9), "frame": struct.pack("<qq", HEADER_SIZE, 1)}

    def length(header: torch.Tensor) -> int:
        return read_header(header.numpy()).payload_length

    def run(name: str, head: bytes) -> None:
        body = torch.zeros(struct.unpack("<qq", head)[0], dtype=torch.uint8)
        if name == "frame":
            encoder = DeltaEncoder(4096, 2, chunk_bytes=4096)
            frame = next(iter(encoder.frames(np.ones(4096, dtype=np.uint8))))
            body[:] = torch.frombuffer(bytearray(frame[:HEADER_SIZE]), dtype=torch.uint8)

        def member(rank: int) -> None:
            try:
                group = gloo_group(store, f"damaged-{name}", rank, 2, "127.0.0.1", 30.0)
                if rank == 0:
                    sent = [
                        group.send([torch.frombuffer(bytearray(head), dtype=torch.uint8)], 1, 1),
                        group.send([body], 1, 2),
                    ]
                    for work in sent:
                        work.wait(datetime.timedelta(seconds=10))
                    results[(name, rank)] = True
                else:
                    results[(name, rank)] = relay_frames(
                        group, 3, HEADER_SIZE, length, 0, None, 10.0, 10.0, lambda k, f: None
                    )
            except Exception as exc:  # reported below
                results[(name, rank)] = exc

        threads = [threading.Thread(target=member, args=(rank,), daemon=True) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), f"{name}: a member did not end"

    for name, head in cases.items():
        run(name, head)
    complete, why = results[("head", 1)]  # type: ignore[misc]
    assert not complete and "a damaged batch head (9 frames in 64 bytes)" in why, why
    complete, why = results[("frame", 1)]  # type: ignore[misc]
    assert not complete and "runs past its batch" in why, why
