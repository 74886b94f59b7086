"""DistributedWeightSyncScheme(delta=True) on one host: each whole send goes
as a delta against the last version every worker of the send acked, and
any worker without that base, or whose rebuild fails its check, gets the
full bytes in the same send. Every worker ends every send with exactly the
trainer's weights. Across hosts: test_distributed_cluster.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness import weight_checksums
from test_distributed import Workers

import weightsync as ws
from weightsync._transports._chain import _driver as _chain

pytest.importorskip("blosc2")
pytestmark = pytest.mark.timeout(180)
# Worker processes and a gloo chain, a few seconds a test: a CI step of
# their own (pytest -m extended), beside the default run's codec tests.
extended = pytest.mark.extended

SHAPES = {"w0": 1 << 20, "w1": 300_001, "w2": 7}


@contextlib.contextmanager
def delta_workers(n: int, delta: bool | str = "always", **options: Any) -> Iterator[Workers]:
    # "always": a delta whenever a base is held; delta=True weighs each send
    # (on one host the link is faster than the codec: the full bytes).
    made = Workers(n, shapes=SHAPES, delta=delta, **options)
    try:
        yield made
    finally:
        made.close()


def nudge(w: Workers, fraction: float = 0.01, seed: int = 0) -> None:
    """Change ``fraction`` of the trainer's elements, as a small RL step does."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in w.trainer.values():
        flat = tensor.view(-1)
        picked = torch.randperm(flat.numel(), generator=gen)[: max(1, int(fraction * flat.numel()))]
        flat[picked] += torch.randn(picked.numel(), generator=gen)


def exact(w: Workers, version: int, worker_ids: range | list[int]) -> None:
    for wid in worker_ids:
        assert w.state(wid) == (version, w.expected()), f"worker {wid}"


@extended
def test_delta_true_weighs_each_send_and_random_weights_go_whole() -> None:
    """delta=True sends a delta only where it is expected to pay: random
    weights go whole; whichever way a send goes, every worker ends it with
    the trainer's weights, and the choice says why."""
    with delta_workers(2, delta=True) as w:
        w.scheme.connect()
        choice = w.scheme.staging.delta_choice
        assert w.scheme.last_delta == [False] and choice is not None
        for step in range(4):
            if step % 2:
                w.randomize()
            else:
                nudge(w, seed=step)
            report = w.scheme.send()
            exact(w, report.version, range(2))
            assert choice.why.startswith("delta" if w.scheme.last_delta[0] else "full bytes"), choice.why
            if step % 2:
                assert w.scheme.last_delta[0] is False, choice.why
            said = w.scheme.last_delta_choice
            assert said["delta"] == w.scheme.last_delta[0] and said["why"] == choice.why
        assert choice.full is not None


@extended
@pytest.mark.parametrize("share", [True, False], ids=["host-leader", "all-in-chain"])
def test_deltas_are_bit_exact_and_small(share: bool) -> None:
    with delta_workers(3, share_on_host=share) as w:
        # connect() sends the initial weights: no base yet, the full bytes.
        w.scheme.connect()
        assert w.scheme.last_delta == [False]
        w.randomize()
        # Every element changed: a delta still, never larger than the bytes.
        first = w.scheme.send()
        nbytes = first.nbytes
        assert w.scheme.last_delta == [True]
        assert w.scheme.last_wire_bytes < 1.01 * nbytes
        exact(w, first.version, range(3))
        for step in range(6):
            nudge(w, seed=step)
            report = w.scheme.send()
            assert w.scheme.last_delta == [True], w.scheme.last_routes
            # About 1% of the elements changed: a small fraction of the bytes moved.
            assert w.scheme.last_wire_bytes < 0.2 * nbytes
            exact(w, report.version, range(3))
        # Nothing changed: frames with no payload.
        report = w.scheme.send()
        assert w.scheme.last_wire_bytes < 0.01 * nbytes
        exact(w, report.version, range(3))


@extended
@pytest.mark.parametrize("history", [1, 0])
def test_a_worker_that_missed_sends_gets_a_delta_against_the_version_it_holds(history: int) -> None:
    """The base moves on without worker 2 while it misses sends; the next
    send carries the others' delta, then worker 2's against the version it
    holds (the trainer kept it: ``delta_history``), smaller than the full
    bytes. With ``delta_history=0`` worker 2 gets the full bytes."""
    with delta_workers(3, delta_history=history) as w:
        w.scheme.connect()
        w.scheme.send()
        nudge(w, seed=1)
        held = w.scheme.send()
        # Worker 2 misses these: the base moves on without it.
        for seed in (2, 3, 4):
            nudge(w, seed=seed)
            w.scheme.send(worker_ids=[0, 1])
        nudge(w, seed=5)
        report = w.scheme.send()
        # A delta chain for those that hold the base, then worker 2's own (rank 3).
        assert w.scheme.last_delta == [True, history > 0]
        assert w.scheme.last_routes[1][0] == (3,)
        exact(w, report.version, range(3))
        behind = w.scheme.last_delta_choice["behind"]
        if history:
            assert f"behind at version {held.version}" in behind[held.version]
            # Four versions of about 1% of the elements each: far less than the bytes.
            assert w.scheme.last_wire_bytes < 0.5 * report.nbytes
        else:
            assert behind == {} and w.scheme.last_wire_bytes > report.nbytes
        # All of them hold the new base now: one delta chain again.
        nudge(w, seed=6)
        report = w.scheme.send()
        assert w.scheme.last_delta == [True]
        assert w.scheme.last_delta_choice["behind"] == {}
        exact(w, report.version, range(3))


@extended
def test_a_partial_update_then_deltas() -> None:
    with delta_workers(2) as w:
        w.scheme.connect()
        w.scheme.send()
        w.trainer["w2"].add_(1.0)
        partial = w.scheme.send(keys=["w2"])
        # A partial update goes as it is: its bytes, no delta.
        assert w.scheme.last_delta == [False]
        exact(w, partial.version, range(2))
        for step in range(2):
            nudge(w, seed=10 + step)
            report = w.scheme.send()
            exact(w, report.version, range(2))
        assert w.scheme.last_delta == [True]


@extended
def test_a_frame_damaged_in_transit_is_caught_and_repaired_with_the_full_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with delta_workers(2, share_on_host=False) as w:
        w.scheme.connect()
        w.scheme.send()
        nudge(w, seed=5)
        w.scheme.send()
        real = _chain.send_frames

        def flip_one_byte(group: Any, frames: Any, *args: Any, **kwargs: Any) -> None:
            def damaged() -> Iterator[bytes]:
                for k, frame in enumerate(frames):
                    if k == 0 and len(frame) > _chain.HEADER_SIZE:
                        frame = bytearray(frame)
                        frame[-1] ^= 0x40  # one bit of the payload's last byte
                        frame = bytes(frame)
                    yield frame

            real(group, damaged(), *args, **kwargs)

        monkeypatch.setattr(_chain, "send_frames", flip_one_byte)
        nudge(w, seed=6)
        report = w.scheme.send()
        # The delta chain, then the full bytes to the workers that could not rebuild it.
        assert w.scheme.last_delta == [True, False]
        exact(w, report.version, range(2))
        monkeypatch.setattr(_chain, "send_frames", real)
        nudge(w, seed=7)
        report = w.scheme.send()
        assert w.scheme.last_delta == [True]
        exact(w, report.version, range(2))


@extended
def test_delta_combines_with_a_bf16_wire() -> None:
    shapes = {"w0": 1 << 19, "w1": 12345}
    trainer_dtype = torch.float32
    w = Workers(2, shapes=shapes, delta="always", wire_dtype=torch.bfloat16, worker_dtype=torch.bfloat16)
    try:
        w.scheme.connect()
        for step in range(3):
            nudge(w, seed=20 + step)
            report = w.scheme.send()
            expected = {k: v.to(torch.bfloat16) for k, v in w.trainer.items()}
            for wid in range(2):
                version, digests = w.state(wid)
                assert version == report.version
                assert digests == weight_checksums(expected)
            assert w.trainer["w0"].dtype == trainer_dtype
        assert w.scheme.last_delta == [True]
    finally:
        w.close()


def test_delta_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "blosc2", None)
    with pytest.raises(ws.MissingExtraError, match=r"pip install 'weightsync\[delta\]'"):
        ws.DistributedWeightSyncScheme(delta=True)
