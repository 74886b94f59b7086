"""The torch.distributed transport's control protocol: what the trainer and
its workers write to each other in the store, as typed records.

Keys under ``weightsync/<model>/<session>/`` (:class:`SessionKeys`)::

    live                         trainer: the liveness socket's address
    hello/<rank>                 worker:  a :class:`Hello`
    in/<rank>/<n>                trainer: the n-th notice to a worker: an
                                 :class:`UpdateNotice`, :class:`FollowNotice` or :class:`CloseNotice`
    lead/<rank>                  host leader: a :class:`Lead` (where its followers copy from);
                                 lead/0 the trainer's own, when it feeds the workers of its host
    joining/<generation>/<i>     group rank i of a chain: it is joining that group
    got/<generation>/<v>/<rank>  worker:  a chain ``Report`` of version v (and ``.../count``)
    replies/<v>                  workers: appended, one pickled (rank, None or the reason
                                 it did not apply) per worker of version v (its ack)

Each side polls with ``check()`` (tens of microseconds on a store of the
same host), never ``wait()``, so every wait has the caller's deadline. The
trainer reads all the replies of a send with one look (one key), however
many workers it has.
"""

from __future__ import annotations

import io
import pickle
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from ..._memory._segment import SegmentRef
from ..._packet import Signature
from .._chain._driver import Link

__all__ = [
    "CloseNotice",
    "FollowNotice",
    "Hello",
    "Lead",
    "Notice",
    "SendInfo",
    "SessionKeys",
    "TRAINER",
    "UpdateNotice",
    "decode",
    "decode_notice",
    "decode_replies",
    "encode",
    "encode_reply",
    "get_now",
    "session_key",
    "session_prefix",
    "wait_key",
]

#: The trainer's rank in its session (its workers are 1 .. N): the leader
#: named in a :class:`FollowNotice` when the trainer feeds its own host.
TRAINER = 0

# A key's polls (seconds): the first, and the longest (they double).
_IDLE_POLL = (0.001, 0.01)

T = TypeVar("T")


def session_prefix(model_id: str | None, session: str) -> str:
    """The prefix of every key of one trainer's session."""
    return f"weightsync/{model_id}/{session}/"


def session_key(model_id: str | None) -> str:
    """Where the trainer publishes its session (each init_on_sender a new one)."""
    return f"weightsync/{model_id}/session"


class SessionKeys:
    """The keys of one session (see the module's docstring)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.live = f"{prefix}live"

    def hello(self, rank: int) -> str:
        return f"{self.prefix}hello/{rank}"

    def notice(self, rank: int, n: int) -> str:
        return f"{self.prefix}in/{rank}/{n}"

    def lead(self, rank: int) -> str:
        return f"{self.prefix}lead/{rank}"

    def got(self, generation: str, version: int, rank: int | str) -> str:
        return f"{self.prefix}got/{generation}/{version}/{rank}"

    def replies(self, version: int) -> str:
        return f"{self.prefix}replies/{version}"


def encode(record: Any) -> bytes:
    """A record's bytes in the store."""
    return pickle.dumps(record)


def decode(data: bytes, kind: type[T]) -> T:
    """The record of ``kind`` that ``data`` holds.

    :raises TypeError: it holds something else.
    """
    record = pickle.loads(data)
    if not isinstance(record, kind):
        raise TypeError(f"expected a {kind.__name__} in the store, found {type(record).__name__}")
    return record


def encode_reply(rank: int, error: str | None) -> bytes:
    """A worker's reply to one version, appended to that version's ``replies`` key."""
    return pickle.dumps((rank, error))


def decode_replies(data: bytes) -> list[tuple[int, str | None]]:
    """The replies appended in ``data`` (see :func:`encode_reply`), in order."""
    stream = io.BytesIO(data)
    replies = []
    while stream.tell() < len(data):
        rank, error = pickle.load(stream)
        replies.append((int(rank), None if error is None else str(error)))
    return replies


def get_now(store: Any, key: str) -> bytes | None:
    """The value of ``key`` if it is set, else None; never waits."""
    if not store.check([key]):
        return None
    return bytes(store.get(key))


def wait_key(store: Any, key: str, deadline: float) -> bytes:
    """The value of ``key``, polled until ``deadline`` (``time.monotonic()``).

    :raises RuntimeError: it was not set in time (or the store failed).
    """
    delay = _IDLE_POLL[0]
    while True:
        value = get_now(store, key)
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {key!r} in the store")
        time.sleep(delay)
        delay = min(delay * 2, _IDLE_POLL[1])


@dataclass(frozen=True)
class Hello:
    """A worker's introduction, written once it is ready for its first notice."""

    pid: int
    hostname: str
    #: The address the trainer reaches it by (its host's).
    address: str
    signature: Signature
    #: Tells its liveness connection from an earlier worker's of the same rank.
    nonce: int
    #: The devices its model is on (``_placement``).
    devices: tuple[str, ...] = ("cpu",)


@dataclass(frozen=True)
class SendInfo:
    """What every worker of a send is told of it."""

    version: int
    layout_id: str
    subset: Signature | None
    #: The tensors' digests (verify=True), or None.
    digests: tuple[int, ...] | None
    #: Threads the worker may use for its copy into the model.
    threads: int
    nbytes: int
    #: The chain (its generation) that carries it.
    generation: str


@dataclass(frozen=True)
class UpdateNotice:
    """Take part in a chain: receive the send and pass it on (``link``)."""

    send: SendInfo
    link: Link
    #: It leads its host: it writes what it receives to shared memory for followers.
    feeds: bool


@dataclass(frozen=True)
class FollowNotice:
    """Copy the send from host leader ``leader``'s shared memory as it
    arrives (:data:`TRAINER`: from the trainer's staging buffer)."""

    send: SendInfo
    leader: int
    leader_pid: int
    stall: float
    first: float


@dataclass(frozen=True)
class CloseNotice:
    """The trainer shut down cleanly."""


Notice = UpdateNotice | FollowNotice | CloseNotice


def decode_notice(data: bytes) -> Notice:
    """The notice that ``data`` holds.

    :raises TypeError: it holds something else.
    """
    record = pickle.loads(data)
    if not isinstance(record, UpdateNotice | FollowNotice | CloseNotice):
        raise TypeError(f"expected a notice in the store, found {type(record).__name__}")
    return record


@dataclass(frozen=True)
class Lead:
    """Where a host leader receives a send (its followers copy from there)."""

    generation: str
    version: int
    segment: SegmentRef
