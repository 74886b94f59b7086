"""The worker's end of the RPC transport, and the functions the sender
calls on a worker through ``torch.distributed.rpc``.

A worker registers its endpoint under its model id in this process when it
announces itself; the sender finds it by calling :func:`describe_worker`.
Each update is one call of :func:`notice_update` that carries the whole
packet as one flat ``uint8`` tensor (TensorPipe moves its storage as it
is: no tensor is pickled one by one). The call runs on one of TensorPipe's
threads, which must not write the model: it only leaves the update with
the endpoint (a pull endpoint) and returns a ``torch.futures.Future``
(``@rpc.functions.async_execution``), which the endpoint completes with
the reply once ``receive()``, or the background applier between two
forward calls, has applied the update. The reply is the call's result::

    ("ack", version)          applied
    ("error", version, msg)   not applied, and why (the model is untouched)
    ("absent", msg)           no receiver of that model here (never, or no more)

:func:`notice_closed` tells a worker that the sender shut down.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import torch
import torch.distributed.rpc as rpc

from ..._exceptions import SenderClosedError, SenderLostError
from ..._packet import Manifest, Signature
from ..._readiness import ProcessWatch
from .._base import BufferUpdate

__all__ = [
    "RPCEndpoint",
    "UpdateHeader",
    "describe_worker",
    "notice_closed",
    "notice_update",
]

Reply = tuple[Any, ...]


@dataclass(frozen=True)
class UpdateHeader:
    """What comes with an update's bytes: the same for every worker of a send."""

    model_id: str | None
    #: Names the sending scheme: a new sender starts again at version 1.
    token: str
    version: int
    layout_id: str
    threads: int
    subset: Signature | None
    digests: tuple[int, ...] | None
    #: The sender's host and pid: a worker on its host watches it.
    host: str
    pid: int


# The endpoints of this process, by model id.
_ENDPOINTS: dict[str | None, RPCEndpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()


def _reply_now(reply: Reply) -> torch.futures.Future[Reply]:
    done: torch.futures.Future[Reply] = torch.futures.Future()
    done.set_result(reply)
    return done


def describe_worker(model_id: str | None) -> tuple[Signature, tuple[str, ...], str, int] | None:
    """Runs on the worker (called by the sender): the layout of the model
    registered under ``model_id``, its devices, the worker's host and pid;
    None while no receiver of that model announced itself here."""
    endpoint = _ENDPOINTS.get(model_id)
    if endpoint is None or endpoint.signature is None:
        return None
    return endpoint.signature, endpoint.devices, socket.gethostname(), os.getpid()


@rpc.functions.async_execution
def notice_update(header: UpdateHeader, buffer: torch.Tensor) -> torch.futures.Future[Reply]:
    """Runs on the worker (called by the sender), on a thread of TensorPipe:
    leave the update with the endpoint of its model; the future completes
    with the reply once it is applied (or refused)."""
    endpoint = _ENDPOINTS.get(header.model_id)
    if endpoint is None:
        return _reply_now(
            (
                "absent",
                f"no receiver of model {header.model_id!r} in this process: call "
                f"RPCWeightSyncScheme.init_on_worker({header.model_id!r}, model=...) there",
            )
        )
    return endpoint.offer(header, buffer)


def notice_closed(model_id: str | None, token: str) -> None:
    """Runs on the worker (called by the sender): sender ``token`` shut down."""
    endpoint = _ENDPOINTS.get(model_id)
    if endpoint is not None:
        endpoint.sender_closed(token)


class RPCEndpoint:
    """A worker's endpoint for one model: a pull endpoint whose updates are
    left by :func:`notice_update` and taken by the receiver (``receive()``,
    or the background applier); each reply completes the update's call."""

    pushes = False

    def __init__(self, model_id: str | None) -> None:
        self.model_id = model_id
        self.signature: Signature | None = None
        self.devices: tuple[str, ...] = ()
        self._lock = threading.Lock()
        # Set while an update is pending, or the sender is gone.
        self._ready = threading.Event()
        self._pending: tuple[BufferUpdate, torch.futures.Future[Reply]] | None = None
        # The calls of updates taken but not replied to yet, by version.
        self._taken: dict[int, torch.futures.Future[Reply]] = {}
        self._closed = False
        # Why the sender is gone (clean close or lost), once it is.
        self._gone: SenderLostError | None = None
        self._token = ""
        # The sender's process, when it runs on this host.
        self._sender: ProcessWatch | None = None

    def _lost(self, reason: str) -> SenderLostError:
        return SenderLostError(
            f"the sender of model {self.model_id!r} is gone: {reason}", model_id=self.model_id
        )

    # -- called on TensorPipe's threads ---------------------------------------
    def offer(self, header: UpdateHeader, buffer: torch.Tensor) -> torch.futures.Future[Reply]:
        """Leave the update of ``header`` to be taken; the future of its
        reply. An update still pending is superseded (its sender gave up on
        it already)."""
        future: torch.futures.Future[Reply] = torch.futures.Future()
        # The call's own tensor, which nothing else writes.
        update = BufferUpdate(
            header.version, header.layout_id, header.subset, header.digests, header.threads, buffer
        )
        with self._lock:
            if self._closed:
                replaced = None
                answer: Reply | None = ("absent", f"the receiver of model {self.model_id!r} is shut down")
            else:
                replaced, self._pending = self._pending, (update, future)
                answer = None
                self._watch(header)
                self._ready.set()
        if answer is not None:
            future.set_result(answer)
        if replaced is not None:
            old = replaced[0].version
            replaced[1].set_result(("error", old, f"version {header.version} came before {old} was applied"))
        return future

    def _watch(self, header: UpdateHeader) -> None:
        """Watch the sender's process if it is on this host (the lock held)."""
        if header.token == self._token:
            return
        self._token, self._gone = header.token, None
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if header.host == socket.gethostname() and header.pid != os.getpid():
            self._sender = ProcessWatch(header.pid)

    def sender_closed(self, token: str) -> None:
        with self._lock:
            if token != self._token and self._token:
                return  # (a sender other than the one this worker follows)
            self._gone = SenderClosedError(
                f"the sender of model {self.model_id!r} shut down", model_id=self.model_id
            )
            self._ready.set()

    # -- the WorkerEndpoint interface ----------------------------------------------
    async def announce(self, manifest: Manifest, devices: tuple[str, ...]) -> None:
        """Register this endpoint in its process: the sender's ``connect``
        finds it there (nothing is sent)."""
        self.signature, self.devices = manifest.signature, devices
        with _ENDPOINTS_LOCK:
            _ENDPOINTS[self.model_id] = self

    def take_ready(self) -> BufferUpdate | None:
        """The pending update, if any. Never blocks.

        :raises SenderLostError: the sender died or shut down, and nothing is pending.
        """
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is None:
                self._check_sender()
                if self._gone is None:
                    self._ready.clear()
                    return None
                raise self._gone
            self._ready.clear()
            update, future = pending
            self._taken[update.version] = future
            return update

    def _check_sender(self) -> None:
        """Whether the sender's process on this host exited (the lock held)."""
        if self._gone is None and self._sender is not None and not self._sender.alive():
            self._gone = self._lost(f"its process ({self._sender.pid}) exited")
            self._ready.set()

    async def next_update(self, timeout: float) -> BufferUpdate | None:
        got = self.take_ready()
        if got is not None or timeout <= 0:
            return got
        if not await anyio.to_thread.run_sync(self.wait_ready, timeout, abandon_on_cancel=True):
            return None
        return self.take_ready()

    def try_reply(self, version: int, error: str | None = None) -> bool:
        with self._lock:
            future = self._taken.pop(version, None)
        if future is not None:
            future.set_result(("ack", version) if error is None else ("error", version, error))
        return True

    async def reply(self, version: int, error: str | None = None) -> None:
        self.try_reply(version, error)

    def wait_ready(self, timeout: float) -> bool:
        if self._ready.wait(timeout):
            return True
        with self._lock:
            self._check_sender()
        return self._ready.is_set()

    async def aclose(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            calls = list(self._taken.values())
            if self._pending is not None:
                calls.append(self._pending[1])
            self._pending, self._taken = None, {}
            if self._sender is not None:
                self._sender.close()
                self._sender = None
        with _ENDPOINTS_LOCK:
            if _ENDPOINTS.get(self.model_id) is self:
                del _ENDPOINTS[self.model_id]
        for future in calls:
            future.set_result(("absent", f"the receiver of model {self.model_id!r} was shut down"))
