"""The send as a state machine, with no process, pipe or loop: results in,
actions out (``_send.SendMachine``).

Each test plays the drivers' part by hand: it feeds the machine what a
driver would have found (a staged packet, the descriptors a post gave,
the answers a wakeup brought) and checks the action the machine asks for
next, and what it reports or raises at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import weightsync as ws
from weightsync._memory._placement import Placement
from weightsync._packet import Manifest, Packet
from weightsync._packing import Packer
from weightsync._send import (
    STAGED,
    Announce,
    Deliver,
    Done,
    HandOver,
    Listen,
    Post,
    SendMachine,
    SendOptions,
    Sends,
    Write,
)
from weightsync._targets import Workers


@dataclass
class Channel:
    """What a send reads of a worker's channel: its announcement, and why
    it is late. (No I/O: the machine never reaches further.)"""

    worker_id: int
    layout: Manifest | None
    devices: tuple[str, ...] | None = ("cpu",)
    reach: tuple[str, ...] = ()
    late_because: str | None = None

    def why_late(self) -> str | None:
        return self.late_because


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def model() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(2)}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, value in model().items():
            self.register_parameter(name, torch.nn.Parameter(value))


def sends(
    workers: int = 2,
    *,
    announced: bool = True,
    handler: bool = False,
    per_worker: bool = False,
    timeout: float = 5.0,
) -> Sends:
    packer = Packer("policy", SimpleNamespace(model=Net()), None)  # (as a scheme gives it)
    layout = packer.packet(1, None).manifest
    channels = {w: Channel(w, layout if announced else None) for w in range(workers)}
    return Sends(
        Workers(channels, "policy", per_worker),
        packer,
        timeout=timeout,
        verify=False,
        handler=handler,
        on_device=False,
    )


def staged(action: Write) -> Packet:
    """What a driver feeds back for a Write: the packet as staged."""
    return action.packet.staged(None)


def test_a_send_writes_once_posts_to_every_worker_and_reports_once_all_acked() -> None:
    machine = SendMachine(sends(), None, None, clock=Clock())
    action = machine.start()
    assert isinstance(action, Write)
    assert action.packet.version == 1
    assert dict(action.placements) == {0: Placement.HOST, 1: Placement.HOST}
    assert machine.feed(staged(action)) is STAGED  # send_async() returns here
    post = machine.feed(None)
    assert isinstance(post, Post) and post.worker_ids == [0, 1]
    listen = machine.feed({0: (10, 11), 1: (12, 13)})
    assert isinstance(listen, Listen) and dict(listen.watched) == {0: (10, 11), 1: (12, 13)}
    listen = machine.feed({0: True})
    assert isinstance(listen, Listen) and dict(listen.watched) == {1: (12, 13)}
    assert isinstance(machine.feed({1: False}), Listen)  # woken, but no ack yet
    done = machine.feed({1: True})
    assert isinstance(done, Done)
    report = done.report
    assert (report.version, report.worker_ids, report.placements) == (1, (0, 1), {0: "host", 1: "host"})
    assert report.nbytes == action.packet.nbytes


def test_the_version_is_used_once_bytes_moved_and_acks_are_recorded() -> None:
    state = sends()
    for expected in (1, 2):
        machine = SendMachine(state, None, None, clock=Clock())
        write = machine.start()
        assert isinstance(write, Write) and write.packet.version == expected
        machine.feed(staged(write))
        machine.feed(None)
        machine.feed({0: (1,), 1: (2,)})
        machine.feed({0: True})
        assert isinstance(machine.feed({1: True}), Done)
    assert state.version == 2
    assert state.workers.versions == {0: 2, 1: 2}


def test_a_worker_that_misses_the_deadline_is_named_and_the_others_are_recorded() -> None:
    clock = Clock()
    state = sends(timeout=5.0)
    state.workers.transports[1].late_because = "its chain broke"  # type: ignore[attr-defined]
    machine = SendMachine(state, None, None, clock=clock)
    machine.feed(staged(machine.start()))
    machine.feed(None)
    listen = machine.feed({0: (1,), 1: (2,)})
    assert isinstance(listen, Listen) and listen.deadline == clock.now + 5.0
    machine.feed({0: True})
    clock.now += 5.0  # the driver's wait ran out: nothing came
    with pytest.raises(ws.AckTimeoutError) as caught:
        machine.feed({})
    assert caught.value.worker_ids == (1,)
    assert "timeout of 5 s" in str(caught.value) and "its chain broke" in str(caught.value)
    assert state.workers.versions == {0: 1, 1: None}
    SendMachine(state, None, None).close()  # the sender was given back


def test_a_wakeup_with_nothing_before_the_deadline_waits_again() -> None:
    clock = Clock()
    machine = SendMachine(sends(workers=1), None, None, clock=clock)
    machine.feed(staged(machine.start()))
    machine.feed(None)
    machine.feed({0: (1,)})
    clock.now += 1.0
    assert isinstance(machine.feed({}), Listen)


def test_failures_stay_per_worker_and_the_others_still_get_the_update() -> None:
    state = sends(workers=3)
    machine = SendMachine(state, None, None, clock=Clock())
    machine.feed(staged(machine.start()))
    machine.feed(None)
    lost = ws.WorkerLostError("worker 0 is gone", worker_id=0, model_id="policy")
    listen = machine.feed({0: lost, 1: (3,), 2: (4,)})
    assert isinstance(listen, Listen) and sorted(listen.watched) == [1, 2]
    refused = ws.WorkerApplyError("no", worker_id=1, model_id="policy", version=1, worker_message="no")
    machine.feed({1: refused})
    with pytest.raises(ws.WorkerError) as caught:
        machine.feed({2: True})
    assert sorted(caught.value.failures) == [0, 1]
    assert isinstance(caught.value.failures[0], ws.WorkerLostError)
    assert isinstance(caught.value.failures[1], ws.WorkerApplyError)
    assert state.workers.versions == {0: None, 1: None, 2: 1}


def test_workers_only_a_delivery_reaches_are_delivered_to_after_the_watched_ones() -> None:
    machine = SendMachine(sends(workers=3), None, None, clock=Clock())
    machine.feed(staged(machine.start()))
    machine.feed(None)
    # Worker 1's pipe was full (no descriptors); worker 2 restarts mid-send.
    listen = machine.feed({0: (1,), 1: None, 2: (5,)})
    assert sorted(listen.watched) == [0, 2]  # type: ignore[union-attr]
    machine.feed({0: True})
    deliver = machine.feed({2: None})
    assert isinstance(deliver, Deliver) and deliver.worker_ids == [1, 2]
    done = machine.feed({1: None, 2: None})
    assert isinstance(done, Done) and done.report.worker_ids == (0, 1, 2)


def test_workers_still_starting_are_awaited_first_and_the_late_ones_left_out() -> None:
    state = sends(announced=False)
    machine = SendMachine(state, None, None, clock=Clock())
    announce = machine.start()
    assert isinstance(announce, Announce) and announce.targets == [0, 1] and announce.version == 1
    layout = state.packer.packet(1, None).manifest
    state.workers.transports[0].layout = layout
    late = ws.AckTimeoutError("worker 1 did not announce itself", worker_id=1, model_id="policy")
    write = machine.feed({1: late})
    assert isinstance(write, Write) and list(write.placements) == [0]
    machine.feed(staged(write))
    machine.feed(None)
    machine.feed({0: (1,)})
    with pytest.raises(ws.AckTimeoutError) as caught:
        machine.feed({0: True})
    assert caught.value.worker_ids == (1,)


def test_weights_that_do_not_fit_are_refused_before_anything_moves() -> None:
    state = sends()
    with pytest.raises(ws.WeightMismatchError):
        SendMachine(state, {"w": torch.zeros(3, 3), "b": torch.zeros(2)}, None).start()
    assert state.version == 0
    # The sender was given back, and nothing was staged.
    machine = SendMachine(state, None, None)
    assert isinstance(machine.start(), Write)


def test_one_send_at_a_time_and_a_closed_send_gives_the_sender_back() -> None:
    state = sends()
    first = SendMachine(state, None, None)
    first.start()
    with pytest.raises(ws.WeightSyncStateError, match="already in progress"):
        SendMachine(state, None, None)
    first.close()
    first.close()  # idempotent
    SendMachine(state, None, None).close()


def test_bad_targets_are_refused_at_once_without_taking_the_sender() -> None:
    state = sends()
    with pytest.raises(ValueError, match="targets no worker"):
        SendMachine(state, None, [])
    with pytest.raises(ws.UnknownWorkerError):
        SendMachine(state, None, [7])
    SendMachine(state, None, None).close()


def test_a_handler_carries_the_whole_send_and_reports_through_it() -> None:
    state = sends(workers=3, handler=True)
    machine = SendMachine(state, None, None, SendOptions(timeout=2.0), clock=Clock())
    machine.feed(staged(machine.start()))
    hand = machine.feed(None)
    assert isinstance(hand, HandOver) and hand.send.worker_ids == [0, 1, 2]
    assert hand.deadline == 102.0
    send = hand.send
    send.ack(0)
    send.fail(1, ws.WorkerLostError("gone", worker_id=1, model_id="policy"))
    send.ack(1)  # a first answer counts
    assert send.acked == frozenset({0})
    with pytest.raises(ws.WorkerError) as caught:
        machine.feed(None)  # the handler returned: worker 2 never answered
    assert isinstance(caught.value.failures[1], ws.WorkerLostError)
    assert isinstance(caught.value.failures[2], ws.AckTimeoutError)
    assert state.workers.versions == {0: 1, 1: None, 2: None}


def test_per_worker_weights_are_one_leg_per_worker_and_staged_once_the_last_is() -> None:
    state = sends(per_worker=True)
    own = {0: model(), 1: model()}
    machine = SendMachine(state, own, None, clock=Clock())
    first = machine.start()
    assert isinstance(first, Write) and first.packet.version == 1 and list(first.placements) == [0]
    post = machine.feed(staged(first))  # not staged yet: the first leg is waited for
    assert isinstance(post, Post) and post.worker_ids == [0]
    machine.feed({0: (1,)})
    second = machine.feed({0: True})
    assert isinstance(second, Write) and second.packet.version == 2 and list(second.placements) == [1]
    assert machine.feed(staged(second)) is STAGED
    machine.feed(None)
    machine.feed({1: (2,)})
    done = machine.feed({1: True})
    assert isinstance(done, Done)
    assert done.report.version == 2 and done.report.worker_ids == (0, 1)
    assert done.report.nbytes == first.packet.nbytes + second.packet.nbytes
    assert state.workers.versions == {0: 1, 1: 2}


def test_a_send_with_no_reachable_worker_moves_nothing_and_names_them() -> None:
    state = sends(announced=False, workers=1)
    machine = SendMachine(state, None, None, clock=Clock())
    assert isinstance(machine.start(), Announce)
    gone = ws.WorkerLostError("gone", worker_id=0, model_id="policy")
    assert machine.feed({0: gone}) is STAGED
    with pytest.raises(ws.WorkerLostError):
        machine.feed(None)
    assert state.version == 0  # no bytes moved: the version is not used
