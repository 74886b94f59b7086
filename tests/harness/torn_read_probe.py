"""A torn-read probe: a worker that keeps checking whether the weights it reads
all belong to one version (imported by spawned children).

The trainer side fills EVERY element of EVERY tensor with the version number
(float32, see :func:`fill`), so a read is ``"consistent"`` when every element
read holds one value, and ``"mixed"`` when it saw an update half done: a
tensor whose min differs from its max, or tensors that differ from each other.

:func:`classify` is the check; :func:`probe_loop` repeats it and counts, and
takes a ``between`` hook so a scheme's worker can call ``receive()`` between
two checks::

    def scheme_probe(scheme, model_id, pipe, conn, duration):
        model = build_probe_model()
        scheme.init_on_worker(model_id, pipe=pipe, model=model)
        announce_ready(conn)
        report = probe_loop(lambda: model, conn, duration=duration,
                            between=lambda: scheme.receive(timeout=0.0))
        conn.send(("report", report))

:func:`shared_buffer_probe` is the worker for buffers that are simply shared
(the legacy updater): it reads them, with nothing in between.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from torch import nn

from weightsync._strategy import model_tensors

Verdict = Literal["consistent", "mixed"]
# A TensorDict, a module, a dict of tensors, or any iterable of tensors.
TensorSource = TensorDictBase | nn.Module | Mapping[str, Any] | Iterable[torch.Tensor]

GO_TIMEOUT = 60.0


def _tensors(source: TensorSource) -> Iterable[torch.Tensor]:
    if isinstance(source, TensorDictBase | nn.Module | Mapping):
        return model_tensors(source).values()
    return source


def span(source: TensorSource) -> tuple[float, float] | None:
    """The smallest and largest element over all the tensors, read once each
    (None when they hold no element)."""
    lo = hi = None
    for tensor in _tensors(source):
        if tensor.numel() == 0:
            continue
        t_lo, t_hi = torch.aminmax(tensor.detach())
        lo = t_lo.item() if lo is None else min(lo, t_lo.item())
        hi = t_hi.item() if hi is None else max(hi, t_hi.item())
    return None if lo is None or hi is None else (lo, hi)


def classify(source: TensorSource) -> Verdict:
    """``"consistent"`` if every element of every tensor holds one value
    (one version), else ``"mixed"``. The tensors are read once, in order,
    while a writer may be changing them: that is the point."""
    seen = span(source)
    return "consistent" if seen is None or seen[0] == seen[1] else "mixed"


def fill(source: TensorSource, version: int) -> None:
    """The trainer side: write ``version`` into every element of every tensor."""
    with torch.no_grad():
        for tensor in _tensors(source):
            tensor.fill_(float(version))


@dataclass
class ProbeReport:
    """What one probe saw: how many reads were consistent or mixed, and the
    distinct versions it saw whole."""

    pid: int = 0
    consistent: int = 0
    mixed: int = 0
    versions: set[float] = field(default_factory=set)
    #: The smallest and largest element of the weights when the probe
    #: stopped (set by :func:`scheme_probe`).
    last: tuple[float, float] | None = None

    @property
    def reads(self) -> int:
        return self.consistent + self.mixed

    def record(self, source: TensorSource) -> Verdict:
        seen = span(source)
        if seen is None or seen[0] == seen[1]:
            self.consistent += 1
            if seen is not None:
                self.versions.add(seen[0])
            return "consistent"
        self.mixed += 1
        return "mixed"


def probe_loop(
    read: Callable[[], TensorSource],
    conn: Connection,
    *,
    duration: float,
    between: Callable[[], object] | None = None,
) -> ProbeReport:
    """Classify ``read()`` again and again, calling ``between()`` (e.g. a
    scheme's ``receive()``) before each read, until ``"stop"`` arrives on
    ``conn`` or ``duration`` seconds have passed."""
    report = ProbeReport(pid=os.getpid())
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline and not conn.poll():
        if between is not None:
            between()
        report.record(read())
    return report


def announce_ready(conn: Connection) -> None:
    """Tell the test this probe is up, then block until it says ``"go"``."""
    conn.send(("ready", os.getpid()))
    if not conn.poll(GO_TIMEOUT) or conn.recv() != "go":
        raise RuntimeError("the test never said go")


def shared_buffer_probe(tensors: TensorSource, conn: Connection, duration: float) -> None:
    """Worker process: read ``tensors`` (shared with the trainer) until told
    to stop, then send ``("report", ProbeReport)`` over ``conn``."""
    torch.set_num_threads(1)  # one core per probe: the machine has few
    announce_ready(conn)
    report = probe_loop(lambda: tensors, conn, duration=duration)
    conn.send(("report", report))


# -- the test's side ----------------------------------------------------------


def start(conns: list[Connection], timeout: float = GO_TIMEOUT) -> None:
    """Wait until every probe is ready, then tell them all to go."""
    for conn in conns:
        if not conn.poll(timeout):
            raise TimeoutError("a probe did not start")
        tag, _ = conn.recv()
        assert tag == "ready"
    for conn in conns:
        conn.send("go")


def stop(conns: list[Connection], timeout: float = 30.0) -> list[ProbeReport]:
    """Tell every probe to stop and collect their reports."""
    for conn in conns:
        conn.send("stop")
    reports = []
    for conn in conns:
        if not conn.poll(timeout):
            raise TimeoutError("a probe did not report")
        tag, report = conn.recv()
        assert tag == "report"
        reports.append(report)
    return reports


def scheme_probe(
    scheme: Any,
    model_id: str,
    pipe: Connection | None,
    conn: Connection,
    shapes: dict[str, int],
    duration: float,
    receive_timeout: float = 0.0,
    worker_idx: int | None = None,
) -> None:
    """Worker process for a scheme: its model is ``{name: zeros(numel)}``; it
    checks the model between two ``receive(timeout=receive_timeout)`` calls
    until told to stop, then sends ``("report", ProbeReport)`` over ``conn``,
    with the span of its weights as it stopped.

    With a ``receive_timeout``, the probe waits for the next update and
    applies it as soon as it is announced, instead of after its current read.
    A worker reached by rank (DistributedWeightSyncScheme) or a thread of
    the in-process scheme passes no ``pipe`` but its ``worker_idx``; a
    thread leaves torch's thread count alone (it is the test process's).
    """
    import threading

    from tensordict import TensorDict

    if threading.current_thread() is threading.main_thread():
        torch.set_num_threads(1)
    model = TensorDict({name: torch.zeros(numel) for name, numel in shapes.items()}, batch_size=[])
    if pipe is not None:
        scheme.init_on_worker(model_id, pipe=pipe, model=model)
    else:
        scheme.init_on_worker(model_id, model=model, worker_idx=worker_idx)
    try:
        announce_ready(conn)
        report = probe_loop(
            lambda: model, conn, duration=duration, between=lambda: scheme.receive(timeout=receive_timeout)
        )
        report.last = span(model)
        conn.send(("report", report))
    finally:
        scheme.shutdown()
