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
  trainer starts one call per agent for a send; the agent receives the
  bytes straight into shared memory of its own (``_host_copy``), and the
  call's result says where: the host's actors, told by their apply call,
  map it and copy from it into their models. Each host receives the bytes
  once, however many actors it has, and copies them once per actor.
  (An actor that cannot map it reads the trainer's object instead.)
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

Deltas (``delta=True``, :class:`RelayDelta`). The chain can carry what
changed instead of the bytes (``_delta``): the trainer keeps the
concatenation of a send's arrays as its base once a relayed actor of that
send acked it (the hosts that missed it go on holding an older version,
which is kept for them: ``delta_history``), and each agent keeps its
receive buffer holding the last version it relayed completely, which it
says in its result. A send's first chain carries delta frames, encoded on
the chain's thread as they are sent, to the agents whose buffer holds the
base version; each rebuilds the version in place and checks every chunk
against the trainer's digest before its actors are told. An agent that
holds a kept older version gets a delta against it in a chain of its own.
The other agents (a new one, one whose last relay failed or whose rebuild
failed, any doubt) get the bytes themselves in a later chain of the same
send.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import warnings
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..._frames import CHUNK_BYTES
from ..._memory._segment import Segment
from ..._packet import ChainReport
from .._chain._delta_base import HISTORY, DeltaBase, DeltaChoice, DeltaSetting
from .._chain._driver import ChainDriver, ChainMember, EncodedSend, Link, Report, Route
from .._chain._gloo import connect_store
from .._chain._pipeline import seconds as _seconds
from ._host_copy import HostBuffers, HostCopy

if TYPE_CHECKING:
    import numpy as np

__all__ = ["HostRelay", "RelayAgent", "RelayDelta", "SendKind"]


def _node_address() -> str:
    import ray.util

    return str(ray.util.get_node_ip_address())


def _byte_tensors(arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    import numpy as np

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
    node): receives a send's bytes from the previous host of the chain into
    shared memory (:class:`~._host_copy.HostBuffers`), passes them on to the
    next (a :class:`ChainMember`), and says where the host's actors map
    them. Its segment, reused by sends of the same size, holds the last
    whole version relayed completely here: the base a delta is rebuilt
    against, in place (or into a fresh segment, while a late reader still
    holds the base)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._member = ChainMember(_node_address())
        self._buffers = HostBuffers()
        # The version this host holds whole (None: none, or in doubt), and
        # the segment holding it: a delta's base.
        self._holds: int | None = None
        self._holder: Segment | None = None

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
        ended here. Returns ``("ok", copy, error, rebuild, holds)`` with the
        :class:`~._host_copy.HostCopy` the host's actors read (``error`` is
        None, or why the next host did not get it all), or ``("error", why,
        rebuild, holds)``; ``rebuild``: of a delta, its CPU seconds and
        threads (else None); ``holds``: the version this host's segment now
        holds whole (None: none), the base of a later delta.

        Of an encoded chain (``link.encoded``), the frames are rebuilt
        against the segment if it holds the delta's base version; else (or
        if a chunk's check fails) the result is an error, and the trainer
        sends the bytes in a later chain."""
        version, whole = header[2], header[5] is None
        total = int(sum(sizes))
        encoded = link.encoded
        # From here on no reader starts on the segment (it is marked being
        # written), and none is reading it.
        segment = self._buffers.claim(total)
        holder = self._holder
        base = None
        if encoded is not None and self._holds == encoded.base_version and holder is not None:
            # The base is rebuilt in place, or read from the segment that
            # holds it while a reader keeps it (then it stays the base
            # until the new one is whole).
            data = holder.data
            base = None if data is None or holder.nbytes != total else data[:total]
        if holder is segment:
            self._holds, self._holder = None, None
        assert segment.data is not None
        buffer = segment.data[:total]
        try:
            report = self._member.relay(
                lambda timeout: connect_store(*store, timeout), link, buffer, base=base
            )
            base = None
            if report.complete:
                copy = HostCopy(segment.ref(), self._buffers.publish(segment), tuple(int(s) for s in sizes))
                # A partial update is no base for a later delta.
                self._holds, self._holder = (version, segment) if whole else (None, None)
        finally:
            self._buffers.release(segment, keep=self._holder)
        if not report.complete:
            return ("error", report.error, report.rebuild, self._holds)
        # The chain broke after this host (error set): it still has it all.
        return ("ok", copy, report.error, report.rebuild, self._holds)

    def leave(self) -> None:
        self._member.leave()
        self._buffers.close()
        self._holds, self._holder = None, None


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
        #: The version each node's agent said its buffer holds (see ``RelayAgent.relay``).
        self.holds: dict[str, int | None] = {}

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
                self.holds[node] = None
                # Its handle is let go (Ray then closes what it kept for it);
                # a later send to the node starts another.
                self._relay.forget_agent(node)
                came.append(
                    (node, Report(False, f"its relay agent is gone ({type(exc).__name__})", gone=True))
                )
                continue
            self.holds[node] = result[-1]
            if result[0] == "ok":
                _resolve(self._futures[node], result[1])
                came.append((node, Report(True, result[2], rebuild=result[3])))
            else:
                came.append((node, Report(False, result[1], rebuild=result[2])))
        return came

    def settle(self, route: Route[str]) -> None:
        self._calls = {}


class SendKind(NamedTuple):
    """What the trainer knows of a send's bytes that the relay needs for a delta."""

    version: int
    #: The bytes of every tensor (no partial update).
    whole: bool
    #: The bytes per element the frames' byte planes are split by.
    element_size: int


class RelayDelta:
    """``delta=True``: the trainer's base and encoder (a
    :class:`~._delta_base.DeltaBase`), and the buffer each relayed send is
    gathered into (the concatenation of its arrays: what the chain carries).

    A send's gathered buffer becomes the base, kept instead of copied, at
    the next relayed send, once the trainer said that an actor of the
    send acked it (:meth:`settle`); the old base's memory then gathers the
    next send. So the trainer holds two buffers of the model's size, the
    base and the send in flight. Eligible for a delta: the agents that said
    their buffer holds the base version. Used from the chain's thread only,
    but :meth:`settle`."""

    def __init__(self, chunk: int, *, threads: int = 0, always: bool = False, history: int = HISTORY) -> None:
        self.base = DeltaBase(chunk, threads=threads, always=always, history=history)
        self._gathered: np.ndarray | None = None
        # The send gathered in it, and the trainer's word on a send: (version, a relayed actor acked).
        self._kind: SendKind | None = None
        self._settled: tuple[int, bool] | None = None

    def settle(self, version: int, acked: bool) -> None:
        """The trainer is done with send ``version``: whether an actor it
        relayed to acked it (its host's agent then holds it whole: a whole
        relayed send can be the base)."""
        self._settled = (version, acked)

    def gather(
        self, sources: Sequence[torch.Tensor], kind: SendKind, held: Collection[int] = ()
    ) -> torch.Tensor | None:
        """Gather a whole send's ``sources`` into one flat buffer (after
        adopting the last gathered send as the base, where it may be): the
        bytes every chain of this send carries, and that the frames are
        taken over. None for a partial send, which goes as it is and
        leaves the base as it was. ``held``: the versions the agents' buffers
        hold (an older base is kept for them). Blocks for one copy."""
        self._adopt_last(held)
        if not kind.whole:
            return None
        nbytes = sum(s.numel() for s in sources)
        self.base.fit(nbytes, kind.element_size)  # (a new layout: it starts again)
        gathered = self._gathered
        if gathered is None or gathered.nbytes != nbytes:
            gathered = self._gathered = None
            import numpy as np

            gathered = np.empty(nbytes, dtype=np.uint8)
        self._gathered, self._kind = gathered, kind
        offset = 0
        for source in sources:
            # A memmove on this thread (numpy's), off torch's intra-op pool.
            gathered[offset : offset + source.numel()] = source.numpy()
            offset += source.numel()
        return torch.from_numpy(gathered)

    def _adopt_last(self, held: Collection[int]) -> None:
        """The last gathered send becomes the base if it is settled as acked
        (by a relayed actor); its buffer is then the base's, and the old
        base's memory gathers the next send, unless it is kept for the
        agents that hold its version (``held``: the versions they hold)."""
        last, gathered = self._kind, self._gathered
        if last is None or gathered is None or not self.base.fits(gathered.nbytes):
            return
        if self._settled == (last.version, True):
            self._gathered, self._kind = self.base.adopt(gathered, last.version, held), None

    def encoded(self, flat: torch.Tensor, holds: dict[str, int | None]) -> list[EncodedSend]:
        """The delta chains of the send gathered in ``flat``: for the agents
        whose buffer ``holds`` the base version, and for those holding an
        older one that was kept (see :meth:`DeltaBase.chains`); none when
        there is no base, the send is not whole, or a delta is not expected
        to pay (:class:`~._delta_base.DeltaChoice`). Blocks to encode samples."""
        kind, base = self._kind, self.base.version
        if kind is None or not kind.whole or base is None:
            choice = self.base.choice
            choice.went, choice.guess, choice.behind = False, None, {}
            choice.why = (
                "full bytes: a partial send" if kind is None or not kind.whole else "full bytes: no base"
            )
            return []
        return self.base.chains(flat, holds)


class HostRelay:
    """The trainer's side of the relay for one Ray scheme: the agents (one
    per receiving node, started on first use and kept), the store, and a
    :class:`ChainDriver` that carries each send.

    :meth:`start` returns at once; the chain runs on a thread of its own and
    resolves one future per host with what that host's actors are to read:
    its own copy (a :class:`~._host_copy.HostCopy`), or the trainer's object
    where no chain reached it (:meth:`why` then says why).
    """

    def __init__(
        self,
        model_id: str | None,
        chunk: int = CHUNK_BYTES,
        *,
        delta: DeltaSetting = False,
        delta_threads: int = 0,
        delta_history: int = HISTORY,
    ) -> None:
        self.model_id = model_id
        self.chunk = chunk
        #: ``delta=True``: the base and the encoder (see :class:`RelayDelta`).
        self.delta = (
            RelayDelta(chunk, threads=delta_threads, always=delta == "always", history=delta_history)
            if delta
            else None
        )
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

    @property
    def last_delta(self) -> list[bool]:
        """Per chain of the last send: whether it carried a delta."""
        return [] if self._driver is None else [r.encoded is not None for r in self._driver.routes]

    @property
    def last_wire_bytes(self) -> int:
        """The bytes the trainer put on the chains of the last send."""
        return 0 if self._driver is None else self._driver.sent_bytes

    def report(self) -> ChainReport:
        """How the chains of the current send carried it, so far."""
        if self._driver is None:
            return ChainReport()
        return self._driver.report(self.delta_choice)

    @property
    def delta_choice(self) -> DeltaChoice | None:
        """``delta=True``: why the last send went as a delta or whole, and the
        rates measured (None: no delta)."""
        return None if self.delta is None else self.delta.base.choice

    def why(self, node: str) -> str | None:
        """Why no chain of the last send brought ``node`` its copy (None: one did, or it was not in it)."""
        return None if self._driver is None else self._driver.why(node)

    # -- setup -----------------------------------------------------------------
    def forget_agent(self, node: str) -> None:
        """``node``'s agent is gone (its process, or its node, died)."""
        self._agents.pop(node, None)

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
        self,
        ref: Any,
        header: tuple[Any, ...],
        nodes: Sequence[str],
        deadline: float,
        kind: SendKind | None = None,
    ) -> dict[str, concurrent.futures.Future[Any]]:
        """Start sending the trainer's object ``ref`` (``(header, byte
        arrays)``) to ``nodes`` along a chain; ``deadline``: a
        ``time.monotonic()`` time; ``kind``: what a delta needs to know of
        the send (with ``delta=True``). Returns a future per node; never
        waits: with ``delta=True`` the bytes are gathered and encoded on
        the chain's thread."""
        futures: dict[str, concurrent.futures.Future[Any]] = {n: concurrent.futures.Future() for n in nodes}
        # A chain of an abandoned send may still be ending (within a stall
        # limit): the new chain waits for it on its own thread, never here,
        # which is the caller's event loop.
        self._thread = threading.Thread(
            target=self._run, args=(self._thread, ref, header, list(nodes), deadline, futures, kind),
            daemon=True, name=f"weightsync-relay-{self.model_id}",
        )  # fmt: skip
        self._thread.start()
        return futures

    def settle(self, version: int, acked: bool) -> None:
        """The trainer is done with send ``version``, which an actor it
        relayed to acked or not (see :meth:`RelayDelta.settle`)."""
        if self.delta is not None:
            self.delta.settle(version, acked)

    def _run(
        self,
        previous: threading.Thread | None,
        ref: Any,
        header: tuple[Any, ...],
        nodes: list[str],
        deadline: float,
        futures: dict[str, concurrent.futures.Future[Any]],
        kind: SendKind | None,
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
            sizes = [s.numel() for s in sources]
            if self._control is None or self._driver is None:
                self._control = _RelayControl(self)
                # One host (or none) left is served by the direct path; with
                # deltas it is a chain of its own, so that its agent holds
                # the version, the base of the next send.
                min_chain = 1 if self.delta is not None else 2
                self._driver = ChainDriver(self._control, chunk=self.chunk, min_chain=min_chain)
            encoded: list[EncodedSend] = []
            if self.delta is not None and kind is not None:
                # The frames are taken over the arrays' concatenation, which
                # every chain of the send then carries (and may become the base).
                holds = self._control.holds
                flat = self.delta.gather(sources, kind, {v for v in holds.values() if v is not None})
                if flat is not None:
                    sources = [flat]
                    with contextlib.suppress(Exception):  # any doubt: the full bytes
                        encoded = self.delta.encoded(flat, holds)
            for node in nodes:
                # In doubt until its agent answers for this send.
                self._control.holds[node] = None
            self._control.begin(header, sizes, futures)
            self._driver.forget()  # (an end_send() of the previous send)
            self._driver.run(sources, nodes, deadline, encoded)
            if self.delta is not None:
                self.delta.base.observe(self._driver.routes, list(self._driver.rebuilds.values()))
        except BaseException:  # never leave a waiting deliver() without an answer
            pass
        finally:
            for future in futures.values():
                _resolve(future, ref)

    def end_send(self) -> None:
        """The trainer is done with the running send (see :meth:`ChainDriver.end_send`)."""
        if self._driver is not None:
            self._driver.end_send()

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
