"""An emulated cluster on one machine: hosts as network namespaces, each with a
NIC of a chosen speed, and a Ray node in each.

Layout of one cluster (``N`` hosts, run id ``R``)::

    namespace wsc<pid>r<R>b    the switch: one bridge, no address
        h0 ... h<N-1>           its ends of the hosts' veth pairs
    namespace wsc<pid>r<R>h<i> host i: lo, and eth0 = 10.77.0.<i+1>/24

Each veth end is limited by a token bucket (``tc qdisc ... tbf``) at the
link rate on egress, so a host sends at most that rate (its eth0) and
receives at most that rate (the switch's end of its pair). Nothing is added
to the machine's own namespace: the pairs are made directly in the
namespaces, the addresses exist only there.

Processes run in a host with :meth:`EmulatedCluster.popen`, each in a
process group of its own. A host's processes are every process in its
namespace (``ip netns pids``), whatever became of their process groups
(Ray's services start process groups of their own): that is what
:meth:`EmulatedCluster.kill_host` and :meth:`EmulatedCluster.close` signal,
so nothing outside the cluster's namespaces is ever touched. The namespace
names carry the creating process's pid: :func:`remove_stale` removes those
whose creator is gone (a test run that was killed), and only those.

Needs root and ``ip``/``tc`` (iproute2); :func:`unavailable_reason` says why
not, for a caller that should skip.

The interface, for the bench and for tests (``weightsync.bench`` exports
it; nothing else of this module is meant to be used outside it):

- :class:`EmulatedCluster`: :meth:`~EmulatedCluster.start`,
  :meth:`~EmulatedCluster.start_ray`, :meth:`~EmulatedCluster.popen`,
  :meth:`~EmulatedCluster.run_python`, :meth:`~EmulatedCluster.kill_host`,
  :meth:`~EmulatedCluster.close`; :meth:`~EmulatedCluster.host_pids` (the
  processes of a host) and :meth:`~EmulatedCluster.namespaces_left` (those
  of its namespaces that exist: none once it closed); its ``namespaces``,
  ``switch``, ``addresses``, ``bytes_per_second`` and ``ray_address``.
- :func:`emulated_namespaces`: the namespaces of every emulated cluster on
  this machine, of this process or another.
- :func:`namespace_name`: the name a cluster's namespace gets, from its
  creator's pid (to make a stale one, as a killed run leaves).
- :func:`remove_stale`, :func:`unavailable_reason`, :func:`parse_rate`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "EmulatedCluster",
    "emulated_namespaces",
    "namespace_name",
    "parse_rate",
    "remove_stale",
    "unavailable_reason",
]

PREFIX = "wsc"
SUBNET = "10.77.0"
RAY_PORT = 6379
_NAME = re.compile(rf"^{PREFIX}(\d+)r(\d+)[bh]\d*$")
_RUNS = itertools.count()

# Ray settings for every node and every driver of an emulated cluster:
# token authentication off (the nodes are reachable from their namespaces
# only), no usage reports, and a dead node noticed within about 2 s instead
# of Ray's default 15 s or more.
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "1000",
}


def parse_rate(text: str) -> float:
    """Bytes per second of a tc rate such as ``1gbit``, ``500mbit``, ``10gbit``."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", text.lower())
    if match is None:
        raise ValueError(f"not a link rate: {text!r} (e.g. '1gbit', '500mbit')")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return float(match.group(1)) * scale / 8


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot be made here, or None if it can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is missing"
    probe = namespace_name(os.getpid(), next(_RUNS), None)
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def _tc(netns: str, *args: str) -> None:
    argv = ["ip", "netns", "exec", netns, "tc", *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def _pids_in(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _kill_all_in(netns: str, sig: int = signal.SIGKILL) -> None:
    """Signal every process of namespace ``netns`` until none is left (for
    SIGKILL) or once (any other signal)."""
    for _ in range(50):
        pids = _pids_in(netns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if sig != signal.SIGKILL:
            return
        time.sleep(0.05)


def _namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def emulated_namespaces() -> list[str]:
    """The network namespaces of emulated clusters that exist on this
    machine now (named as :func:`namespace_name` names them), whichever
    process made them; the machine's other namespaces are not listed."""
    return [name for name in _namespaces() if _NAME.match(name)]


def namespace_name(creator: int, run: int = 0, host: int | None = 0) -> str:
    """The name of a namespace of the ``run``-th cluster that process
    ``creator`` made: host ``host``'s, or the switch's for ``None``. A
    namespace so named whose creator is gone is stale (:func:`remove_stale`)."""
    return f"{PREFIX}{creator}r{run}" + ("b" if host is None else f"h{host}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces of emulated clusters whose creating process is
    gone, and their processes; return their names. Namespaces of a cluster
    whose creator still runs are left alone."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        _kill_all_in(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        removed.append(name)
    return removed


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold SIGINT off for the block (main thread only; elsewhere Python
    delivers no signal anyway), then raise KeyboardInterrupt if one came."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if came and callable(previous):
        previous(signal.SIGINT, None)  # (Python's own raises KeyboardInterrupt)
    elif came and previous == signal.SIG_DFL:
        raise KeyboardInterrupt


class EmulatedCluster:
    """``hosts`` emulated hosts joined by one switch, each NIC limited to
    ``rate`` (a tc rate: ``1gbit``) in each direction.

    Made by :meth:`start` (also on entering the context), removed by
    :meth:`close` (idempotent; also on leaving it, and on a failed start).
    Host 0 is where a trainer runs (the Ray head, when :meth:`start_ray` is
    called).
    """

    def __init__(self, hosts: int, rate: str = "1gbit") -> None:
        if hosts < 1:
            raise ValueError(f"an emulated cluster needs at least 1 host, not {hosts}")
        self.hosts = hosts
        self.rate = rate
        self.bytes_per_second = parse_rate(rate)
        run = next(_RUNS)
        self.switch = namespace_name(os.getpid(), run, None)
        self.namespaces = [namespace_name(os.getpid(), run, i) for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self.ray_address: str | None = None
        #: Each host's Ray node process (``ray start --block``), the latest started.
        self.ray_nodes: dict[int, subprocess.Popen[Any]] = {}
        self._ray_node_options = (4, 1024)
        self._tmp: str | None = None

    # -- the network ---------------------------------------------------------
    def start(self) -> EmulatedCluster:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot emulate a cluster here: {reason}")
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _tbf(bytes_per_second: float) -> list[str]:
        # Queue up to 20 ms of traffic per link, and let the bucket burst a
        # few full-size TCP segments, so one busy flow keeps the link full.
        rate_bits = int(bytes_per_second * 8)
        burst = max(64 * 1024, int(bytes_per_second / 500))
        return ["root", "tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "20ms"]

    def _build(self) -> None:
        tbf = self._tbf(self.bytes_per_second)
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("link", "set", "lo", "up", netns=self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "set", "lo", "up", netns=ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"h{i}",
                "netns", self.switch)  # fmt: skip
            _ip("link", "set", f"h{i}", "master", "br0", netns=self.switch)
            _ip("link", "set", f"h{i}", "up", netns=self.switch)
            _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _tc(ns, "qdisc", "add", "dev", "eth0", *tbf)
            _tc(self.switch, "qdisc", "add", "dev", f"h{i}", *tbf)

    def set_link(self, host: int, up: bool) -> None:
        """Cut host ``host``'s link (its port on the switch goes down: nothing
        passes either way, as when a cable is pulled) or heal it. The host's
        connections are not reset: they wait, or time out, as over a real
        cut."""
        _ip("link", "set", f"h{host}", "up" if up else "down", netns=self.switch)

    def set_rate(self, host: int, rate: str | None = None) -> None:
        """Limit host ``host``'s link to ``rate`` in each direction (a tc rate
        such as ``100mbit``; None: the cluster's own rate again)."""
        tbf = self._tbf(parse_rate(rate) if rate is not None else self.bytes_per_second)
        _tc(self.namespaces[host], "qdisc", "change", "dev", "eth0", *tbf)
        _tc(self.switch, "qdisc", "change", "dev", f"h{host}", *tbf)

    # -- processes -----------------------------------------------------------
    def popen(
        self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``host``, in a process group of its own,
        with the environment plus ``env``. The cluster kills it at close."""
        full_env = {**os.environ, **RAY_ENV, **(env or {})}
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[host], *argv],
            env=full_env,
            start_new_session=True,
            **kwargs,
        )
        self._procs.append(proc)
        return proc

    def start_ray(self, cpus: int = 4, object_store_mib: int = 1024, timeout: float = 180.0) -> str:
        """Start a Ray node on every host (the head on host 0) and return the
        head's address, once every node has joined. Each node has the custom
        resource ``host<i>`` (for placing actors on host ``i``)."""
        self._tmp = tempfile.mkdtemp(prefix=self.switch, dir="/tmp")
        head = f"{self.addresses[0]}:{RAY_PORT}"
        self._ray_node_options = (cpus, object_store_mib)
        for i in range(self.hosts):
            self.start_ray_node(i, head)
            if i == 0:
                self._wait_head(head, timeout)
        self.ray_address = head
        self._wait_nodes(timeout)
        return head

    def start_ray_node(self, host: int, head: str | None = None) -> subprocess.Popen[Any]:
        """Start host ``host``'s Ray node (``ray start --block``: its process
        ends when the node does), joining the head at ``head`` (default:
        the cluster's, after :meth:`start_ray`; the head itself on host 0).
        Never waits for it to join. Also restarts a node that was killed."""
        assert self._tmp is not None, "start_ray() comes first"
        cpus, object_store_mib = self._ray_node_options
        head = head or self.ray_address
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        argv = [
            ray_bin, "start", "--block", "--disable-usage-stats",
            f"--node-ip-address={self.addresses[host]}",
            f"--num-cpus={cpus}", f"--resources={{\"host{host}\": 1000}}",
            f"--object-store-memory={object_store_mib * 1024 * 1024}",
            f"--temp-dir={self._tmp}/h{host}",
        ]  # fmt: skip
        if host == 0:
            argv += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={head}"]
        with open(os.path.join(self._tmp, f"ray-h{host}.log"), "ab") as log:
            node = self.popen(host, argv, stdout=log, stderr=subprocess.STDOUT)
        self.ray_nodes[host] = node
        return node

    def run_python(self, host: int, code: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``python -c code`` on host ``host`` and wait for it."""
        proc = self.popen(host, [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def _wait_head(self, head: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        code = f"import socket; socket.create_connection(({self.addresses[0]!r}, {RAY_PORT}), 1).close()"
        while time.monotonic() < deadline:
            if self.run_python(0, code, timeout=10).returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Ray head did not start within {timeout} s; see {self._tmp}/ray-h0.log")

    def _wait_nodes(self, timeout: float) -> None:
        code = (
            "import ray, time\n"
            # (The nodes' logs stay out of this driver's output, which is parsed.)
            f"ray.init(address={self.ray_address!r}, logging_level='ERROR', log_to_driver=False)\n"
            f"deadline = time.monotonic() + {timeout}\n"
            f"while sum(n['Alive'] for n in ray.nodes()) < {self.hosts} and time.monotonic() < deadline:\n"
            "    time.sleep(0.5)\n"
            "print('alive', sum(n['Alive'] for n in ray.nodes()))\n"
        )
        done = self.run_python(0, code, timeout=timeout + 30)
        said = [line.split()[1] for line in (done.stdout or "").splitlines() if line.startswith("alive ")]
        alive = said[-1:]
        if not alive or int(alive[0]) < self.hosts:
            raise RuntimeError(
                f"only {alive} of {self.hosts} Ray nodes joined within {timeout} s: {done.stderr[-2000:]}"
            )

    def host_pids(self, host: int) -> list[int]:
        """The pids of every process of host ``host`` now (in its namespace:
        its Ray node and the workers it started, whatever their process
        group); [] once the cluster closed."""
        return _pids_in(self.namespaces[host])

    def namespaces_left(self) -> list[str]:
        """The namespaces of this cluster (its hosts' and its switch's) that
        exist on the machine now: none before :meth:`start`, none after
        :meth:`close`."""
        mine = {*self.namespaces, self.switch}
        return [name for name in _namespaces() if name in mine]

    def kill_host(self, host: int, sig: int = signal.SIGKILL) -> None:
        """Signal every process of host ``host`` (its Ray node, its actors):
        SIGKILL for a host that dies, SIGSTOP for one that hangs, SIGCONT to
        resume it."""
        _kill_all_in(self.namespaces[host], sig)

    def close(self) -> None:
        """Kill every process of the cluster's hosts and remove its
        namespaces. Idempotent. A Ctrl-C while it runs (a second one, as a
        terminal sends to the whole process group) waits until it is done,
        then is raised: a cut-short close would leave namespaces behind."""
        with _ctrl_c_held():
            self._close()

    def _close(self) -> None:
        for ns in self._made:
            _kill_all_in(ns, signal.SIGCONT)  # a stopped process takes SIGKILL anyway; its children too
            _kill_all_in(ns)
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._procs = []
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
