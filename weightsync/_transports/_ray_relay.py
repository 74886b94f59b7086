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
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ._gloo_chain import CHUNK_BYTES, chunk_spans, connect_store, gloo_group, relay_chain, send_chain
from ._gloo_chain import seconds as _seconds

__all__ = ["CHUNK_BYTES", "HostRelay", "RelayAgent", "chunk_spans"]

# The longest a chain waits for one chunk to move before it calls the hop
# broken, as a fraction of the time left in the send, within these bounds.
_STALL_BOUNDS = (1.0, 5.0)
_STALL_FRACTION = 0.125
# Attempts at one send: the first chain, then repairs around failed hosts.
_ATTEMPTS = 3


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
    passes them on to the next, and puts them into its node's object store
    for the actors of the host. Holds one receive buffer, reused by sends of
    the same size."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._group: Any = None
        self._generation = ""
        self._buffer: torch.Tensor | None = None
        self._ref: Any = None
        self._lock = threading.Lock()

    def address(self) -> str:
        """This host's address, which its end of the chain binds to."""
        return _node_address()

    def ping(self) -> int:
        """Answers at once (a relay in progress runs on another thread)."""
        return os.getpid()

    def join(self, host: str, port: int, generation: str, rank: int, size: int, stall: float) -> bool:
        """Become rank ``rank`` of group ``generation``; blocks until every
        member joined (or raises after ``stall`` seconds)."""
        store = connect_store(host, port, stall)
        group = gloo_group(store, generation, rank, size, _node_address(), stall)
        with self._lock:
            self._group, self._generation = group, generation
        return True

    def relay(
        self,
        generation: str,
        header: tuple[Any, ...],
        sizes: Sequence[int],
        chunk: int,
        src: int,
        dst: int | None,
        stall: float,
        first: float,
    ) -> tuple[Any, ...]:
        """Receive one send (tensors of ``sizes`` bytes) and pass it on;
        return ``("ok", [ref], error)`` with the host's copy, stored as the
        trainer's object is (``(header, byte arrays)``; ``error`` is None, or
        why the next host did not get it all), or ``("error", message)``.
        On any error the group is dropped."""
        import ray

        with self._lock:
            group = self._group if self._generation == generation else None
        if group is None:
            return ("error", f"not a member of group {generation}")
        total = int(sum(sizes))
        self._ref = None  # the previous send's copy is no longer needed here
        if self._buffer is None or self._buffer.numel() != total:
            self._buffer = None
            self._buffer = torch.empty(total, dtype=torch.uint8)
        buffer = self._buffer
        complete, error = relay_chain(group, buffer, chunk, src, dst, stall, first)
        if error is not None:
            with self._lock:
                if self._generation == generation:
                    self._group, self._generation = None, ""
        if not complete:
            return ("error", error)
        flat = buffer.numpy()
        arrays, offset = [], 0
        for size in sizes:
            arrays.append(flat[offset : offset + size])
            offset += size
        self._ref = ray.put((header, tuple(arrays)))
        # The chain broke after this host (error set): it still has it all.
        return ("ok", [self._ref], error)

    def leave(self) -> None:
        with self._lock:
            self._group, self._generation = None, ""
        self._buffer, self._ref = None, None


class HostRelay:
    """The trainer's side of the relay for one Ray scheme: the agents (one
    per receiving node, started on first use and kept), the store, the
    current group, and the chain of each send.

    :meth:`start` returns at once; the chain runs on a thread of its own and
    resolves one future per host with the object that host's actors are to
    read: its own copy, or the trainer's object where no chain reached it.
    """

    def __init__(self, model_id: str | None, chunk: int = CHUNK_BYTES) -> None:
        self.model_id = model_id
        self.chunk = chunk
        self._agents: dict[str, Any] = {}
        self._address = ""
        self._store: Any = None
        self._group: Any = None
        # The nodes of the current group, in rank order (rank i + 1).
        self._members: tuple[str, ...] = ()
        self._generations = 0
        self._generation = ""
        self._token = os.urandom(4).hex()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Per send: how many chains ran, and the nodes each one reached
        #: (for the benchmark and the tests).
        self.last_attempts: list[tuple[str, ...]] = []

    # -- setup -----------------------------------------------------------------
    def _agent(self, node: str) -> Any:
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

            self._address = _node_address()
            self._store = dist.TCPStore(
                self._address, 0, is_master=True, wait_for_workers=False, timeout=_seconds(60)
            )

    def _form(self, nodes: Sequence[str], stall: float) -> None:
        """A new group: the trainer (rank 0) and ``nodes`` (ranks 1..n)."""
        import ray

        self._drop()
        self._ensure_store()
        self._generations += 1
        generation = f"ws{self._token}/{self.model_id}/g{self._generations}"
        port = int(self._store.port)
        size = len(nodes) + 1
        joins = [
            self._agent(node).join.remote(self._address, port, generation, i + 1, size, stall)
            for i, node in enumerate(nodes)
        ]
        # A client of its own, whose waits give up after a stall limit.
        store = connect_store(self._address, port, stall)
        group = gloo_group(store, generation, 0, size, self._address, stall)
        ray.get(joins, timeout=stall + 5.0)
        self._group, self._members = group, tuple(nodes)
        self._generation = generation

    def _drop(self) -> None:
        self._group, self._members, self._generation = None, (), ""

    # -- one send --------------------------------------------------------------
    def start(
        self, ref: Any, header: tuple[Any, ...], nodes: Sequence[str], deadline: float
    ) -> dict[str, concurrent.futures.Future[Any]]:
        """Start sending the trainer's object ``ref`` (``(header, byte
        arrays)``) to ``nodes`` along a chain; ``deadline``: a
        ``time.monotonic()`` time. Returns a future per node."""
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
            self._chains(ref, header, nodes, deadline, futures)
        except BaseException:  # never leave a waiting deliver() without an answer
            pass
        finally:
            for future in futures.values():
                _resolve(future, ref)

    def _chains(
        self,
        ref: Any,
        header: tuple[Any, ...],
        nodes: list[str],
        deadline: float,
        futures: dict[str, concurrent.futures.Future[Any]],
    ) -> None:
        import ray
        import ray.exceptions

        _, arrays = ray.get(ref)
        sources = _byte_tensors(arrays)
        sizes = [s.numel() for s in sources]
        pending = list(nodes)
        excluded: set[str] = set()
        self.last_attempts = []
        for _ in range(_ATTEMPTS):
            chain = [n for n in pending if n not in excluded]
            left = deadline - time.monotonic()
            if len(chain) < 2 or left <= 0 or self._closed:
                return  # one host (or none) left: the direct path serves it
            stall = min(max(left * _STALL_FRACTION, _STALL_BOUNDS[0]), _STALL_BOUNDS[1])
            if self._members != tuple(chain):
                try:
                    self._form(chain, stall)
                except Exception:
                    self._drop()
                    excluded |= self._unresponsive(chain)
                    continue
            generation = self._generation
            calls = {
                node: self._agents[node].relay.remote(
                    generation, header, sizes, self.chunk, i, i + 2 if i + 2 <= len(chain) else None,
                    stall, 2 * stall,
                )
                for i, node in enumerate(chain)
            }  # fmt: skip
            self.last_attempts.append(tuple(chain))
            broken = False
            try:
                send_chain(self._group, sources, self.chunk, 1, stall)
            except RuntimeError:
                broken = True
            # Collect the agents' results: all of them, or, once the chain
            # broke, those that answer within a stall limit more.
            waiting = dict(calls)
            patience = deadline
            while waiting:
                timeout = max(min(patience, deadline) - time.monotonic(), 0.0)
                ready, _ = ray.wait(list(waiting.values()), num_returns=1, timeout=timeout)
                if not ready:
                    break
                node = next(n for n, r in waiting.items() if r == ready[0])
                del waiting[node]
                try:
                    result = ray.get(ready[0])
                except ray.exceptions.RayError:
                    excluded.add(node)
                    result = ("error", "agent lost")
                if result[0] == "ok":
                    _resolve(futures[node], result[1][0])
                    pending.remove(node)
                if result[0] != "ok" or result[2] is not None:
                    broken = True
                if broken:
                    # The others answer within a stall limit (their own
                    # waits give up); one that does not is stopped or cut off.
                    patience = min(patience, time.monotonic() + stall + 1.0)
            excluded |= set(waiting)
            if not broken and not waiting:
                return
            self._drop()
            if not pending:
                return

    def _unresponsive(self, nodes: Sequence[str]) -> set[str]:
        """The agents of ``nodes`` that do not answer a ping within a second."""
        import ray

        pings = {node: self._agent(node).ping.remote() for node in nodes}
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=1.0)
        answered = set()
        for node, ref in pings.items():
            if ref in ready:
                try:
                    ray.get(ref)
                    answered.add(node)
                except Exception:
                    pass
        return {n for n in nodes if n not in answered}

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
        self.join(timeout=15.0)
        self._drop()
        agents, self._agents = list(self._agents.values()), {}
        if agents:
            import ray

            for agent in agents:
                with contextlib.suppress(Exception):
                    ray.kill(agent)
        self._store = None
