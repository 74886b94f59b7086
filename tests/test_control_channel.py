"""What the sender does with whatever arrives on a worker's pipe: anything
holding the worker's end may write garbage, acks of versions never sent,
messages for another model, or duplicates. Here the test itself holds that
end and plays the worker, message by message, over a real pipe."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
from harness.workers import build_model

import weightsync as ws
from weightsync._packet import Manifest


class FakeWorker:
    """The test's end of worker 0's pipe, speaking the protocol by hand."""

    def __init__(self) -> None:
        self.model = build_model("net", seed=7)
        self.scheme = ws.MultiProcessWeightSyncScheme(timeout=5)
        self.ours, self.theirs = mp.Pipe()
        self.scheme.init_on_sender("policy", pipes=[self.ours], model=self.model)
        signature = Manifest.of(self.model.state_dict()).signature
        self.theirs.send(("hello", "policy", os.getpid(), signature, ("cpu",)))
        self.sender = self.scheme.get_sender()

    def next_update(self) -> int:
        """The newest update the sender posted (older ones are skipped, as a
        real worker skips them)."""
        assert self.theirs.poll(5), "no update came"
        version = 0
        while self.theirs.poll(0.05):
            message = self.theirs.recv()
            # (After the first, a notice like the last but for its version
            # is only that: "again".)
            assert message[0] in ("update", "again")
            version = message[1]
        return version

    def close(self) -> None:
        self.scheme.shutdown()
        self.ours.close()
        self.theirs.close()


@pytest.fixture
def worker() -> Iterator[FakeWorker]:
    w = FakeWorker()
    yield w
    w.close()


def _send_expecting_protocol_error(w: FakeWorker, reply: object, *, raw: bool = False) -> str:
    w.sender.send_async()
    version = w.next_update()
    if raw:
        assert isinstance(reply, bytes)
        w.theirs.send_bytes(reply)
    else:
        w.theirs.send(reply(version) if callable(reply) else reply)
    with pytest.raises(ws.WorkerProtocolError) as info:
        w.sender.wait_async()
    assert info.value.worker_ids == (0,) and "worker 0" in str(info.value)
    return str(info.value)


def _a_good_send_works(w: FakeWorker) -> None:
    w.sender.send_async()
    version = w.next_update()
    w.theirs.send(("ack", version, None))
    assert w.sender.wait_async().version == version


@pytest.mark.parametrize(
    "garbage",
    [b"\x00not a pickle", b"", "a string", ("ack",), ("ack", 1, None, "extra"), ("bogus", 1, 2), 42],
    ids=["bytes", "empty", "str", "short", "long", "unknown-kind", "int"],
)
def test_garbage_fails_the_send_naming_the_worker_and_the_next_send_works(
    worker: FakeWorker, garbage: object
) -> None:
    _send_expecting_protocol_error(worker, garbage, raw=isinstance(garbage, bytes))
    _a_good_send_works(worker)


def test_an_ack_of_a_version_never_sent_completes_nothing(worker: FakeWorker) -> None:
    message = _send_expecting_protocol_error(worker, lambda v: ("ack", v + 5, None))
    assert "never sent" in message
    _a_good_send_works(worker)


def test_an_announcement_for_another_model_is_refused(worker: FakeWorker) -> None:
    signature = Manifest.of(worker.model.state_dict()).signature
    message = _send_expecting_protocol_error(worker, ("hello", "value", os.getpid(), signature, ("cpu",)))
    assert "'value'" in message
    _a_good_send_works(worker)


def test_an_error_for_a_version_never_sent_is_refused(worker: FakeWorker) -> None:
    _send_expecting_protocol_error(worker, lambda v: ("error", v + 1, "boom"))
    _a_good_send_works(worker)


def test_a_duplicate_ack_is_harmless_and_completes_no_later_send(worker: FakeWorker) -> None:
    worker.sender.send_async()
    first = worker.next_update()
    worker.theirs.send(("ack", first, None))
    worker.theirs.send(("ack", first, None))  # duplicate
    assert worker.sender.wait_async().version == first
    # The duplicate is read during the next send: it must not complete it.
    with pytest.raises(ws.AckTimeoutError):
        worker.sender.send(timeout=0.5)
    _a_good_send_works(worker)


def test_garbage_reaches_the_user_as_weightsync_errors_only(worker: FakeWorker) -> None:
    """Nothing raw (KeyError, IndexError, an anyio ExceptionGroup) escapes."""
    for garbage in (("hello",), ("hello", "policy", "not a pid", (), ("cpu",)), ("error", "x", "y")):
        worker.sender.send_async()
        worker.next_update()
        worker.theirs.send(garbage)
        with pytest.raises(ws.WeightSyncError):
            worker.sender.wait_async()
    _a_good_send_works(worker)


def test_a_worker_that_announces_itself_again_mid_send_is_told_the_update_again(worker: FakeWorker) -> None:
    """A worker that re-initialised while a send waited for its ack (a new
    hello instead of the ack) is sent the same update again, and its ack of
    that completes the send."""
    handle = worker.sender.send_async()
    handle.done()  # (its acks are gathered in the background from here on, not only at a wait)
    version = worker.next_update()
    signature = Manifest.of(worker.model.state_dict()).signature
    worker.theirs.send(("hello", "policy", os.getpid(), signature, ("cpu",)))
    assert worker.next_update() == version  # told again
    worker.theirs.send(("ack", version, None))
    report = worker.sender.wait_async()
    assert report.version == version and report.worker_ids == (0,)
    _a_good_send_works(worker)


def _connect(worker: FakeWorker, connected: bool) -> None:
    """With ``connected``, one send first: the sender has read the worker's
    announcement, and a blocking send() then runs without an event loop."""
    if connected:
        _a_good_send_works(worker)


@pytest.mark.parametrize("connected", [False, True], ids=["first-send", "later-send"])
def test_a_blocking_send_completes_on_its_versions_ack_not_a_stale_one(
    worker: FakeWorker, connected: bool
) -> None:
    """send() on this thread, the worker's replies from another: the ack
    of the version posted completes it, a stale ack before it does not."""
    _connect(worker, connected)
    got: list[int] = []

    def play() -> None:
        version = worker.next_update()
        worker.theirs.send(("ack", version - 1, None))  # stale: an earlier version's
        worker.theirs.send(("ack", version, None))
        got.append(version)

    player = threading.Thread(target=play)
    player.start()
    report = worker.sender.send()
    player.join(10)
    assert got == [report.version]


def _flood(pipe: Connection) -> None:
    stale = pickle.dumps(("ack", 0, None))
    with contextlib.suppress(OSError):
        while True:
            pipe.send_bytes(stale)


@pytest.mark.parametrize("connected", [False, True], ids=["first-send", "later-send"])
def test_a_worker_flooding_its_pipe_cannot_hold_off_the_deadline(worker: FakeWorker, connected: bool) -> None:
    """Stale acks without end, from another process, and never the ack of
    the version sent: the blocking send still ends at its deadline, naming
    the worker."""
    _connect(worker, connected)
    flooder = mp.get_context("fork").Process(target=_flood, args=(worker.theirs,), daemon=True)
    flooder.start()
    started = time.monotonic()
    try:
        with pytest.raises(ws.AckTimeoutError) as info:
            worker.sender.send(timeout=0.5)
        assert time.monotonic() - started < 3
        assert info.value.worker_ids == (0,)
    finally:
        flooder.kill()
        flooder.join(5)


def test_a_blocking_send_to_a_worker_announcing_itself_again_tells_it_again(worker: FakeWorker) -> None:
    """send() (no event loop once connected) meets a new hello instead of
    the ack: the update is posted again, and the ack of that completes it."""
    _connect(worker, True)
    signature = Manifest.of(worker.model.state_dict()).signature
    told: list[int] = []

    def play() -> None:
        version = worker.next_update()
        worker.theirs.send(("hello", "policy", os.getpid(), signature, ("cpu",)))
        told.extend([version, worker.next_update()])
        worker.theirs.send(("ack", version, None))

    player = threading.Thread(target=play)
    player.start()
    report = worker.sender.send()
    player.join(10)
    assert told == [report.version, report.version]
    _a_good_send_works(worker)


def test_ctrl_c_ends_a_blocking_send_waiting_for_an_ack(worker: FakeWorker) -> None:
    """Ctrl-C while send() waits for an ack that never comes: it raises
    KeyboardInterrupt within a poll slice, and the next send works."""
    _connect(worker, True)
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    started = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.sender.send(timeout=30)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 2
    worker.next_update()  # the abandoned update
    _a_good_send_works(worker)


@pytest.mark.parametrize("connected", [False, True], ids=["first-send", "later-send"])
def test_ctrl_c_while_send_async_stages_leaves_the_sender_free(worker: FakeWorker, connected: bool) -> None:
    """Ctrl-C that lands while send_async() reads and stages the weights:
    it raises KeyboardInterrupt, no worker is told, and the next send works."""
    _connect(worker, connected)
    hook = worker.model.register_state_dict_pre_hook(lambda *args: signal.raise_signal(signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.sender.send_async()
    finally:
        hook.remove()
    assert not worker.sender.pending
    assert not worker.theirs.poll(0.2)  # nothing was posted
    _a_good_send_works(worker)


@pytest.mark.parametrize(
    "hello",
    [
        pytest.param(lambda sig: ("hello", "policy", os.getpid(), sig, ("cpu",), ()), id="with-reach"),
        pytest.param(lambda sig: ("hello", "policy", os.getpid(), sig, ("cpu",)), id="older-without-reach"),
        pytest.param(lambda sig: ("hello", "policy", os.getpid(), sig, ("cpu",), (), "x"), id="too-long"),
    ],
)
def test_a_hello_names_the_gpus_a_worker_reaches_or_is_read_as_an_older_one(
    worker: FakeWorker, hello: object
) -> None:
    """A worker's hello may end with the GPUs it can copy from device to
    device (an older worker's does not); anything longer breaks the protocol."""
    signature = Manifest.of(worker.model.state_dict()).signature
    message = hello(signature)  # type: ignore[operator]
    if len(message) > 6:
        assert "not a message" in _send_expecting_protocol_error(worker, message)
        return
    worker.theirs.send(message)
    _a_good_send_works(worker)


def test_a_notice_is_framed_once_and_carries_each_sends_version() -> None:
    """The sender frames an update notice once per layout and descriptor
    and writes each send's version into it: what a worker reads back is the
    notice pickled whole, whatever the version (and a descriptor that holds
    the version's mark itself falls back to framing each notice whole)."""
    from weightsync._memory._segment import SegmentRef
    from weightsync._transports._pipes._transport import _MARK_BYTES, EncodedUpdates, VersionedFrames

    for token in (b"\x00" * 16, _MARK_BYTES * 3 + b"x"):
        frames = VersionedFrames()
        notices = EncodedUpdates()
        ref = SegmentRef(os.getpid(), 5, 1 << 20, token)
        told = None
        for version in (1, 2, 255, 256, 65536, 2**31 - 1, 2**31, 2**40):
            message = ("update", version, "layout", ref, 2, os.getpid(), None, None)
            data = frames.encoded(message)
            assert int.from_bytes(data[:4], "big") == len(data) - 4  # Connection's framing
            assert pickle.loads(data[4:]) == message
            assert frames.encoded(message) is data  # every worker of the send: the same bytes
            # A worker told this notice before, but for its version, is told the version only.
            said = pickle.loads(notices.encoded(message, again=told == message[:1] + message[2:])[4:])
            assert said == (message if told is None else ("again", version))
            told = message[:1] + message[2:]
        moved = ("update", 2**40 + 1, "layout", SegmentRef(os.getpid(), 6, 2 << 20, token), 2, 1, None, None)
        again = told == moved[:1] + moved[2:]
        assert pickle.loads(notices.encoded(moved, again=again)[4:]) == moved  # (another segment: whole)


def test_a_worker_is_told_the_version_only_while_the_rest_stays_and_whole_after_a_hello(
    worker: FakeWorker,
) -> None:
    """In the steady state a notice is ("again", version); once the sender
    read the worker's new hello it tells it the whole notice (an "again"
    it posted before reading the hello is passed over by the worker)."""
    kinds = []
    for _ in range(3):
        worker.sender.send_async()
        assert worker.theirs.poll(5)
        message = worker.theirs.recv()
        kinds.append(message[0])
        worker.theirs.send(("ack", message[1], None))
        assert worker.sender.wait_async().version == message[1]
    assert kinds == ["update", "again", "again"], kinds
    signature = Manifest.of(worker.model.state_dict()).signature
    worker.theirs.send(("hello", "policy", os.getpid(), signature, ("cpu",)))
    worker.sender.send_async().done()  # (its acks gathered in the background: the hello is read)
    said = []
    while not said or said[-1][0] != "update":
        assert worker.theirs.poll(5), said
        said.append(worker.theirs.recv())
    assert [m[0] for m in said] in (["update"], ["again", "update"]), said
    assert len({m[1] for m in said}) == 1, said
    worker.theirs.send(("ack", said[-1][1], None))
    worker.sender.wait_async()


def test_a_worker_reads_again_as_its_last_notice_with_the_new_version() -> None:
    """The worker's end keeps the last whole notice it read: an "again"
    is that notice with another version; one before any whole notice (sent
    before the sender heard this endpoint's hello) is passed over."""
    from weightsync._memory._segment import SegmentRef
    from weightsync._transports._pipes._channel import frame
    from weightsync._transports._pipes._copy_staging import CopyReader
    from weightsync._transports._pipes._transport import PipeEndpoint

    ours, theirs = mp.Pipe()
    endpoint = PipeEndpoint(ours, "policy", CopyReader())
    try:
        fd = theirs.fileno()
        os.write(fd, frame(("again", 3)))
        assert endpoint.take_ready() is None
        ref = SegmentRef(os.getpid(), 5, 1 << 20, b"\x00" * 16)
        os.write(fd, frame(("update", 4, "layout", ref, 2, os.getpid(), None, None)) + frame(("again", 5)))
        update = endpoint.take_ready()
        assert update is not None
        assert (update.version, update.layout_id, update.descriptor) == (5, "layout", ref)
        os.write(fd, frame(("again", 6)))
        update = endpoint.take_ready()
        assert update is not None and (update.version, update.descriptor, update.threads) == (6, ref, 2)
    finally:
        ours.close()
        theirs.close()


def test_the_channel_reads_frames_split_or_together() -> None:
    """A channel reads whatever came at once and takes whole frames from it:
    one frame written in pieces is taken once all of it came, and several
    frames that came together are taken one by one."""
    from weightsync._transports._pipes._channel import PipeChannel, frame

    ours, theirs = mp.Pipe()
    channel = PipeChannel(ours, RuntimeError, RuntimeError)
    try:
        big = frame(("hello", "x" * 100_000))
        fd = theirs.fileno()
        os.write(fd, big[:3])
        assert channel.poll() is None  # not even the length yet
        os.write(fd, big[3:50_000])
        assert channel.poll() is None
        assert channel.wait_ready(0) is False  # (what came was read: the rest is to come)
        os.write(fd, big[50_000:] + frame(("ack", 1, None)) + frame(("ack", 2, None)))
        assert channel.poll() == ("hello", "x" * 100_000)
        assert channel.poll() == ("ack", 1, None)
        assert channel.wait_ready(0) is True  # (read already: no descriptor says so)
        assert channel.poll() == ("ack", 2, None)
        assert channel.poll() is None
        theirs.send(("ack", 3, None))  # a plain Connection frames the same way
        assert channel.poll() == ("ack", 3, None)
        # Every message that came, at once: one frame, several, part of one.
        assert channel.poll_all() == []
        os.write(fd, frame(("ack", 4, None)))
        assert channel.poll_all() == [("ack", 4, None)]
        os.write(fd, frame(("ack", 5, None)) + frame(("ack", 6, None)) + big[:10])
        assert channel.poll_all() == [("ack", 5, None), ("ack", 6, None)]
        os.write(fd, big[10:])
        assert channel.poll_all() == [("hello", "x" * 100_000)]
        theirs.close()
        with pytest.raises(RuntimeError, match="closed"):
            channel.poll()
    finally:
        channel.close()
        ours.close()


def test_a_worker_that_hears_the_close_lets_go_and_says_so() -> None:
    """On the trainer's close a worker lets go of whatever it held of the
    trainer's memory (its GPU memory, on a GPU), then says so ("released"),
    before it raises SenderClosedError: a trainer that told it of its GPU
    memory waits for that (bounded) before it frees the memory."""
    from weightsync._transports._pipes._copy_staging import CopyReader
    from weightsync._transports._pipes._transport import PipeEndpoint

    trainer_end, worker_end = mp.Pipe(duplex=True)
    endpoint = PipeEndpoint(worker_end, "policy", CopyReader())
    try:
        trainer_end.send(("close",))
        with pytest.raises(ws.SenderClosedError, match="shut down"):
            endpoint.take_ready()
        assert trainer_end.poll(5)
        assert trainer_end.recv() == ("released",)
    finally:
        trainer_end.close()
        worker_end.close()
