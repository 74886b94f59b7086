"""The trainer's delta base, for every chain that carries deltas
(``delta=True``: torch.distributed's chain, Ray's relay): the last whole
send that its receivers acked, kept as the encoder's base instead of
copied, the chain of encoded frames of each send against it (``_delta``
encodes, ``_chain`` carries the frames), and the choice, per send, of a
delta or the full bytes (:class:`DeltaChoice`).

A member that fell behind (cut off, stopped or slow for a few sends)
still holds an older version. Up to ``history`` of those older bases are
kept, each with an encoder of its own, as long as a member holds one: such
a member gets, in a chain of its own in the same send, a delta against
the version it holds, or the full bytes where that delta would not be
smaller (:meth:`DeltaBase.chains`).

Who holds which version is each transport's own to say (the workers of a
send that acked it; the host agents whose buffer holds it): a member
believed to hold it that does not says so and gets the full bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from ..._delta import DeltaEncoder, default_threads
from ..._frames import CHUNK_BYTES
from ..._packet import Manifest
from ._driver import Encoded, EncodedSend, Route

__all__ = ["HISTORY", "DeltaBase", "DeltaChoice", "DeltaSetting", "element_size"]

M = TypeVar("M", bound=Hashable)

#: Older bases kept for members that fell behind, by default: each costs a
#: buffer of the model's size, held only while a member holds its version.
HISTORY = 1

#: What a scheme's ``delta`` is: False (full bytes), True (a delta where it
#: is expected to pay, :class:`DeltaChoice`), or ``"always"`` (a delta
#: whenever the receivers hold a base: tests and measurements).
DeltaSetting = bool | Literal["always"]

# A delta goes only when it is expected to take at most this fraction of
# the full send's time: the margin covers the error of the guess, so that
# a send is never slower than the full bytes by much.
_MARGIN = 0.9
# The weight of the newest send in each kept rate.
_NEW = 0.5
# The chunks of a send encoded to judge it (a fraction of them, at least 2),
# spread over the send; their frames are used if the delta goes.
_SAMPLE_SHARE = 1 / 32
# The sends each guess is judged from: the quickest of the last few whole
# sends, and the least excess of the last few deltas (one send slowed by
# others' load must not make deltas look good, nor stop them for long).
_WINDOW = 4
# Whole sends measured before the first delta is weighed (one may be slow).
_FIRST_WHOLES = 2
# How much what a delta took beyond its guess eases back per whole send: a
# delta found slower than the full bytes by x is tried again after about
# log(x) / -log(_EASE) whole sends (13 for 1.5x), a few percent of the sends.
_EASE = 0.97
# A send goes whole after this many deltas in a row, to measure the full
# bytes again (a link, or a load, that changed): every 16th where the
# delta was expected to save less than half, every 64th otherwise. That
# costs at most a few percent of the time that deltas save.
_REMEASURE = (16, 64)


def element_size(manifest: Manifest) -> int:
    """The bytes per element that a send's frames split byte planes by: the
    dtype size that holds most of its bytes."""
    share: dict[int, int] = {}
    for spec in manifest.specs:
        share[spec.dtype.itemsize] = share.get(spec.dtype.itemsize, 0) + spec.nbytes
    return max(share, key=lambda size: share[size]) if share else 1


def _kept(old: float | None, new: float) -> float:
    return new if old is None else (1 - _NEW) * old + _NEW * new


@dataclasses.dataclass
class DeltaChoice:
    """Whether a send goes as a delta, from what the scheme's recent sends
    measured and a sample of this one.

    A delta's chain is a pipeline: the trainer encodes, the links carry the
    frames, each host rebuilds, so it takes about the longest of the three;
    the full bytes take what the quickest of the last few whole sends took
    per byte (sends go whole until two were measured, and again after a
    run of deltas; a chain that formed a new group, and so also made its
    connections, is not measured). The sample (a few chunks of this send,
    encoded on the chain's thread; their frames are sent if the delta
    goes) gives this send's encoded size and the encoder's CPU per byte;
    the hosts' reports give the rebuild's; the delta sends' own times add
    the least of what the last few took beyond their guesses (fixed costs,
    a host slower than thought, a busy machine; not the first delta, which
    also paid for what is done once), easing back while sends go whole.
    A delta goes where it is expected to take at most :data:`_MARGIN` of
    the full send's time: random weights, a dense update, or a link faster
    than the codec go whole.
    """

    #: Seconds per byte of the last few whole sends' chains (newest last).
    wholes: list[float] = dataclasses.field(default_factory=list)
    #: CPU seconds per byte of the encoder and of a host's rebuild.
    encode: float | None = None
    rebuild: float | None = None
    #: How many times faster than one thread the encoder ran (its threads).
    parallel: float = 1.0
    #: The seconds each of the last few delta chains took beyond its guess
    #: (fixed costs, a busy machine, slower hosts), easing back per whole send.
    excess: list[float] = dataclasses.field(default_factory=list)
    #: Deltas sent since the last whole send, and measured in all.
    streak: int = 0
    seen: int = 0
    #: Of the last send: whether it went as a delta, why, and the guesses (s).
    went: bool = False
    why: str = ""
    guess: tuple[float, float] | None = None
    #: Of the last delta send: encode and rebuild GB/s per core, and threads.
    rates: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Of the last send: per older version members that fell behind hold,
    #: what they were sent and why.
    behind: dict[int, str] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The last send: ``{"delta": bool, "why": str, "rates": {...},
        "behind": {version: why}}`` (``behind``: members that fell behind
        and hold an older version the trainer kept)."""
        return {"delta": self.went, "why": self.why, "rates": dict(self.rates), "behind": dict(self.behind)}

    @property
    def full(self) -> float | None:
        """Seconds per byte of a whole send: the quickest of the last few."""
        return min(self.wholes) if self.wholes else None

    def _stages(self, nbytes: int, ratio: float, encode: float) -> float:
        full = self.full
        assert full is not None
        cpu = encode if self.encode is None else max(encode, (encode + self.encode) / 2)
        rebuild = self.rebuild if self.rebuild is not None else cpu / 2
        return max(nbytes * cpu / self.parallel, ratio * nbytes * full, nbytes * rebuild)

    def expect(self, nbytes: int, ratio: float, encode: float) -> tuple[float, float] | None:
        """(delta seconds, full seconds) expected for a send of ``nbytes``
        whose sample encoded to ``ratio`` of its size at ``encode`` CPU
        seconds per byte; None while no whole send was measured."""
        full = self.full
        if full is None:
            return None
        return self._stages(nbytes, ratio, encode) + self.extra, nbytes * full

    @property
    def extra(self) -> float:
        """The seconds a delta is expected to take beyond the stages: the
        least of the last few deltas' (one slowed by others' load must not
        stop deltas for long)."""
        return max(min(self.excess), 0.0) if self.excess else 0.0

    def decide(self, nbytes: int, ratio: float, encode: float) -> bool:
        guess = self.guess = self.expect(nbytes, ratio, encode)
        if guess is None or len(self.wholes) < _FIRST_WHOLES:
            self.went, self.why = False, "full bytes: whole sends are measured first, to weigh deltas against"
            return False
        delta, full = guess
        self.went = delta <= _MARGIN * full
        if self.went and self.streak >= _REMEASURE[0 if delta > 0.5 * full else 1]:
            self.went, self.why = False, f"full bytes: measured again after {self.streak} deltas"
            return False
        verdict = "delta" if self.went else "full bytes"
        self.why = (
            f"{verdict}: expected {delta * 1e3:.0f} ms as a delta ({ratio:.3f} of the bytes) against "
            f"{full * 1e3:.0f} ms whole"
        )
        return self.went

    def observe(self, nbytes: int, route: Route[Any] | None, encoder: DeltaEncoder | None,
                rebuilds: Sequence[tuple[float, int]]) -> None:  # fmt: skip
        """What the first chain of a send of ``nbytes`` measured (``route``:
        None when no chain ran); ``encoder``: the one that encoded it, if it
        carried a delta; ``rebuilds``: the hosts' (CPU seconds, threads)."""
        if route is None or not nbytes or route.seconds <= 0 or route.fresh:
            # (A chain of a new group also paid for its connections.)
            return
        if route.encoded is None:
            self.streak = 0
            if route.broke is None:
                self.wholes = [*self.wholes, route.seconds / nbytes][-_WINDOW:]
            # A wrong guess is not held against the next sends for ever.
            self.excess = [e * _EASE if e > 0 else e for e in self.excess]
            return
        self.streak += 1
        if route.broke is not None:
            return
        rates: dict[str, float] = {}
        if encoder is not None and encoder.last_cpu > 0:
            self.encode = _kept(self.encode, encoder.last_cpu / nbytes)
            if encoder.last_wall > 0:
                self.parallel = max(1.0, min(encoder.threads, encoder.last_cpu / encoder.last_wall))
            rates.update(encode_gbps=nbytes / encoder.last_cpu / 1e9, encode_threads=encoder.threads)
        costs = [cpu for cpu, _ in rebuilds if cpu > 0]
        if costs:
            self.rebuild = _kept(self.rebuild, max(costs) / nbytes)
            rates.update(rebuild_gbps=nbytes / max(costs) / 1e9, rebuild_threads=max(t for _, t in rebuilds))
        self.rates = rates
        if self.guess is not None:
            beyond = route.seconds - (self.guess[0] - self.extra)
            # The first delta pays for what is done once (a host's first
            # import of the codec, its first work buffers): it teaches nothing.
            if self.seen:
                self.excess = [*self.excess, beyond][-_WINDOW:]
            self.seen += 1


class DeltaBase:
    """The encoder of one model's sends, its base, and the choice per send.

    The base is the buffer of a send that was whole and acked, kept rather
    than copied (:meth:`adopt`): the caller gathers or stages its next send
    in the memory of the base it replaces, so the base costs one buffer of
    the model's size and no copy. ``threads``: the encoder's threads, and
    those a host rebuilds with (0: :func:`~.._delta.default_threads`);
    ``always``: a delta whenever a base is held, without weighing it;
    ``history``: the older bases kept for members that fell behind."""

    def __init__(
        self, chunk: int = CHUNK_BYTES, *, threads: int = 0, always: bool = False, history: int = HISTORY
    ) -> None:
        self.chunk = chunk
        self.threads = threads if threads > 0 else default_threads()
        self.always = always
        self.history = history
        self.encoder: DeltaEncoder | None = None
        #: Older versions a member still holds -> an encoder whose base is
        #: that version (oldest first): a member that fell behind gets a
        #: delta against what it holds.
        self.behind: dict[int, DeltaEncoder] = {}
        self.choice = DeltaChoice()

    @classmethod
    def of(
        cls, setting: DeltaSetting, chunk: int = CHUNK_BYTES, threads: int = 0, history: int = HISTORY
    ) -> DeltaBase | None:
        """The delta base of a scheme's ``delta`` setting (None: no delta)."""
        if not setting:
            return None
        return cls(chunk, threads=threads, always=setting == "always", history=history)

    @property
    def version(self) -> int | None:
        """The base's version (None: no base)."""
        return None if self.encoder is None else self.encoder.base_version

    @property
    def memory(self) -> Any | None:
        """The base's memory (a numpy array; None: no base): the buffer of
        the send that was adopted, as long as the encoder keeps it."""
        return None if self.encoder is None else self.encoder.base

    def fits(self, nbytes: int) -> bool:
        """Whether a send of ``nbytes`` fits the encoder (may be adopted)."""
        return self.encoder is not None and self.encoder.nbytes == nbytes

    def fit(self, nbytes: int, element_size: int) -> bool:
        """Get ready for a send of ``nbytes`` split by ``element_size``:
        True where the encoder fits it (its base may serve), False where it
        starts again (a new layout: no base until a send is adopted)."""
        encoder = self.encoder
        if encoder is not None and encoder.nbytes == nbytes and encoder.element_size == element_size:
            return True
        self.encoder = self._encoder(nbytes, element_size) if nbytes else None
        self.behind = {}
        return False

    def _encoder(self, nbytes: int, element_size: int) -> DeltaEncoder:
        return DeltaEncoder(nbytes, element_size, chunk_bytes=self.chunk, threads=self.threads)

    def adopt(self, buffer: Any, version: int, held: Collection[int] = ()) -> Any | None:
        """Make ``buffer`` (a whole send of ``version``, acked by those that
        hold it from now on; it :meth:`fits`) the base, kept as it is: the
        caller must not write it again. ``held``: the versions the members
        hold from now on; the previous base is kept for those that hold
        its version (up to :attr:`history` older bases, the newest), and an
        older base no member holds is let go. Returns memory the caller may
        stage its next send in (a numpy array: the previous base's, or one
        let go; None: there is none)."""
        encoder = self.encoder
        assert encoder is not None, "fit() comes first"
        before = encoder.base_version
        spare = encoder.adopt(buffer, version)
        if spare is not None and before is not None and before in held and self.history > 0:
            older = self._encoder(encoder.nbytes, encoder.element_size)
            older.adopt(spare, before)
            self.behind[before] = older
            spare = None
        for kept in sorted(self.behind):
            if kept not in held or kept >= version or len(self.behind) > self.history:
                memory = self.behind.pop(kept).base
                spare = memory if spare is None else spare
        return spare

    def chains(self, current: Any, held: Mapping[M, int | None]) -> list[EncodedSend]:
        """The encoded chains of ``current`` (the send's flat bytes,
        unchanged until its frames are taken), given the version each
        member is believed to hold (``held``): first the delta against the
        base for the members that hold it (if it is expected to pay, see
        :meth:`chain`), then one per older base kept for members that fell
        behind, if its sample is smaller than the full bytes (see
        :meth:`catch_up`). Members in none of them get the full bytes.
        Blocks to encode the samples: call it on the chain's thread."""
        version = self.version
        out: list[EncodedSend] = []
        main = self.chain(current, {m for m, v in held.items() if v is not None and v == version})
        if main is not None:
            out.append(main)
        self.choice.behind = {}
        for old in sorted(self.behind, reverse=True):
            members = {m for m, v in held.items() if v == old}
            if members:
                encoded = self.catch_up(current, old, members)
                if encoded is not None:
                    out.append(encoded)
        return out

    def catch_up(self, current: Any, version: int, members: set[Any]) -> EncodedSend | None:
        """The delta of ``current`` against older base ``version`` for the
        ``members`` that hold it, or None where a sample of it is not
        smaller than the full bytes by :data:`_MARGIN` (the missed sends
        changed most of the bytes): they get the full bytes. With
        ``always``, a delta whenever the base is kept. Blocks to encode
        the sample (:attr:`DeltaChoice.behind` says what was chosen)."""
        encoder = self.behind[version]
        ready, ratio, _ = self._sample(encoder, current) if not self.always else ({}, 0.0, 0.0)
        went = self.always or ratio <= _MARGIN
        verdict = "delta" if went else "full bytes"
        size = "" if self.always else f", a delta of {ratio:.3f} of the bytes"
        self.choice.behind[version] = f"{verdict}: {len(members)} member(s) behind at version {version}{size}"
        if not went:
            return None
        link = Encoded(version, encoder.element_size, len(encoder.spans), self.threads)
        return EncodedSend(link, lambda: encoder.frames(current, ready=ready), members)

    @staticmethod
    def _sample(encoder: DeltaEncoder, current: Any) -> tuple[dict[int, bytes], float, float]:
        """A few chunks of ``current`` encoded against ``encoder``'s base,
        spread over the send: their frames (by chunk index), the fraction
        of their bytes the frames took, and the CPU seconds per byte."""
        count = len(encoder.spans)
        picks = max(2, round(count * _SAMPLE_SHARE))
        indices = sorted({min(count - 1, int((k + 0.5) * count / picks)) for k in range(picks)})
        ready: dict[int, bytes] = {}
        sampled = encoded = 0
        cpu = 0.0
        for index in indices:
            frame, seconds = encoder.encode(current, index)
            ready[index] = frame
            start, stop = encoder.spans[index]
            sampled, cpu, encoded = sampled + stop - start, cpu + seconds, encoded + len(frame)
        return ready, encoded / sampled, cpu / sampled

    def chain(self, current: Any, eligible: set[Any]) -> EncodedSend | None:
        """The delta chain of ``current`` (the send's flat bytes, unchanged
        until its frames are taken) for the ``eligible`` members (those
        believed to hold the base); None where there is no base, no member
        is eligible, or the delta is not expected to pay (the send goes as
        full bytes). Blocks to encode a sample of the send (see
        :class:`DeltaChoice`): call it on the chain's thread."""
        encoder, choice = self.encoder, self.choice
        choice.went, choice.guess = False, None
        if encoder is None or encoder.base_version is None or not eligible:
            choice.why = "full bytes: no receiver holds a base"
            return None
        ready: dict[int, bytes] = {}
        if self.always:
            choice.went, choice.why = True, "delta: always (delta='always')"
        else:
            ready, ratio, cpu = self._sample(encoder, current)
            if not choice.decide(encoder.nbytes, ratio, cpu):
                return None
        link = Encoded(encoder.base_version, encoder.element_size, len(encoder.spans), self.threads)
        return EncodedSend(link, lambda: encoder.frames(current, ready=ready), eligible)

    def observe(self, routes: Sequence[Route[Any]], rebuilds: Sequence[tuple[float, int]]) -> None:
        """After a send: what its first chain of the base's members measured
        (see :meth:`DeltaChoice.observe`): the delta against the base, else
        the first of the full bytes; a chain of members that fell behind
        teaches nothing of the others' sends."""
        encoder = self.encoder
        if not routes or encoder is None:
            return
        version = encoder.base_version
        first = next((r for r in routes if r.encoded is None or r.encoded.base_version == version), None)
        if first is None:
            return
        # (Only the base's encoder ran for this chain's frames, if any.)
        self.choice.observe(encoder.nbytes, first, encoder if first.encoded is not None else None, rebuilds)
