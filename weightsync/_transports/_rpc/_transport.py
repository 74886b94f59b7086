"""The RPC transport: each worker is a ``torch.distributed.rpc`` peer, and
each update is one call to it that carries the whole packet.

Sender side: :class:`RPCStaging` copies a send's tensors into one flat
``uint8`` tensor, once for all the workers; :class:`RPCSenderTransport`
(a channel per worker) posts the update as an ``rpc_async`` call of
``_endpoint.notice_update`` with that tensor, whose result is the worker's
reply (see ``_endpoint``). TensorPipe sends the tensor's storage from where
it is, until the call returns: a staging tensor is written again only once
every call that carries it has returned, else a new one is taken.

A peer that dies fails its calls at once (TensorPipe's connection ends);
a peer on the trainer's host is then named with its exit status or signal.
Every error of ``torch.distributed.rpc`` is turned into weightsync's
(:class:`WorkerLostError`) at this boundary.

``torch.distributed.rpc`` must be initialised (``rpc.init_rpc``) in every
process by the user (or by torchrl's ``RPCCollector``); this module never
starts or shuts it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.process
import os
import socket
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import anyio
import torch
import torch.distributed.rpc as rpc

from ..._copy import usable_cores
from ..._digest import copy_out
from ..._exceptions import WorkerLostError
from ..._memory._placement import Placement, on_caller_stream
from ..._packet import Manifest, Packet
from .._base import worker_failed, worker_lost
from .._peer import describe_exit, exit_status, started_here
from ._endpoint import UpdateHeader, describe_worker, notice_closed, notice_update

__all__ = ["RPCSenderTransport", "RPCStaging", "rpc_ready"]

# How long connect() waits between asking a worker whether its receiver
# announced itself (it doubles up to the maximum), and the deadline of one
# such call.
_CONNECT_POLL = (0.02, 0.5)
_CALL_TIMEOUT = 30.0
# How long a closing sender waits for its workers to hear it.
_CLOSE_WAIT = 0.5


def rpc_ready() -> bool:
    """Whether ``torch.distributed.rpc`` is initialised in this process."""
    try:
        rpc.get_worker_info()
    except RuntimeError:
        return False
    return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


async def _result(future: torch.futures.Future[Any]) -> Any:
    """Await a ``torch.futures.Future`` in the running asyncio loop
    (its callback may run on any of TensorPipe's threads)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def wake(_: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(settle)

    future.add_done_callback(wake)
    await done
    return future.wait()


class RPCStaging:
    """The flat tensor each send's bytes wait in, shared by the calls that
    carry them to the workers."""

    def __init__(self, model_id: str | None) -> None:
        self.model_id = model_id
        self.buffer: torch.Tensor | None = None
        # The calls still carrying ``buffer``: it is written again only
        # once they all returned.
        self._carrying: set[torch.futures.Future[Any]] = set()
        #: Names this sender's versions on the workers.
        self.token = os.urandom(8).hex()
        self.host, self.pid = socket.gethostname(), os.getpid()

    def write(
        self, packet: Packet, digest: bool, placements: Mapping[int, Placement]
    ) -> tuple[int, ...] | None:
        manifest = packet.manifest
        self._carrying = {f for f in self._carrying if not f.done()}
        if self.buffer is None or self.buffer.numel() != manifest.nbytes or self._carrying:
            # (A call sends the whole storage of a tensor: the buffer is
            # exactly the packet's size.)
            self.buffer = torch.empty(manifest.nbytes, dtype=torch.uint8)
            self._carrying = set()
        with on_caller_stream(packet):
            return copy_out(manifest.views(self.buffer), packet.tensors, digest, usable_cores())

    def descriptor(self, worker_id: int) -> torch.Tensor:
        assert self.buffer is not None, "write() comes first"
        return self.buffer

    def carrying(self, call: torch.futures.Future[Any]) -> None:
        """``call`` carries the current buffer until it returns."""
        self._carrying.add(call)

    def released(self, worker_id: int, version: int, holding: Any) -> None:
        """Nothing to do: each worker copies out of its call's own bytes."""

    async def aclose(self) -> None:
        self.buffer = None
        self._carrying = set()


class RPCSenderTransport:
    """The sender's channel to one worker, an RPC peer (its name, rank or
    ``WorkerInfo``)."""

    def __init__(self, peer: Any, worker_id: int, staging: RPCStaging, model_id: str | None) -> None:
        self.peer = peer
        self.worker_id = worker_id
        self.model_id = model_id
        self._staging = staging
        self.layout: Manifest | None = None
        self.devices: tuple[str, ...] | None = None
        #: (Its update arrives in host memory: the call's tensor.)
        self.reach: tuple[str, ...] = ()
        # The worker's pid, once it announced itself, where it runs on this
        # host; and its Process object, where multiprocessing started it
        # here: it tells how the worker ended even after the user joined it.
        self._pid: int | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        # The version of the update posted last, and its call.
        self._posted = 0
        self._call: torch.futures.Future[Any] | None = None
        self._closed = False
        self._gone: WorkerLostError | None = None

    def _lost(self, reason: str) -> WorkerLostError:
        """The worker is gone: with its exit status where it ran on this host."""
        if self._gone is not None:
            return self._gone
        code: int | None = None
        sig: int | None = None
        if self._pid is not None:
            code, sig = exit_status(self._pid, self._process)
        why = describe_exit(code, sig)
        error = worker_lost(
            self.worker_id,
            self.model_id,
            f"{why}; {reason}" if why else reason,
            exit_code=code,
            exit_signal=sig,
        )
        if code is not None or sig is not None:
            self._gone = error  # dead for sure: later sends fail at once
        return error

    @contextlib.contextmanager
    def _map_errors(self, what: str) -> Iterator[None]:
        """Turn an error of ``torch.distributed.rpc`` into weightsync's."""
        try:
            yield
        except RuntimeError as exc:
            raise self._lost(f"its RPC peer {self._peer_name()} failed ({what}: {_first_line(exc)})") from exc

    def _peer_name(self) -> str:
        return repr(getattr(self.peer, "name", self.peer))

    def _invoke(self, func: Any, args: tuple[Any, ...], timeout: float) -> torch.futures.Future[Any]:
        if self._closed:
            raise self._lost("the sender shut down this channel")
        if self._gone is not None:
            raise self._gone
        with self._map_errors("a call"):
            return rpc.rpc_async(self.peer, func, args=args, timeout=timeout)

    async def connect(self) -> Manifest | None:
        if self.layout is not None:
            return self.layout
        pause, most = _CONNECT_POLL
        while True:
            call = self._invoke(describe_worker, (self.model_id,), _CALL_TIMEOUT)
            with self._map_errors("asking for its model"):
                described = await _result(call)
            if described is not None:
                signature, devices, host, pid = described
                if host == socket.gethostname():
                    self._pid = int(pid)
                    self._process = started_here(self._pid)
                self.devices = tuple(str(d) for d in devices)
                self.layout = Manifest.from_signature(signature)
                return self.layout
            # The peer is up, but its receiver has not announced itself yet
            # (its init_on_worker has not run): ask again until the deadline.
            await anyio.sleep(pause)
            pause = min(pause * 2, most)

    def post(self, packet: Packet) -> bool:
        staging = self._staging
        header = UpdateHeader(
            self.model_id,
            staging.token,
            packet.version,
            packet.manifest.layout_id,
            max(1, usable_cores() // packet.fanout),
            packet.subset,
            packet.digests,
            staging.host,
            staging.pid,
        )
        # No deadline of RPC's own (0): the send's deadline is the caller's scope.
        self._call = self._invoke(notice_update, (header, staging.descriptor(self.worker_id)), 0)
        staging.carrying(self._call)
        self._posted = packet.version
        return True

    def ack_fds(self, packet: Packet) -> tuple[int, ...] | None:
        return None  # the ack is the call's result: deliver() awaits it

    def try_ack(self, packet: Packet, ready: Collection[int] = ()) -> bool | None:
        return None

    async def deliver(self, packet: Packet) -> None:
        if self._posted != packet.version or self._call is None:
            self.post(packet)
        assert self._call is not None
        with self._map_errors(f"carrying version {packet.version}"):
            reply = await _result(self._call)
        kind = reply[0]
        if kind == "ack" and reply[1] == packet.version:
            return
        if kind == "error":
            raise worker_failed(self.worker_id, self.model_id, packet.version, str(reply[2]))
        if kind == "absent":
            raise self._lost(str(reply[1]))
        raise worker_failed(self.worker_id, self.model_id, packet.version, f"unexpected reply {reply!r:.80}")

    def why_late(self) -> str | None:
        return None

    async def aclose(self) -> None:
        """Tell the worker the sender shut down (if RPC still runs here and
        the worker answers within half a second), then close."""
        if self._closed:
            return
        self._closed = True
        if self._gone is not None or self.layout is None or not rpc_ready():
            return
        with contextlib.suppress(Exception), anyio.move_on_after(_CLOSE_WAIT):
            call = rpc.rpc_async(
                self.peer, notice_closed, args=(self.model_id, self._staging.token), timeout=_CLOSE_WAIT
            )
            await _result(call)
