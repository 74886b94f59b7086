"""The Ray transport's relay: one send to many hosts, each host's NIC crossing
the bytes about once.

Ray's object store sends a put object from the trainer's node to every node
that reads it: a star, whose time grows with the number of hosts (hosts x
S/B for S bytes over NICs of B bytes/s). The relay makes it a pipelined
chain instead: the trainer sends the bytes, in chunks, to the first host,
which passes each chunk on to the next as soon as it has it, and so on. Every
NIC carries the bytes once in and once out, and the last host finishes about
(hosts - 1) chunks after the first: S/B + (hosts - 1) x chunk/B.

Who does what:

- **Ray is the control plane.** One :class:`RelayAgent` (a small threaded
  actor of weightsync's, no CPU reserved) runs on every receiving host. The
  trainer starts one call per agent for a send, and the call's result is
  that host's copy as an object of its own node's store, from which the
  host's actors are then fed by the usual apply call: each host receives
  the bytes once, however many actors it has.
- **torch.distributed (gloo) is the data plane.** The trainer and the
  agents form a gloo process group of their own (no global state: it is a
  ``ProcessGroupGloo`` over a ``PrefixStore`` of a TCPStore the trainer
  hosts, bound to each node's address), connecting only the neighbours of
  the chain (lazy connections). A probe on 1 Gbit/s NICs measured a chain
  of 1 MiB gloo messages at 1.17x the network floor for 64 MiB to 5 hosts,
  while the same chain of 4 or 8 MiB Ray objects re-put on each host took
  3x: Ray's cost per transferred object dominates at chunk sizes.

Faults. Every gloo wait has a stall limit, so a dead or stopped host breaks
the chain within that limit on both of its sides; its agent's call fails
(dead) or never returns (stopped). The hosts that got everything keep their
copies; the group is dropped and a new chain is formed over the incomplete
hosts whose agents still answer, within the send's deadline. A host that no
chain could reach is fed the way a single host is, from the trainer's own
object (Ray pulls it to that node): Ray then reports its actors as dead, or
their acks miss the deadline, exactly as without the relay.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import warnings
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch

from ._chain import ChainDriver, ChainMember, Link, Report, Route
from ._gloo_chain import CHUNK_BYTES, chunk_spans, connect_store
from ._gloo_chain import seconds as _seconds

__all__ = ["CHUNK_BYTES", "HostRelay", "RelayAgent", "chunk_spans"]


def _node_address() -> str:
    import ray.util

    return str(ray.util.get_node_ip_address())


def _byte_tensors(arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        # Read-only views of the object store, only ever read from here.
        warnings.simplefilter("ignore", UserWarning)
        return [torch.from_numpy(a.reshape(-1).view(np.uint8)) for a in arrays]


def _resolve(future: concurrent.futures.Future[Any], value: Any) -> None:
    """Set ``future``'s result, unless its waiter gave up on it (cancelled)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(value)


class RelayAgent:
    """One host's relay (made a Ray actor by :class:`HostRelay`, pinned to its
    node): receives a send's bytes from the previous host of the chain,
    passes them on to the next (a :class:`ChainMember`), and puts them into
    its node's object store for the actors of the host. Holds one receive
    buffer, reused by sends of the same size."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._member = ChainMember(_node_address())
        self._buffer: torch.Tensor | None = None
        self._ref: Any = None

    def address(self) -> str:
        """This host's address, which its end of the chain binds to."""
        return self._member.address

    def ping(self) -> int:
        """Answers at once (a relay in progress runs on another thread)."""
        return os.getpid()

    def relay(
        self, store: tuple[str, int], link: Link, header: tuple[Any, ...], sizes: Sequence[int]
    ) -> tuple[Any, ...]:
        """Take part in the chain of ``link`` (joining its group, in the
        trainer's store at ``store``, when it is a new one): receive one send
        (tensors of ``sizes`` bytes) and pass it on. Blocks until the send
        ended here. Returns ``("ok", [ref], error)`` with the host's copy,
        stored as the trainer's object is (``(header, byte arrays)``;
        ``error`` is None, or why the next host did not get it all), or
        ``("error", why)``."""
        import ray

        total = int(sum(sizes))
        self._ref = None  # the previous send's copy is no longer needed here
        if self._buffer is None or self._buffer.numel() != total:
            self._buffer = None
            self._buffer = torch.empty(total, dtype=torch.uint8)
        buffer = self._buffer
        report = self._member.relay(lambda timeout: connect_store(*store, timeout), link, buffer)
        if not report.complete:
            return ("error", report.error)
        flat = buffer.numpy()
        arrays, offset = [], 0
        for size in sizes:
            arrays.append(flat[offset : offset + size])
            offset += size
        self._ref = ray.put((header, tuple(arrays)))
        # The chain broke after this host (error set): it still has it all.
        return ("ok", [self._ref], report.error)

    def leave(self) -> None:
        self._member.leave()
        self._buffer, self._ref = None, None


class _RelayControl:
    """The Ray relay's part of the chain (a ``ChainControl`` over node ids):
    members are told by a call to their agent, whose result is their report
    and, when the host got it all, its copy, which resolves the host's
    future. :meth:`begin` sets what the current send carries."""

    def __init__(self, relay: HostRelay) -> None:
        self.namespace = relay.namespace
        self.address = relay.address
        self._relay = relay
        self._header: tuple[Any, ...] = ()
        self._sizes: list[int] = []
        self._futures: dict[str, concurrent.futures.Future[Any]] = {}
        self._calls: dict[Any, str] = {}
        self._names: dict[str, str] = {}

    def begin(
        self, header: tuple[Any, ...], sizes: list[int], futures: dict[str, concurrent.futures.Future[Any]]
    ) -> None:
        self._header, self._sizes, self._futures = header, sizes, futures

    def group_store(self, stall: float) -> Any:
        # A client of its own, whose waits give up after a stall limit.
        return connect_store(self.address, self._relay.port, stall)

    def plan(self, members: list[str]) -> tuple[list[str], dict[str, tuple[str, ...]]]:
        return list(members), {}

    def name(self, member: str) -> str:
        if not self._names:
            import ray

            with contextlib.suppress(Exception):
                self._names = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return f"host {self._names.get(member, member[:12])}"

    def launch(self, route: Route[str]) -> None:
        store = (self.address, self._relay.port)
        self._calls = {
            self._relay.agent(node).relay.remote(store, route.link(node), self._header, self._sizes): node
            for node in route.chain
        }

    def poll(self, route: Route[str], waiting: Collection[str], wait: float) -> list[tuple[str, Report]]:
        import ray
        import ray.exceptions

        calls = [ref for ref, node in self._calls.items() if node in waiting]
        ready, _ = ray.wait(calls, num_returns=1, timeout=wait)
        came = []
        for ref in ready:
            node = self._calls.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError as exc:
                came.append(
                    (node, Report(False, f"its relay agent is gone ({type(exc).__name__})", gone=True))
                )
                continue
            if result[0] == "ok":
                _resolve(self._futures[node], result[1][0])
                came.append((node, Report(True, result[2])))
            else:
                came.append((node, Report(False, result[1])))
        return came

    def settle(self, route: Route[str]) -> None:
        self._calls = {}


class HostRelay:
    """The trainer's side of the relay for one Ray scheme: the agents (one
    per receiving node, started on first use and kept), the store, and a
    :class:`ChainDriver` that carries each send.

    :meth:`start` returns at once; the chain runs on a thread of its own and
    resolves one future per host with the object that host's actors are to
    read: its own copy, or the trainer's object where no chain reached it
    (:meth:`why` then says why).
    """

    def __init__(self, model_id: str | None, chunk: int = CHUNK_BYTES) -> None:
        self.model_id = model_id
        self.chunk = chunk
        self._agents: dict[str, Any] = {}
        self.address = ""
        self.port = 0
        self._store: Any = None
        self.namespace = f"ws{os.urandom(4).hex()}/{model_id}/"
        self._control: _RelayControl | None = None
        self._driver: ChainDriver[str] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def last_attempts(self) -> list[tuple[str, ...]]:
        """How many chains the last send ran, and the nodes each one reached
        (for the benchmark and the tests)."""
        return [] if self._driver is None else [route.chain for route in self._driver.routes]

    def why(self, node: str) -> str | None:
        """Why no chain of the last send brought ``node`` its copy (None: one did, or it was not in it)."""
        return None if self._driver is None else self._driver.why(node)

    # -- setup -----------------------------------------------------------------
    def agent(self, node: str) -> Any:
        """The agent of ``node``, started on first use."""
        agent = self._agents.get(node)
        if agent is None:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            agent_class = ray.remote(RelayAgent)
            agent = agent_class.options(
                num_cpus=0,
                max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote()
            self._agents[node] = agent
        return agent

    def _ensure_store(self) -> None:
        if self._store is None:
            import torch.distributed as dist

            self.address = _node_address()
            self._store = dist.TCPStore(
                self.address, 0, is_master=True, wait_for_workers=False, timeout=_seconds(60)
            )
            self.port = int(self._store.port)

    # -- one send --------------------------------------------------------------
    def start(
        self, ref: Any, header: tuple[Any, ...], nodes: Sequence[str], deadline: float
    ) -> dict[str, concurrent.futures.Future[Any]]:
        """Start sending the trainer's object ``ref`` (``(header, byte
        arrays)``) to ``nodes`` along a chain; ``deadline``: a
        ``time.monotonic()`` time. Returns a future per node; never waits."""
        futures: dict[str, concurrent.futures.Future[Any]] = {n: concurrent.futures.Future() for n in nodes}
        # A chain of an abandoned send may still be ending (within a stall
        # limit): the new chain waits for it on its own thread, never here,
        # which is the caller's event loop.
        self._thread = threading.Thread(
            target=self._run, args=(self._thread, ref, header, list(nodes), deadline, futures), daemon=True,
            name=f"weightsync-relay-{self.model_id}",
        )  # fmt: skip
        self._thread.start()
        return futures

    def _run(
        self,
        previous: threading.Thread | None,
        ref: Any,
        header: tuple[Any, ...],
        nodes: list[str],
        deadline: float,
        futures: dict[str, concurrent.futures.Future[Any]],
    ) -> None:
        try:
            if previous is not None:
                previous.join()
            if self._closed:
                return
            import ray

            self._ensure_store()
            _, arrays = ray.get(ref)
            sources = _byte_tensors(arrays)
            if self._control is None or self._driver is None:
                self._control = _RelayControl(self)
                # One host (or none) left is served by the direct path.
                self._driver = ChainDriver(self._control, chunk=self.chunk, min_chain=2)
            self._control.begin(header, [s.numel() for s in sources], futures)
            self._driver.run(sources, nodes, deadline)
        except BaseException:  # never leave a waiting deliver() without an answer
            pass
        finally:
            for future in futures.values():
                _resolve(future, ref)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the chain of the previous send to end."""
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    def close(self) -> None:
        """Stop the agents and drop the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._driver is not None:
            self._driver.close()
        self.join(timeout=15.0)
        agents, self._agents = list(self._agents.values()), {}
        if agents:
            import ray

            for agent in agents:
                with contextlib.suppress(Exception):
                    ray.kill(agent)
        self._store = None
