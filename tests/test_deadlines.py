"""The deadline of a send: the library's default (60 s), a scheme's own
``timeout=``, and one given to ``send()``, which wins over the scheme's.

The conformance suite checks a scheme's ``timeout=`` over every scheme
(``test_deadline_raises_a_timeout_naming_the_worker``); a full 60 s wait runs
with ``-m slow``.
"""

from __future__ import annotations

import pickle
import threading
import time

import pytest
from harness import make_scheme, schemes

import weightsync as ws
from weightsync._sender import DEFAULT_TIMEOUT


@pytest.mark.parametrize("name", schemes())
def test_the_default_deadline_is_60_seconds(name: str) -> None:
    assert DEFAULT_TIMEOUT == 60.0
    scheme = make_scheme(name, timeout=None)
    assert scheme.timeout == 60.0
    if name != "inprocess":  # (the in-process scheme is never pickled)
        assert pickle.loads(pickle.dumps(scheme)).timeout == 60.0
    assert make_scheme(name, timeout=2.5).timeout == 2.5


def test_the_default_deadline_reaches_the_sender(make_cluster) -> None:
    c = make_cluster(["net"], timeout=None)
    assert c.scheme.get_async_sender().timeout == 60.0
    c.sender.send()


def test_a_deadline_given_to_send_wins_over_the_schemes(make_cluster) -> None:
    """Longer: a scheme's 0.5 s does not cut short a send given 30 s. (Shorter
    wins too: the conformance suite's stale-ack test gives 0.5 s to a scheme
    of 30.)"""
    c = make_cluster(["net"], timeout=0.5)
    c.sender.send()
    c.pause(0)
    resume = threading.Timer(1.0, c.resume, args=(0,))
    resume.start()
    try:
        c.bump()
        started = time.monotonic()
        c.sender.send(timeout=30)
        assert time.monotonic() - started >= 0.9  # it waited past the scheme's 0.5 s
    finally:
        resume.join()
    c.assert_has(0, c.expected())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_send_with_no_deadline_given_times_out_after_60_seconds(make_cluster) -> None:
    c = make_cluster(["net", "net"], timeout=None)
    c.sender.send()
    c.pause(1)
    c.bump()
    started = time.monotonic()
    with pytest.raises(ws.AckTimeoutError) as info:
        c.sender.send()
    waited = time.monotonic() - started
    assert info.value.worker_ids == (1,)
    assert 59.9 <= waited < 70, f"the default deadline ended after {waited:.1f} s"
    c.assert_has(0, c.expected())
