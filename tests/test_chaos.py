"""Chaos: back-to-back sends to 4 workers while a seeded chaos thread
SIGKILLs, SIGSTOPs and SIGCONTs them at random moments, over every scheme.

The main thread sends back to back, each send with a short deadline ``T``
drawn from :data:`TIMEOUTS`. A background thread, driven by its own
``random.Random`` seeded from :data:`SEED`, stops workers (SIGSTOP) for a
random while (shorter than, around, or longer than a deadline), resumes them
(SIGCONT), and kills (SIGKILL) one or two of the four at random moments.
Every signal goes through a pidfd, so it can only reach the worker it names.
Each action is logged with its time, and the log is part of every assertion
message (and printed), so a failure can be replayed with
``WEIGHTSYNC_CHAOS_SEED=<seed> pytest tests/test_chaos.py`` (the thread
timings differ from run to run; the seed fixes what the chaos does and when
it means to).

Per worker the test keeps a :class:`Timeline` of two kinds of intervals:

- *possibly unable*: from the moment a SIGSTOP or SIGKILL was issued until
  the SIGCONT call returned (forever for a kill);
- *surely unable*: from the moment every thread of the worker was seen
  stopped (state ``T`` in ``/proc``), or its pidfd reported its exit, until
  the SIGCONT was issued (forever for a kill).

The rule checked after each send, which started at ``t0`` (just before
``send()``) and returned or raised at ``t1``, with deadline ``T``:

1. ``t1 - t0 < T + 1 s``: the trainer never hangs past the deadline plus a second.
2. The send returned a report naming all four workers, or raised a
   ``WorkerError`` whose ``worker_ids`` are exactly the keys of its
   ``failures``, each a ``WorkerLostError`` or an ``AckTimeoutError``. Call
   its ``worker_ids`` the *named* workers (none when it returned).
3. Superset: every worker that was surely unable throughout ``[t0, t1]``
   (dead, stopped, or stopped then killed) is named; one already dead at
   ``t0`` as ``WorkerLostError``.
4. Subset: a named worker was possibly unable at some moment of ``[t0, t1]``.
5. ``WorkerLostError`` only for a worker whose SIGKILL was issued before
   ``t1`` (a stopped worker is not lost), with ``exit_signal`` SIGKILL when
   the sender could tell.
6. ``AckTimeoutError`` only once the deadline passed (``t1 - t0 >= T``), and
   only for a worker that was not dead at ``t0`` and had no window of
   :data:`GRACE` seconds or more, inside ``[t0, min(t0 + T, t1)]``, in which
   it was surely alive and running: a worker stopped and resumed well before
   the deadline must ack in time and must not be named. Under a scheme that
   forwards the bytes from worker to worker (DistributedWeightSyncScheme's
   chain and host leaders), a worker is also excused, in rules 4 and 6, when
   a worker ahead of it on that send's chains was possibly unable during
   the send: it waits for it up to the chain's stall limit (at least a
   second), and the repair chain around it may not fit in what is left of
   a deadline of about a second.
7. Every worker that is not named and is alive and running when the test
   looks (the chaos thread is paused meanwhile) holds that send's version bit
   for bit, in the same tensor objects (same ``data_ptr()`` where the scheme
   keeps it), its last applied version is that one, and it saw no error. This
   covers every worker alive and running at the start and the end of the
   send, except one named for being stopped past the deadline and resumed
   before the send returned.

At the end every worker is resumed, and :data:`AFTER_SENDS` + 1 more sends
with a long deadline must each name exactly the killed workers
(``WorkerLostError``) while every other one gets it bit for bit; for the pipe
schemes the last :data:`AFTER_SENDS` of them must not grow the trainer's
descriptors (a dead worker must not pin staging memory send after send).
After the cluster is closed nothing is left: no weightsync
thread, no killed process, and for the pipe schemes no new descriptor, no
child process and no ``/dev/shm`` entry; for Ray every surviving actor was
torn down cleanly and went back to the pool.

The default run has :data:`SHORT_SECONDS` of chaos per scheme; ``pytest -m
slow`` runs :data:`LONG_SECONDS`.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import random
import select
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from harness import (
    Cluster,
    RayCluster,
    fd_baseline,
    new_cluster,
    open_fds,
    schemes,
    shm_entries,
    spec,
    weightsync_threads,
)

import weightsync as ws

SEED = int(os.environ.get("WEIGHTSYNC_CHAOS_SEED", "20240611"))
WORKERS = 4
SHORT_SECONDS = 2.0
LONG_SECONDS = 60.0
#: Deadlines of the sends, drawn uniformly.
TIMEOUTS = (0.75, 1.5)
#: How far past its deadline a send may return.
HANG_SLACK = 1.0
#: A worker alive and running this long before the deadline must ack in time.
GRACE = 0.5
#: At most this many of the four workers are killed, so sends keep going.
MAX_KILLS = 2
#: At most this many workers are stopped at once.
MAX_STOPPED = 3
#: Mean seconds between two random chaos actions.
MEAN_GAP = 0.2
#: How long a stopped worker stays stopped: (weight, low, high) seconds.
HOLDS = ((5, 0.001, 0.05), (3, 0.05, TIMEOUTS[1]), (2, TIMEOUTS[1], 2.5 * TIMEOUTS[1]))
#: Sends after the chaos, which must grow no descriptor in the trainer.
AFTER_SENDS = 10
#: How long the chaos thread waits for a signal to take effect.
SIGNAL_EFFECT_TIMEOUT = 10.0
INF = math.inf


# -- the timeline of one worker -------------------------------------------------


@dataclass
class Stop:
    """One SIGSTOP of a worker and the SIGCONT that ended it (inf: not yet)."""

    issued: float  # before the SIGSTOP was sent
    effective: float  # once every thread of the worker was seen stopped
    resume_issued: float = INF  # before the SIGCONT was sent
    resumed: float = INF  # once the SIGCONT call returned (the kernel wakes it in that call)


@dataclass
class Timeline:
    """What the chaos did to one worker, in ``time.monotonic()`` seconds."""

    worker: int
    pid: int
    pidfd: int
    stops: list[Stop] = field(default_factory=list)
    kill_issued: float = INF  # before the SIGKILL was sent
    killed: float = INF  # once its pidfd reported the exit

    @property
    def alive(self) -> bool:
        return self.kill_issued == INF

    @property
    def stopped(self) -> bool:
        return bool(self.stops) and self.stops[-1].resumed == INF

    @property
    def running(self) -> bool:
        """Alive and not stopped now (only stable while the chaos is paused)."""
        return self.alive and not self.stopped

    def _possible(self) -> list[tuple[float, float]]:
        """Intervals in which the worker may have been unable to ack."""
        spans = [(s.issued, s.resumed) for s in self.stops]
        if self.kill_issued < INF:
            spans.append((self.kill_issued, INF))
        return spans

    def _sure(self) -> list[tuple[float, float]]:
        """Intervals in which the worker was certainly unable to ack."""
        spans = [(s.effective, s.resume_issued) for s in self.stops if s.effective < s.resume_issued]
        if self.killed < INF:
            spans.append((self.killed, INF))
        return spans

    def possibly_unable(self, a: float, b: float) -> bool:
        """Whether the worker may have been stopped or dead at some moment of [a, b]."""
        return any(lo <= b and hi >= a for lo, hi in self._possible())

    def surely_unable_throughout(self, a: float, b: float) -> bool:
        """Whether the worker was certainly stopped or dead at every moment of [a, b]."""
        reached = a
        for lo, hi in sorted(self._sure()):
            if lo > reached:
                break
            reached = max(reached, hi)
            if reached >= b:
                return True
        return False

    def longest_able(self, a: float, b: float) -> float:
        """The longest stretch of [a, b] in which the worker was surely alive and running."""
        longest, cursor = 0.0, a
        for lo, hi in sorted(self._possible()):
            if hi < cursor:
                continue
            longest = max(longest, min(lo, b) - cursor)
            cursor = max(cursor, hi)
            if cursor >= b:
                break
        return max(longest, b - cursor)


# -- the log ------------------------------------------------------------------------


class ChaosLog:
    """Every chaos action and every send, timed from the start; failures
    carry the seed and the log."""

    def __init__(self, scheme: str, seed: int) -> None:
        self.scheme = scheme
        self.seed = seed
        self.origin = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def at(self, t: float) -> str:
        return f"{t - self.origin:8.3f}s"

    def add(self, text: str, t: float | None = None) -> None:
        with self._lock:
            t = time.monotonic() if t is None else t
            self.lines.append((t, f"{self.at(t)}  {text}"))

    def text(self) -> str:
        with self._lock:
            lines = [line for _, line in sorted(self.lines)]
        if len(lines) > 400:  # a long run: the first lines and the newest ones
            lines = [*lines[:50], f"   ... {len(lines) - 350} lines left out ...", *lines[-300:]]
        return "\n".join(lines)

    def fail(self, message: str) -> AssertionError:
        full = (
            f"[{self.scheme}] {message}\n"
            f"replay with WEIGHTSYNC_CHAOS_SEED={self.seed}; chaos log:\n{self.text()}"
        )
        print(full)
        return AssertionError(full)


# -- signals ---------------------------------------------------------------------------


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is in the stopped state."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # a thread that just ended
        if state not in (b"T", b"t"):
            return False
    return True


def _exited(pidfd: int, timeout: float = 0.0) -> bool:
    return bool(select.select([pidfd], [], [], timeout)[0])


class Chaos(threading.Thread):
    """The chaos thread. Each action runs under :attr:`lock`, which the main
    thread holds while it judges a send and looks at the workers, so the
    workers neither change state nor get signals meanwhile."""

    def __init__(
        self, c: Cluster, timelines: list[Timeline], rng: random.Random, log: ChaosLog, seconds: float
    ) -> None:
        super().__init__(name="chaos", daemon=True)
        self.c = c
        self.timelines = timelines
        self.rng = rng
        self.log = log
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._resume_at: dict[int, float] = {}
        start = time.monotonic()
        kills = rng.choice([1, 2, 2])
        self._kill_at = sorted(start + rng.uniform(0.1, 0.9) * seconds for _ in range(kills))
        self.log.add(f"chaos plans {kills} kill(s) at " + ", ".join(self.log.at(t) for t in self._kill_at))

    # -- actions (the caller holds the lock) --
    def _signal(self, tl: Timeline, sig: signal.Signals) -> None:
        signal.pidfd_send_signal(tl.pidfd, sig)

    def stop(self, tl: Timeline, hold: float) -> None:
        issued = time.monotonic()
        self._signal(tl, signal.SIGSTOP)
        end = issued + SIGNAL_EFFECT_TIMEOUT
        while not _all_threads_stopped(tl.pid):
            if time.monotonic() > end:
                raise self.log.fail(f"worker {tl.worker} (pid {tl.pid}) did not stop after SIGSTOP")
            time.sleep(0.0005)
        effective = time.monotonic()
        tl.stops.append(Stop(issued, effective))
        self._resume_at[tl.worker] = issued + hold
        self.log.add(
            f"SIGSTOP worker {tl.worker} for {hold:.3f}s (stopped after {effective - issued:.4f}s)", issued
        )

    def resume(self, tl: Timeline, why: str) -> None:
        stop = tl.stops[-1]
        stop.resume_issued = time.monotonic()
        self._signal(tl, signal.SIGCONT)
        stop.resumed = time.monotonic()
        self._resume_at.pop(tl.worker, None)
        self.log.add(
            f"SIGCONT worker {tl.worker} ({why}; stopped {stop.resume_issued - stop.issued:.3f}s)",
            stop.resume_issued,
        )

    def kill(self, tl: Timeline) -> None:
        tl.kill_issued = time.monotonic()
        was_stopped = tl.stopped
        self._signal(tl, signal.SIGKILL)
        if not _exited(tl.pidfd, SIGNAL_EFFECT_TIMEOUT):
            raise self.log.fail(f"worker {tl.worker} (pid {tl.pid}) did not exit after SIGKILL")
        tl.killed = time.monotonic()
        self._resume_at.pop(tl.worker, None)
        if isinstance(self.c, RayCluster):
            self.c.dead.add(tl.worker)  # RayCluster.close must not tear it down
        self.log.add(
            f"SIGKILL worker {tl.worker}{' (stopped)' if was_stopped else ''} "
            f"(exited after {tl.killed - tl.kill_issued:.4f}s)",
            tl.kill_issued,
        )

    def resume_all(self, why: str) -> None:
        for tl in self.timelines:
            if tl.alive and tl.stopped:
                self.resume(tl, why)

    def _random_action(self) -> None:
        rng = self.rng
        running = [tl for tl in self.timelines if tl.running]
        stopped = [tl for tl in self.timelines if tl.alive and tl.stopped]
        if rng.random() < 0.75:
            if running and len(stopped) < MAX_STOPPED:
                weights = [w for w, _, _ in HOLDS]
                _, low, high = rng.choices(HOLDS, weights=weights)[0]
                self.stop(rng.choice(running), rng.uniform(low, high))
        elif stopped:
            self.resume(rng.choice(stopped), "early")

    def _step(self) -> None:
        now = time.monotonic()
        for tl in self.timelines:
            at = self._resume_at.get(tl.worker)
            if at is not None and at <= now and tl.alive:
                self.resume(tl, "its hold ended")
        while self._kill_at and self._kill_at[0] <= now:
            self._kill_at.pop(0)
            alive = [tl for tl in self.timelines if tl.alive]
            if sum(not tl.alive for tl in self.timelines) < MAX_KILLS and alive:
                self.kill(self.rng.choice(alive))

    def run(self) -> None:
        try:
            next_action = time.monotonic() + self.rng.expovariate(1 / MEAN_GAP)
            while not self._halt.is_set():
                due = [next_action, *self._resume_at.values(), *self._kill_at[:1]]
                if self._halt.wait(max(0.0, min(due) - time.monotonic())):
                    break
                with self.lock:
                    self._step()
                    if time.monotonic() >= next_action:
                        self._random_action()
                        next_action = time.monotonic() + self.rng.expovariate(1 / MEAN_GAP)
        except BaseException as exc:
            self.error = exc

    def halt(self) -> None:
        self._halt.set()
        self.join(30)
        assert not self.is_alive(), "the chaos thread did not end"

    def check(self) -> None:
        if self.error is not None:
            raise self.log.fail(f"the chaos thread failed: {self.error!r}") from self.error


# -- judging a send ----------------------------------------------------------------


def upstream_of(c: Cluster) -> dict[int, set[int]]:
    """For each worker, the workers ahead of it on the chains of the last
    send (the workers it was fed through), under a scheme that has chains."""
    ahead: dict[int, set[int]] = {}
    for chain, fed in getattr(c.scheme, "last_routes", []):
        for pos, rank in enumerate(chain):
            ahead.setdefault(rank - 1, set()).update(r - 1 for r in chain[:pos])
            for follower in fed.get(rank, ()):
                ahead.setdefault(follower - 1, set()).update(r - 1 for r in chain[: pos + 1])
    return ahead


def judge(
    timelines: list[Timeline],
    t0: float,
    t1: float,
    timeout: float,
    error: ws.WorkerError | None,
    ahead: dict[int, set[int]] | None = None,
) -> list[str]:
    """What is wrong with one send (empty: nothing), by rules 1-6 of the
    module docstring; ``ahead``: :func:`upstream_of` the send."""
    problems = []
    ahead = ahead or {}
    elapsed = t1 - t0
    if elapsed >= timeout + HANG_SLACK:
        problems.append(f"the send took {elapsed:.3f}s, past its deadline {timeout:.3f}s + {HANG_SLACK}s")
    failures: dict[int, Any] = {} if error is None else dict(error.failures)
    if error is not None and (not error.worker_ids or set(error.worker_ids) != set(failures)):
        problems.append(f"worker_ids {error.worker_ids} do not match failures {sorted(failures)}")
    deadline = min(t0 + timeout, t1)
    for tl in timelines:
        i, failure = tl.worker, failures.get(tl.worker)
        if failure is None:
            if tl.surely_unable_throughout(t0, t1):
                problems.append(f"worker {i} was dead or stopped throughout the send, and is not named")
            continue
        fed_through_unable = isinstance(failure, ws.AckTimeoutError) and any(
            timelines[j].possibly_unable(t0, t1) for j in ahead.get(i, ())
        )
        if fed_through_unable:
            continue
        if not tl.possibly_unable(t0, t1):
            problems.append(
                f"worker {i} was alive and running throughout the send, and is named: {failure!r}"
            )
        elif isinstance(failure, ws.WorkerLostError):
            if tl.kill_issued > t1:
                problems.append(f"worker {i} was never killed, and is reported lost: {failure!r}")
            elif failure.exit_signal not in (None, signal.SIGKILL):
                problems.append(f"worker {i} was killed by SIGKILL, the sender says: {failure!r}")
        elif isinstance(failure, ws.AckTimeoutError):
            if tl.killed <= t0:
                problems.append(f"worker {i} was dead before the send began, and is reported as a timeout")
            if elapsed < timeout:
                problems.append(
                    f"worker {i} timed out after {elapsed:.3f}s, before its deadline {timeout:.3f}s"
                )
            able = tl.longest_able(t0, deadline)
            if able >= GRACE:
                problems.append(
                    f"worker {i} was alive and running for {able:.3f}s before the deadline, and is named: "
                    f"{failure!r}"
                )
        else:
            problems.append(f"worker {i} failed in an unexpected way: {failure!r}")
    return problems


def describe_send(version: int, timeout: float, t0: float, t1: float, error: ws.WorkerError | None) -> str:
    if error is None:
        outcome = "ok"
    else:
        outcome = (
            ", ".join(f"{i}: {type(e).__name__}" for i, e in sorted(error.failures.items()))
            or f"{type(error).__name__} naming nobody"
        )
    return f"send v{version} T={timeout:.3f}s took {t1 - t0:.3f}s -> {outcome}"


def states(c: Cluster, ids: list[int]) -> dict[int, dict[str, Any]]:
    """The ``state`` of several workers, asked of all of them at once (a
    worker answers between two of its ``receive()`` calls, so asking one
    after the other would cost a poll period each)."""
    if isinstance(c, RayCluster):
        import ray

        return dict(zip(ids, ray.get([c._ctrl(i, "state") for i in ids], timeout=30), strict=True))
    for i in ids:
        c.ctrls[i].send("state")
    replies = {}
    for i in ids:
        if not c.ctrls[i].poll(30):
            raise TimeoutError(f"worker {i} did not answer 'state'")
        replies[i] = c.ctrls[i].recv()
    return replies


def check_worker(
    c: Cluster, i: int, state: dict[str, Any], expected: dict[str, Any], version: int
) -> str | None:
    """Why worker ``i``, whose ``state`` this is, does not hold ``version``
    exactly (None: it does). The checks of ``Cluster.assert_has``, plus its
    applied versions and errors."""
    if not state["same_identity"]:
        return f"worker {i}: a tensor of its model was replaced"
    if spec(c.scheme_name).keeps_data_ptr and not state["same_ptr"]:
        return f"worker {i}: a tensor's data_ptr() changed"
    got = state["weights"]
    if set(got) != set(expected):
        return f"worker {i} has tensors {sorted(got)}, expected {sorted(expected)}"
    differ = [name for name, value in expected.items() if not torch.equal(got[name], value)]
    if differ:
        return f"worker {i} does not hold version {version}: {differ} differ"
    if not state["applied"] or state["applied"][-1] != version:
        return f"worker {i} last applied {state['applied'][-5:]}, not version {version}"
    if state["errors"]:
        return f"worker {i} saw errors: {state['errors']}"
    return None


def check_workers(c: Cluster, ids: list[int], expected: dict[str, Any], version: int) -> list[str]:
    replies = states(c, ids)
    return [why for i in ids if (why := check_worker(c, i, replies[i], expected, version))]


# -- the test ----------------------------------------------------------------------------


def _wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _close_pidfds(timelines: list[Timeline]) -> None:
    for tl in timelines:
        if tl.pidfd >= 0:
            os.close(tl.pidfd)
            tl.pidfd = -1


def _send(c: Cluster, timeout: float) -> tuple[float, float, Any, ws.WorkerError | None]:
    """One send: (start, end, report or None, error or None)."""
    t0 = time.monotonic()
    try:
        report = c.sender.send(timeout=timeout)
    except ws.WorkerError as exc:
        return t0, time.monotonic(), None, exc
    return t0, time.monotonic(), report, None


def run_chaos(request: pytest.FixtureRequest, scheme_name: str, seconds: float) -> None:
    """Send back to back to 4 workers for ``seconds`` of chaos, judging each
    send (rules 1-7 of the module docstring); then the sends after the chaos
    and the check that nothing is left behind."""
    seed = SEED
    log = ChaosLog(scheme_name, seed)
    rng = random.Random(f"{seed}-{scheme_name}")
    chaos_rng, send_rng = random.Random(rng.getrandbits(64)), random.Random(rng.getrandbits(64))
    pipes = not spec(scheme_name).actors  # its workers are the test's own processes
    shm_before, fds_before = (shm_entries(), fd_baseline()) if pipes else (set(), set())
    c = new_cluster(request, scheme_name, ["net"] * WORKERS)
    closed = False
    timelines = [Timeline(i, pid, os.pidfd_open(pid)) for i, pid in enumerate(c.pids)]
    chaos: Chaos | None = None
    try:
        log.add(f"seed {seed}, scheme {scheme_name}, workers' pids {c.pids}")
        c.sender.send(timeout=60)  # every worker connected and on version 1
        version = c.sender.async_sender.version
        chaos = Chaos(c, timelines, chaos_rng, log, seconds)
        chaos.start()
        sends = failed = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            c.bump()
            expected = c.expected()
            timeout = send_rng.uniform(*TIMEOUTS)
            t0, t1, report, error = _send(c, timeout)
            version += 1
            sends += 1
            failed += error is not None
            with chaos.lock:
                chaos.check()
                log.add(describe_send(version, timeout, t0, t1, error), t0)
                problems = judge(timelines, t0, t1, timeout, error, upstream_of(c))
                # The version is read from the sender: an error naming a
                # single lost worker carries none of its own.
                got = c.sender.async_sender.version if report is None else report.version
                if got != version:
                    problems.append(f"the send was version {got}, expected {version}")
                if report is not None and report.worker_ids != tuple(range(WORKERS)):
                    problems.append(f"the report names workers {report.worker_ids}")
                named = set(error.worker_ids) if error is not None else set()
                look = [tl.worker for tl in timelines if tl.worker not in named and tl.running]
                problems += check_workers(c, look, expected, version)
                if problems:
                    raise log.fail("; ".join(problems))
        chaos.halt()
        chaos.check()
        with chaos.lock:
            chaos.resume_all("the chaos ended")
        log.add(f"chaos over: {sends} sends, {failed} of them failed")
        print(f"\n{scheme_name}: {sends} sends under chaos, {failed} failed; seed {seed}\n{log.text()}")

        # Every survivor catches up; the dead are named, and only they. Then
        # more sends to all four grow no descriptor in the trainer: a dead
        # worker must not pin memory send after send.
        alive = [tl.worker for tl in timelines if tl.alive]
        dead = {tl.worker for tl in timelines if not tl.alive}
        fds_steady = 0
        for n in range(1 + AFTER_SENDS):
            if n == 1:
                fds_steady = len(open_fds())
            c.bump()
            expected = c.expected()
            t0, t1, report, error = _send(c, 60)
            version += 1
            log.add("after the chaos: " + describe_send(version, 60, t0, t1, error), t0)
            failures = {} if error is None else error.failures
            if set(failures) != dead or not all(isinstance(e, ws.WorkerLostError) for e in failures.values()):
                raise log.fail(
                    f"after the chaos a send should name the dead workers {sorted(dead)}: {error!r}"
                )
            problems = check_workers(c, alive, expected, version)
            if problems:
                raise log.fail("after the chaos: " + "; ".join(problems))
        grown = len(open_fds()) - fds_steady
        if pipes and grown > 0:
            raise log.fail(
                f"{AFTER_SENDS} sends after the chaos, with workers {sorted(dead)} dead, grew the trainer's "
                f"descriptors by {grown}"
            )

        c.close()
        closed = True
        _close_pidfds(timelines)
        leftovers = []
        if not _wait_for(lambda: not weightsync_threads()):
            leftovers.append(f"weightsync threads {weightsync_threads()}")
        for tl in timelines:
            if not tl.alive and os.path.exists(f"/proc/{tl.pid}"):
                with open(f"/proc/{tl.pid}/stat") as stat:
                    leftovers.append(f"killed worker {tl.worker} still there: {stat.read()}")
        if pipes:
            if not _wait_for(lambda: not any(os.path.exists(f"/proc/{tl.pid}") for tl in timelines)):
                leftovers.append("a worker process is still there")
            if mp.active_children():
                leftovers.append(f"child processes {mp.active_children()}")
            if not shm_entries() <= shm_before:
                leftovers.append(f"/dev/shm entries {shm_entries() - shm_before}")
            if not _wait_for(lambda: open_fds() <= fds_before):
                leftovers.append(f"descriptors {sorted(open_fds() - fds_before)}")
        else:
            assert isinstance(c, RayCluster)
            idle = c.runtime.idle
            for tl in timelines:
                if tl.alive and not any(a is c.actors[tl.worker] for a in idle):
                    leftovers.append(f"actor {tl.worker} was not torn down cleanly")
            # Actors that were stopped and resumed are not handed to the next
            # test: Ray may have grown threads in them meanwhile, which a
            # later leak check would count against weightsync.
            import ray

            for actor in c.actors:
                if any(a is actor for a in idle):
                    idle.remove(actor)
                    ray.kill(actor)
        if leftovers:
            raise log.fail("left behind: " + "; ".join(leftovers))
    finally:
        if chaos is not None and chaos.is_alive():
            chaos.halt()
        if not closed:
            for tl in timelines:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(tl.pidfd, signal.SIGCONT)
            c.close()
        _close_pidfds(timelines)


# Every scheme whose workers can be stopped and killed. Chaos over Ray
# (about 20 s: its killed actors are replaced by new ones, which import
# torch) runs with -m extended, a CI step of its own.
CHAOS_SCHEMES = schemes(processes=True, extended=("ray", "shared"))


@pytest.mark.parametrize("scheme_name", CHAOS_SCHEMES)
def test_sends_under_chaos(request: pytest.FixtureRequest, scheme_name: str) -> None:
    run_chaos(request, scheme_name, SHORT_SECONDS)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scheme_name", CHAOS_SCHEMES)
def test_sends_under_long_chaos(request: pytest.FixtureRequest, scheme_name: str) -> None:
    run_chaos(request, scheme_name, LONG_SECONDS)
