"""Worker processes that take their updates in the background, after the
rendezvous of ``connect()`` (imported by spawned children)."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

import weightsync as ws

from . import torn_read_probe
from .workers import Net, snapshot


class SlowProbe(nn.Module):
    """A model whose forward call reads its tensors one after the other,
    slowly, and returns the smallest and largest element of each: all equal
    when the call ran on one version (see :mod:`.torn_read_probe`)."""

    def __init__(self, shapes: dict[str, int]) -> None:
        super().__init__()
        for name, numel in shapes.items():
            setattr(self, name, nn.Parameter(torch.zeros(numel), requires_grad=False))

    def forward(self) -> torch.Tensor:
        seen = []
        for param in self.parameters():
            seen.extend(torch.aminmax(param.detach()))
            time.sleep(0.001)  # room for an update to land mid-call, were it allowed to
        return torch.stack(seen)


def background_probe(
    scheme: ws.WeightSyncScheme, pipe: Connection, conn: Connection, shapes: dict[str, int], duration: float
) -> None:
    """Worker: connect (the rendezvous, then the background applier), then
    call the model again and again until told to stop; report what each call
    saw as ``("report", ProbeReport, versions applied)``."""
    torch.set_num_threads(1)
    model = SlowProbe(shapes)
    applied: list[int] = []
    scheme.init_on_worker("policy", pipe=pipe, model=model, on_update=applied.append)
    try:
        torn_read_probe.announce_ready(conn)
        scheme.connect()
        report = torn_read_probe.ProbeReport(pid=os.getpid())
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline and not conn.poll():
            report.record([model()])
        conn.send(("report", report, len(applied)))
    finally:
        scheme.shutdown()


def meta_worker(scheme: ws.WeightSyncScheme, pipe: Connection, conn: Connection, hidden: int) -> None:
    """Worker: a ``Net`` built on the meta device; connect, then report its
    tensors (or the error of connect) over ``conn``, and wait for a word back."""
    with torch.device("meta"):
        model = Net(hidden)
    scheme.init_on_worker("policy", pipe=pipe, model=model)
    try:
        conn.send(("ready", os.getpid()))
        try:
            scheme.connect(background=False)
        except ws.WeightSyncError as exc:
            conn.send(("error", type(exc).__name__, str(exc), snapshot(model)))
        else:
            conn.send(("weights", snapshot(model), scheme.get_receiver().async_receiver.version))
        conn.poll(30)  # the tensors sent are shared with the test until it has read them
    finally:
        scheme.shutdown()


def raising_on_update(scheme: ws.WeightSyncScheme, pipe: Connection, conn: Connection) -> None:
    """Worker: applies in the background with an ``on_update`` that raises
    from the second update on; reports how many updates it saw at "stop"."""
    model = Net()
    calls: list[int] = []

    def on_update(version: int) -> Any:
        calls.append(version)
        if len(calls) > 1:
            raise ValueError("the user's callback failed")

    scheme.init_on_worker("policy", pipe=pipe, model=model, on_update=on_update)
    try:
        conn.send(("ready", os.getpid()))
        scheme.connect()
        conn.poll(60)
        conn.send(("calls", calls))
    finally:
        scheme.shutdown()


def own_pipe_worker(scheme: ws.WeightSyncScheme, index: int, conn: Connection) -> None:
    """Worker of a scheme that made its own pipes: finds its end by index,
    connects, and reports its tensors when asked."""
    model = Net()
    scheme.init_on_worker("policy", model=model, worker_idx=index)
    try:
        scheme.connect()
        while conn.poll(60):
            conn.recv()
            conn.send(snapshot(model))
    except EOFError:
        pass
    finally:
        scheme.shutdown()


def version_worker(
    scheme: ws.WeightSyncScheme, pipe: Connection | None, conn: Connection, worker_idx: int | None = None
) -> None:
    """Worker obeying ``conn``: "version" (reply the version applied),
    ("wait", v, timeout) (reply ("ok", version) or ("timeout", message)),
    "background" (start applying in the background), "stop"."""
    model = Net()
    if pipe is not None:
        scheme.init_on_worker("policy", pipe=pipe, model=model)
    else:
        scheme.init_on_worker("policy", model=model, worker_idx=worker_idx)
    receiver = scheme.get_receiver()
    conn.send(("ready", os.getpid()))
    try:
        while conn.poll(60):
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd == "version":
                conn.send(receiver.version)
            elif cmd == "background":
                receiver.start_applier()
                conn.send("ok")
            else:
                _, version, timeout = cmd
                try:
                    conn.send(("ok", receiver.wait_for_version(version, timeout)))
                except ws.WaitTimeoutError as exc:
                    conn.send(("timeout", str(exc)))
    finally:
        scheme.shutdown()


class RestartingCollector:
    """A Ray actor (made remote with ``max_restarts``) that registers its
    model in ``__init__``: after Ray restarts it, it registers again."""

    def __init__(self) -> None:
        self.model = Net()
        self.scheme = ws.RayWeightSyncScheme()
        self.scheme.init_on_worker("policy", model=self.model)

    def pid(self) -> int:
        return os.getpid()

    def state(self) -> tuple[dict[str, torch.Tensor], int | None]:
        return snapshot(self.model), self.scheme.get_receiver().version
