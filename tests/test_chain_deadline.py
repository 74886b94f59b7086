"""A chain's sending end stops at its send's deadline, and once the send is
over for the trainer, whatever its stall limit: a chain thread of an
abandoned send never holds the next send's staging. Over a real gloo group
of two members (threads of this process), the second one joined but never
receiving, as a host behind a cut link."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from weightsync._transports._chain._gloo import ChainBroken, gloo_group, send_chain

# Far more than fits in gloo's buffers: the sender must wait for its peer.
SOURCE = torch.ones(64 << 20, dtype=torch.uint8)


def _chain_to_a_silent_peer(name: str, **cut: object) -> tuple[float, str]:
    """Seconds send_chain took (stall limit 30 s) to a member that never
    receives, and what it raised."""
    store = dist.HashStore()
    joined = threading.Event()
    release = threading.Event()

    def silent() -> None:
        group = gloo_group(store, name, 1, 2, "127.0.0.1", 30.0)
        joined.set()
        release.wait(60)
        del group

    peer = threading.Thread(target=silent, daemon=True)
    peer.start()
    group = gloo_group(store, name, 0, 2, "127.0.0.1", 30.0)
    assert joined.wait(30)
    started = time.monotonic()
    try:
        with pytest.raises(ChainBroken) as info:
            send_chain(group, [SOURCE], 1 << 20, 1, 30.0, **cut)  # type: ignore[arg-type]
        return time.monotonic() - started, str(info.value)
    finally:
        release.set()
        peer.join(60)


def test_a_chain_stops_at_its_sends_deadline() -> None:
    took, why = _chain_to_a_silent_peer("deadline", until=time.monotonic() + 0.5)
    assert took < 2.0, took
    assert "stalled" in why or "deadline passed" in why, why


def test_a_chain_starts_no_frame_once_its_send_is_over() -> None:
    """Once the trainer is done with a send (every worker answered, or it
    was interrupted), its chain starts no further frame: it ends within the
    frame in flight (a wait gloo cannot cut short but by its timeout)."""
    from weightsync._transports._chain._gloo import _within

    assert _within(5.0, None, "sending frame 1 of 8") == 5.0
    assert 0 < _within(5.0, time.monotonic() + 1.0, "sending frame 1 of 8") <= 1.0
    with pytest.raises(ChainBroken, match=r"the send was over \(sending frame 3 of 8\)"):
        _within(5.0, time.monotonic() + 30, "sending frame 3 of 8", lambda: True)
    with pytest.raises(ChainBroken, match=r"the send's deadline passed"):
        _within(5.0, time.monotonic() - 0.1, "sending frame 3 of 8")
