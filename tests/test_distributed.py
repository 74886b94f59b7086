"""DistributedWeightSyncScheme on one host: the trainer (this process, rank 0)
and worker processes (ranks 1..N) on 127.0.0.1, the bytes along a gloo
chain, control over the trainer's TCPStore.

What is specific to the scheme: the chain (bit-exact at every worker, only
the targeted ones in it), the trainer that feeds the workers of its own
host from its staging buffer in shared memory (``share_from_trainer``, the
default: here every worker is on the trainer's host), the host leader that
feeds the host's other workers (``share_from_trainer=False``), a worker of
another user put in the chain itself,
the routes formed around a killed worker or host leader, why a stopped
worker missed its deadline, the background applier, and the refused nccl
backend. What every scheme does (faults, cleanup and leaks, torn reads,
chaos, soak, deadlines) runs over this scheme too, from the suites of the
scheme registry (tests/harness/schemes.py). Across hosts, on an emulated
cluster: test_distributed_cluster.py.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness import distributed_workers as dw
from harness import reap, start_worker, weight_checksums

import weightsync as ws

pytestmark = pytest.mark.timeout(120)

SHAPES = {"w0": 1 << 20, "w1": 3001, "w2": 7}  # 4 MiB and two odd sizes (chunks span tensors)


class Workers:
    """The trainer's scheme and ``n`` worker processes, each answering over a pipe."""

    def __init__(
        self, n: int, shapes: dict[str, int] = SHAPES, uids: dict[int, int] | None = None, **options: Any
    ) -> None:
        self.shapes = shapes
        dtype = options.pop("worker_dtype", torch.float32)
        self.trainer = dw.build_model(shapes)
        self.scheme = ws.DistributedWeightSyncScheme(timeout=options.pop("timeout", 30.0), **options)
        self.scheme.init_on_sender("policy", num_workers=n, model=self.trainer, host="127.0.0.1")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(1, n + 1):
            uid = (uids or {}).get(rank)
            proc, ours = start_worker(
                dw.pipe_worker, lambda conn, rank=rank, uid=uid: (self.scheme, rank, conn, shapes, uid, dtype)
            )
            self.conns.append(ours)
            self.procs.append(proc)
        for conn in self.conns:
            assert conn.poll(60), "a worker did not start"
            assert conn.recv()[0] == "ready"

    def randomize(self) -> None:
        for tensor in self.trainer.values():
            tensor.normal_()

    def state(self, worker_id: int) -> tuple[int | None, dict[str, str]]:
        conn = self.conns[worker_id]
        conn.send("state")
        assert conn.poll(30), f"worker {worker_id} did not answer"
        _, version, digests = conn.recv()
        return version, digests

    def expected(self) -> dict[str, str]:
        return weight_checksums(self.trainer)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.scheme.shutdown()
        reap(self.procs)
        for conn in self.conns:
            conn.close()


@contextlib.contextmanager
def workers(n: int, **options: Any) -> Iterator[Workers]:
    made = Workers(n, **options)
    try:
        yield made
    finally:
        made.close()


#: How the workers of the trainer's host get the bytes: from the trainer's
#: staging buffer (the default), from one of them (its host leader), or each
#: in the chain.
SHARING = {
    "from-trainer": {},
    "host-leader": {"share_from_trainer": False},
    "all-in-chain": {"share_on_host": False},
}


def route(sharing: str, ranks: tuple[int, ...]) -> list[tuple[tuple[int, ...], dict[int, tuple[int, ...]]]]:
    """The one route of a send to ``ranks`` (all alive, all on the trainer's host)."""
    if sharing == "from-trainer":
        return [((), {0: ranks})]  # (no chain: every one follows the trainer, rank 0)
    if sharing == "host-leader":
        return [((ranks[0],), {ranks[0]: ranks[1:]} if ranks[1:] else {})]
    return [(ranks, {})]


@pytest.mark.parametrize("sharing", list(SHARING))
def test_every_worker_gets_the_weights_bit_for_bit(sharing: str) -> None:
    with workers(3, **SHARING[sharing]) as w:
        w.scheme.connect()
        for _ in range(3):
            w.randomize()
            report = w.scheme.send()
            assert report.worker_ids == (0, 1, 2)
            assert w.scheme.last_routes == route(sharing, (1, 2, 3))
        for wid in range(3):
            assert w.state(wid) == (report.version, w.expected())
        # Only the targeted workers take part; the other keeps its version.
        w.randomize()
        subset = w.scheme.send(worker_ids=[0, 2])
        assert w.scheme.last_routes == route(sharing, (1, 3))
        assert w.state(0) == (subset.version, w.expected())
        assert w.state(2) == (subset.version, w.expected())
        assert w.state(1)[0] == report.version
        # send_async() returns once staged: the trainer's weights may change at once.
        w.randomize()
        sent = w.expected()
        w.scheme.get_sender().send_async()
        w.randomize()
        w.scheme.get_sender().wait_async()
        assert w.state(1)[1] == sent


def test_a_mismatch_is_refused_before_any_worker_is_touched() -> None:
    with workers(2) as w:
        w.scheme.connect()
        before = [w.state(wid) for wid in range(2)]
        notices = dict(w.scheme.staging.workers.notices)
        wrong = dw.build_model({**SHAPES, "w1": 3002})
        with pytest.raises(ws.WeightMismatchError, match="w1"):
            w.scheme.send(wrong)
        # No notice left for any worker, nothing applied, no version used.
        assert w.scheme.staging.workers.notices == notices
        assert [w.state(wid) for wid in range(2)] == before
        w.randomize()
        assert w.scheme.send().version == before[0][0] + 1


@pytest.mark.parametrize("sharing", list(SHARING))
def test_the_chain_goes_around_a_killed_worker(sharing: str) -> None:
    """(That a killed worker is named at once, by its signal, and the others
    updated is checked over every scheme: test_faults.py, test_conformance.py.)"""
    with workers(3, **SHARING[sharing]) as w:
        w.scheme.connect()
        os.kill(w.procs[1].pid, signal.SIGKILL)
        w.procs[1].join(10)
        w.randomize()
        with pytest.raises(ws.WorkerLostError) as caught:
            w.scheme.send()
        assert caught.value.worker_ids == (1,)
        assert w.scheme.last_routes == route(sharing, (1, 3))
        w.randomize()
        report = w.scheme.send(worker_ids=[0, 2])
        assert w.scheme.last_routes == route(sharing, (1, 3))
        assert w.state(0) == (report.version, w.expected())
        assert w.state(2) == (report.version, w.expected())


def test_a_removed_worker_leaves_no_descriptor_on_the_trainer() -> None:
    """A trainer that replaces lost workers for days keeps nothing of each:
    removing a worker closes its liveness connection (the one socket the
    trainer holds per worker), whether it died or is still running (that
    one hears a clean shutdown)."""
    with workers(3) as w:
        w.scheme.connect()

        port = w.scheme.staging.liveness.address[1]

        def sockets() -> int:
            """The trainer's open sockets accepted on its liveness port."""
            inodes = set()
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                with contextlib.suppress(FileNotFoundError), open(table) as lines:
                    for line in list(lines)[1:]:
                        fields = line.split()
                        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] != "0A":  # not LISTEN
                            inodes.add(fields[9])
            count = 0
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(FileNotFoundError):  # (the listing's own)
                    count += os.readlink(f"/proc/self/fd/{fd}")[8:-1] in inodes
            return count

        assert sockets() == 3
        os.kill(w.procs[1].pid, signal.SIGKILL)
        w.procs[1].join(10)
        with pytest.raises(ws.WorkerLostError):
            w.scheme.send()
        w.scheme.remove_worker(1)
        w.scheme.remove_worker(2)  # alive
        assert sockets() == 1
        report = w.scheme.send()
        assert report.worker_ids == (0,) and w.state(0) == (report.version, w.expected())
        # Worker 2 heard a clean shutdown: it stays up and says so.
        w.procs[2].join(0.5)
        assert w.procs[2].exitcode in (None, 0)


def test_a_killed_host_leader_is_named_and_another_feeds_the_host() -> None:
    with workers(3, share_from_trainer=False) as w:
        w.scheme.connect()
        os.kill(w.procs[0].pid, signal.SIGKILL)
        w.procs[0].join(10)
        w.randomize()
        with pytest.raises(ws.WorkerLostError) as caught:
            w.scheme.send()
        assert caught.value.worker_ids == (0,)
        assert w.scheme.last_routes == [((2,), {2: (3,)})]
        assert w.state(1) == (caught.value.version, w.expected())
        assert w.state(2) == (caught.value.version, w.expected())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to start a worker as another user")
@pytest.mark.parametrize("sharing", ["from-trainer", "host-leader"])
def test_a_worker_that_cannot_map_its_host_leaders_memory_joins_the_chain(sharing: str) -> None:
    """Worker 1 runs as user nobody: /proc/<leader>/fd is closed to it (the
    trainer's or rank 1's). Its copy fails, the send gives it a chain of its
    own, and later sends put it in the chain, beside those its leader feeds."""
    expected = {"from-trainer": [((2,), {0: (1, 3)})], "host-leader": [((1, 2), {1: (3,)})]}[sharing]
    with workers(3, uids={2: 65534}, **SHARING[sharing]) as w:
        w.scheme.connect()  # (the first weights already went this way)
        w.randomize()
        report = w.scheme.send()
        assert w.scheme.last_routes == expected
        for wid in range(3):
            assert w.state(wid) == (report.version, w.expected())
        w.randomize()
        report = w.scheme.send()
        assert w.scheme.last_routes == expected
        for wid in range(3):
            assert w.state(wid) == (report.version, w.expected())


@pytest.mark.extended
@pytest.mark.parametrize("sharing", list(SHARING))
def test_a_stopped_worker_misses_the_deadline_and_the_others_are_updated(sharing: str) -> None:
    with workers(3, timeout=5.0, **SHARING[sharing]) as w:
        w.scheme.connect()
        os.kill(w.procs[1].pid, signal.SIGSTOP)
        try:
            w.randomize()
            started = time.monotonic()
            with pytest.raises(ws.AckTimeoutError) as caught:
                w.scheme.send()
            assert 4.9 < time.monotonic() - started < 8
            assert caught.value.worker_ids == (1,)
            # The error says why: where the chain broke, or that it never answered.
            message = str(caught.value)
            if sharing != "all-in-chain":
                assert re.search("(did not report|had not reported) on its chain", message), message
            else:
                assert "the chain broke at rank 2 (host" in message, message
            assert w.state(0) == (caught.value.version, w.expected())
            assert w.state(2) == (caught.value.version, w.expected())
        finally:
            os.kill(w.procs[1].pid, signal.SIGCONT)
        # Resumed, it takes the next send.
        w.randomize()
        report = w.scheme.send()
        assert all(w.state(wid) == (report.version, w.expected()) for wid in range(3))


def test_a_worker_connects_with_store_info_and_applies_in_the_background() -> None:
    """sync=False: connect() starts the background applier, so a worker
    that never calls receive() is updated and acks."""
    scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=30.0)
    trainer = dw.build_model(SHAPES)
    scheme.init_on_sender("policy", num_workers=1, model=trainer, host="127.0.0.1")
    info = scheme.get_store_info()
    assert info is not None and info["host"] == "127.0.0.1" and info["port"] > 0
    proc, ours = start_worker(_background_worker, lambda conn: (info, conn, SHAPES))
    try:
        scheme.connect()
        for tensor in trainer.values():
            tensor.normal_()
        report = scheme.send()
        ours.send("state")
        assert ours.poll(30)
        assert ours.recv() == (report.version, weight_checksums(trainer))
        ours.send("stop")
    finally:
        scheme.shutdown()
        reap([proc])
        ours.close()


def _background_worker(info: dict[str, Any], conn: Any, shapes: dict[str, int]) -> None:
    torch.set_num_threads(1)
    model = dw.build_model(shapes)
    scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=30.0)  # a fresh one, not pickled
    scheme.init_on_worker("policy", model=model, worker_idx=1, store_info=info)
    try:
        scheme.connect()  # waits for the initial weights, then applies in the background
        while conn.poll(30) and conn.recv() == "state":
            conn.send((scheme.get_receiver().async_receiver.version, weight_checksums(model)))
    finally:
        scheme.shutdown()


def test_nccl_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="CUDA staging"):
        ws.DistributedWeightSyncScheme(backend="nccl")
    with pytest.raises(ValueError, match="gloo"):
        ws.DistributedWeightSyncScheme(backend="mpi")


def test_the_scheme_pickles_as_configuration_with_its_store() -> None:
    scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=5.0)
    assert scheme.get_store_info() is None
    scheme.init_on_sender("policy", num_workers=1, model=dw.build_model(SHAPES), host="127.0.0.1")
    try:
        copy = pickle.loads(pickle.dumps(scheme))
        assert (copy.backend, copy.sync, copy.timeout) == ("gloo", False, 5.0)
        assert copy.get_store_info() == scheme.get_store_info()
        assert not copy.initialized_on_sender
        with pytest.raises(ValueError, match="worker_idx"):
            copy.init_on_worker("policy", model=dw.build_model(SHAPES), worker_idx=0)
    finally:
        scheme.shutdown()


def test_the_liveness_connection_rings_an_idle_worker_and_still_tells_a_clean_shutdown() -> None:
    """The trainer's bells (one per notice) wake a worker's wait on its
    liveness connection and are read by its next look; the closing byte
    after them still says the trainer shut down, not died."""
    import select

    from weightsync._transports._distributed._liveness import Liveness, TrainerLink

    liveness = Liveness("127.0.0.1")
    link = TrainerLink(liveness.address, 3, 42, timeout=5.0)
    try:
        deadline = time.monotonic() + 5.0
        while liveness.state(3, 42) != "alive":  # accepted on the trainer's first look
            assert time.monotonic() < deadline, "the trainer never saw the worker connect"
            time.sleep(0.01)
        assert select.select([link.fileno()], [], [], 0.0)[0] == []
        for _ in range(3):
            liveness.ring(3, 42)
        assert select.select([link.fileno()], [], [], 5.0)[0] == [link.fileno()]
        assert link.state() == "alive"
        # Read: quiet again until the next bell.
        assert select.select([link.fileno()], [], [], 0.0)[0] == []
        liveness.ring(3, 42)
        liveness.ring(3, 99)  # another worker's nonce: not this connection
        liveness.close()
        assert link.state(wait=5.0) == "closed"
    finally:
        liveness.close()
        link.close()


@pytest.mark.parametrize("delta", [False, True], ids=["whole", "delta"])
def test_a_finished_send_holds_neither_itself_nor_the_callers_weights(delta: bool) -> None:
    """The chain's staging keeps what the next send needs (who acked, a
    delta's base: its own copies), never the finished send or the caller's
    weights."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    with workers(2, delta=delta) as w:
        w.scheme.connect()
        weights = {k: v + 1 for k, v in w.trainer.items()}
        memory = [StorageWeakRef(t.untyped_storage()) for t in weights.values()]
        w.scheme.send(weights)
        del weights
        gc.collect()
        assert all(ref.expired() for ref in memory)
