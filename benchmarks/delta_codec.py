"""Delta frames on real update trajectories: size on the wire and speed.

A small transformer is trained by AdamW (betas 0.9/0.95) on random data
(``weightsync.bench.TRAJECTORIES``); each step's sent bytes are compared
with the previous step's: the bf16 cast of an fp32 master at lr 1e-6, 3e-6
and 1e-5, fp32 at lr 3e-4, and random bytes (incompressible).

1. Candidates, in 1 MiB chunks of the XOR with the previous step, one
   thread: blosc2 (zstd, lz4; byte shuffle or bit shuffle), zstandard and
   lz4 on numpy byte planes, and the bitmap + values layout weightsync uses
   for sparse chunks; beside them, the size of the index/value format (a
   4-byte index and the value of each changed element, as TRL and
   SparseRL-Sync send).
2. weightsync's codec (``weightsync._delta``), adaptive per chunk, with its
   mode counts: encoded size as a fraction of S, encode MB/s on 1 and on
   ``--threads`` threads (and the ratio of their wall clocks: the target is
   at least 1.7x with 2 threads), decode MB/s on 1 and ``--threads``; the same with the sparse mode turned
   off (every changed chunk dense) to show what it earns, and with
   ``compressor='zstd'`` (smaller dense frames, slower).

Targets, one core: encode and decode at least 2 GB/s on bf16 lr 3e-6 and
1 GB/s on fp32 lr 3e-4; bf16 lr 3e-6 at most 0.03 S (index/value: about
0.12 S); random at most 1.01 S.

``--crossover`` instead compares sparse and dense frames on denser bf16
updates (lr 3e-5 to 3e-4): where a chunk should switch from one to the other.

Run: ``python benchmarks/delta_codec.py [--size 32] [--steps 4] [--repeat 3]``.
Single-thread rates are bytes per second of the calling thread's CPU time
(``time.thread_time``), so that others' load on a shared machine does not
count; the ``--threads`` column is the wall clock. Each is the median over
the steps and repeats; compare only figures from one run.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import time
from collections.abc import Callable

import numpy as np

from weightsync import _delta
from weightsync._delta import Compressor, DeltaDecoder, DeltaEncoder, read_header
from weightsync.bench import TRAJECTORIES, Trajectory, update_trajectory

MB = 1e6
CHUNK = 1 << 20
UINT = {2: np.uint16, 4: np.uint32}

Codec = tuple[Callable[[np.ndarray, int], bytes], Callable[[bytes, int, int], np.ndarray]]


def _planes(x: np.ndarray, item: int) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(-1, item).T).reshape(-1)


def _unplanes(x: np.ndarray, item: int) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(item, -1).T).reshape(-1)


def candidates() -> dict[str, Codec]:
    """Name -> (compress(chunk, element size), decompress(frame, size, element size))."""
    import blosc2

    out: dict[str, Codec] = {}

    def b2(codec: object, level: int, filt: object) -> Codec:
        def enc(x: np.ndarray, item: int) -> bytes:
            cparams = {"codec": codec, "clevel": level, "typesize": item, "filters": [filt], "nthreads": 1}
            return bytes(blosc2.compress2(x, cparams=cparams))

        def dec(f: bytes, size: int, item: int) -> np.ndarray:
            dst = np.empty(size, np.uint8)
            blosc2.decompress2(f, dst=dst, dparams={"nthreads": 1})
            return dst

        return enc, dec

    out["blosc2 zstd-1 shuffle"] = b2(blosc2.Codec.ZSTD, 1, blosc2.Filter.SHUFFLE)
    out["blosc2 zstd-3 shuffle"] = b2(blosc2.Codec.ZSTD, 3, blosc2.Filter.SHUFFLE)
    out["blosc2 zstd-1 bitshuffle"] = b2(blosc2.Codec.ZSTD, 1, blosc2.Filter.BITSHUFFLE)
    out["blosc2 lz4-1 shuffle"] = b2(blosc2.Codec.LZ4, 1, blosc2.Filter.SHUFFLE)
    out["blosc2 lz4-5 bitshuffle"] = b2(blosc2.Codec.LZ4, 5, blosc2.Filter.BITSHUFFLE)
    try:
        import zstandard

        zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
        out["zstandard-1 np planes"] = (
            lambda x, item: zc.compress(_planes(x, item).data),
            lambda f, size, item: _unplanes(np.frombuffer(zd.decompress(f), np.uint8), item),
        )
    except ImportError:
        pass
    try:
        import lz4.frame

        out["lz4.frame np planes"] = (
            lambda x, item: lz4.frame.compress(_planes(x, item)),
            lambda f, size, item: _unplanes(np.frombuffer(lz4.frame.decompress(f), np.uint8), item),
        )
    except ImportError:
        pass
    return out


def _rate(nbytes: int, seconds: list[float]) -> float:
    # The median: one run slowed by others' load on a shared machine, or
    # one lucky run, does not set the figure.
    return nbytes / statistics.median(seconds) / MB


def measure_candidates(
    steps: list[np.ndarray], item: int, repeat: int
) -> list[tuple[str, float, float, float]]:
    """(name, size / S, encode MB/s, decode MB/s) of each candidate, on the
    XOR of consecutive steps (the XOR itself not timed)."""
    deltas = [np.bitwise_xor(b, a) for a, b in itertools.pairwise(steps)]
    size = steps[0].nbytes
    rows = []
    for name, (enc, dec) in candidates().items():
        sizes, te, td = [], [], []
        for _ in range(repeat):
            for d in deltas:
                chunks = [d[i : i + CHUNK] for i in range(0, size, CHUNK)]
                t0 = time.thread_time()
                frames = [enc(c, item) for c in chunks]
                te.append(time.thread_time() - t0)
                t0 = time.thread_time()
                for f, c in zip(frames, chunks, strict=True):
                    dec(f, c.nbytes, item)
                td.append(time.thread_time() - t0)
                sizes.append(sum(map(len, frames)))
        rows.append((name, statistics.mean(sizes) / size, _rate(size, te), _rate(size, td)))
    return rows


def index_value_size(steps: list[np.ndarray], item: int) -> float:
    """Bytes of the index/value format (4-byte index + value per changed
    element) as a fraction of S, averaged over the steps."""
    dt = UINT[item]
    changed = [int(np.count_nonzero(a.view(dt) != b.view(dt))) for a, b in itertools.pairwise(steps)]
    return statistics.mean(changed) * (4 + item) / steps[0].nbytes


def changed_fraction(steps: list[np.ndarray], item: int) -> float:
    dt = UINT[item]
    return statistics.mean(float(np.mean(a.view(dt) != b.view(dt))) for a, b in itertools.pairwise(steps))


def measure_codec(
    steps: list[np.ndarray],
    item: int,
    threads: int,
    repeat: int,
    sparse: bool = True,
    compressor: Compressor = "lz4",
) -> dict[str, object]:
    """weightsync's codec over the trajectory: size / S, modes, encode MB/s
    on 1 and ``threads`` threads, decode MB/s; every step checked bit-exact."""
    saved = _delta.SPARSE_DENSITY
    if not sparse:
        _delta.SPARSE_DENSITY = -1.0
    try:
        size = steps[0].nbytes
        sizes: list[int] = []
        modes: collections.Counter[str] = collections.Counter()
        te: dict[int, list[float]] = {1: [], threads: []}
        wall1: list[float] = []
        td: list[float] = []
        tdn: list[float] = []
        for _ in range(repeat):
            for a, b in itertools.pairwise(steps):
                for n in sorted(te):
                    encoder = DeltaEncoder(size, item, chunk_bytes=CHUNK, threads=n, compressor=compressor)
                    encoder.commit(a)
                    # One thread: its CPU time (and the wall clock, for the
                    # ratio); several: the wall clock.
                    t0, w0 = time.thread_time(), time.perf_counter()
                    frames = list(encoder.frames(b))
                    te[n].append(time.thread_time() - t0 if n == 1 else time.perf_counter() - w0)
                    if n == 1:
                        wall1.append(time.perf_counter() - w0)
                host = a.copy()
                decoder = DeltaDecoder(host, item, chunk_bytes=CHUNK)
                t0 = time.thread_time()
                for f in frames:
                    decoder.feed(f)
                td.append(time.thread_time() - t0)
                if not np.array_equal(host, b):
                    raise SystemExit("not bit-exact")
                if threads > 1:
                    host = a.copy()
                    decoder = DeltaDecoder(host, item, chunk_bytes=CHUNK, threads=threads)
                    t0 = time.perf_counter()
                    for f in frames:
                        decoder.feed(f)
                    decoder.finish()
                    tdn.append(time.perf_counter() - t0)
                    if not np.array_equal(host, b):
                        raise SystemExit("not bit-exact")
                sizes.append(sum(map(len, frames)))
                modes.update(read_header(f).mode.name for f in frames)
    finally:
        _delta.SPARSE_DENSITY = saved
    return {
        "size": statistics.mean(sizes) / size,
        "modes": dict(modes),
        "enc1": _rate(size, te[1]),
        "encN": _rate(size, te[threads]),
        # The wall clock of N threads over that of one, in the same rounds.
        "speedup": statistics.median(wall1) / statistics.median(te[threads]) if threads > 1 else 1.0,
        "dec": _rate(size, td),
        "decN": _rate(size, tdn) if tdn else 0.0,
    }


def memcpy_rate(nbytes: int, repeat: int) -> float:
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(max(3, repeat)):
        t0 = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - t0)
    return _rate(nbytes, times)


def crossover(size: int) -> None:
    """Sparse against dense frames on denser bf16 updates (higher learning
    rates): where ``SPARSE_DENSITY`` should lie."""
    saved = _delta.SPARSE_DENSITY
    try:
        for lr in (3e-5, 1e-4, 3e-4):
            steps = [t.numpy() for t in update_trajectory(Trajectory("bf16", "bf16", lr), size, 2)]
            frac = changed_fraction(steps[1:], 2)
            sizes = []
            for density in (1.0, -1.0):  # every changed chunk sparse, then dense
                _delta.SPARSE_DENSITY = density
                encoder = DeltaEncoder(steps[0].nbytes, 2, chunk_bytes=CHUNK)
                encoder.commit(steps[1])
                sizes.append(sum(map(len, encoder.frames(steps[2]))) / steps[0].nbytes)
            print(f"  bf16 lr {lr:g}: {frac:.1%} changed, sparse {sizes[0]:.4f} S, dense {sizes[1]:.4f} S")
    finally:
        _delta.SPARSE_DENSITY = saved


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=float, default=32.0, help="fp32 model size in MiB (default 32)")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per trajectory (default 4)")
    parser.add_argument("--repeat", type=int, default=3, help="timing repeats (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="encoder threads for the second column")
    parser.add_argument("--cases", default=",".join(TRAJECTORIES), help="comma-separated trajectories")
    parser.add_argument("--no-candidates", action="store_true", help="only weightsync's codec")
    parser.add_argument(
        "--compressor", choices=("lz4", "zstd"), default="lz4", help="the dense compressor (default lz4)"
    )
    parser.add_argument(
        "--crossover", action="store_true", help="only sparse against dense frames at higher bf16 lr"
    )
    args = parser.parse_args()
    if args.crossover:
        crossover(int(args.size * 2**20))
        return
    print(f"memcpy {memcpy_rate(int(args.size * 2**20), args.repeat):.0f} MB/s on this machine")
    summary = []
    for name in args.cases.split(","):
        kind = TRAJECTORIES[name]
        t0 = time.perf_counter()
        steps = [t.numpy() for t in update_trajectory(kind, int(args.size * 2**20), args.steps)]
        item = kind.element_size
        frac = changed_fraction(steps, item)
        iv = index_value_size(steps, item)
        print(
            f"\n== {name}: S = {steps[0].nbytes / 2**20:.1f} MiB, {frac:.2%} of elements changed per step,"
            f" trained in {time.perf_counter() - t0:.0f} s"
        )
        print(f"  {'index/value (4-byte index + value)':34s} {iv:7.4f} S")
        if not args.no_candidates:
            for cand, s, enc, dec in measure_candidates(steps, item, args.repeat):
                print(f"  {cand:34s} {s:7.4f} S   enc {enc:6.0f} MB/s   dec {dec:6.0f} MB/s  (XOR not timed)")
        other: Compressor = "zstd" if args.compressor == "lz4" else "lz4"
        variants: tuple[tuple[str, bool, Compressor], ...] = (
            ("weightsync._delta adaptive", True, args.compressor),
            ("  same, sparse mode off", False, args.compressor),
            (f"  same, compressor={other!r}", True, other),
        )
        for label, sparse, compressor in variants:
            r = measure_codec(steps, item, args.threads, args.repeat, sparse, compressor)
            print(
                f"  {label:34s} {r['size']:7.4f} S   enc {r['enc1']:6.0f} MB/s (1 thread, CPU)"
                f" {r['encN']:6.0f} MB/s ({args.threads} threads, wall)"
                f" x{r['speedup']:.2f}   dec {r['dec']:6.0f} MB/s,"
                f" {r['decN']:6.0f} MB/s ({args.threads} threads)"
                f"   {r['modes']}"
            )
            if sparse and compressor == args.compressor:
                summary.append((name, frac, iv, r))
    print(
        "\n| case | changed | index/value | weightsync | enc, 1 thread (CPU time)"
        f" | enc, {args.threads} threads (wall) | over 1 thread (wall) | dec, 1 thread (CPU time) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, frac, iv, r in summary:
        print(
            f"| {name} | {frac:.1%} | {iv:.3f} S | {r['size']:.4f} S | {r['enc1']:.0f} MB/s"
            f" | {r['encN']:.0f} MB/s | x{r['speedup']:.2f} | {r['dec']:.0f} MB/s |"
        )


if __name__ == "__main__":
    main()
