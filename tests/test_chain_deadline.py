"""A chain's sending end stops at its send's deadline, and once the send is
over for the trainer, whatever its stall limit: a chain thread of an
abandoned send never holds the next send's staging. The whole path, over
real gloo chains under faults, is the chaos run across emulated hosts
(``tests/test_chaos_hosts.py``: no send past its deadline, ``send_async()``
staging only)."""

from __future__ import annotations

import time

import pytest

from weightsync._transports._chain._pipeline import ChainBroken


def test_a_chain_starts_no_frame_once_its_send_is_over() -> None:
    """Once the trainer is done with a send (every worker answered, or it
    was interrupted), its chain starts no further frame: it ends within the
    frame in flight (a wait gloo cannot cut short but by its timeout)."""
    from weightsync._transports._chain._pipeline import _within

    assert _within(5.0, None, "sending frame 1 of 8") == 5.0
    assert 0 < _within(5.0, time.monotonic() + 1.0, "sending frame 1 of 8") <= 1.0
    with pytest.raises(ChainBroken, match=r"the send was over \(sending frame 3 of 8\)"):
        _within(5.0, time.monotonic() + 30, "sending frame 3 of 8", lambda: True)
    with pytest.raises(ChainBroken, match=r"the send's deadline passed"):
        _within(5.0, time.monotonic() - 0.1, "sending frame 3 of 8")
