"""Errors a new user meets first say what to do: an empty worker list, a
worker of another dtype or shape, workers never heard of, a missing extra.
Each test reads the text the user would read."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from harness import PROCS, Cluster, make_scheme, new_cluster, reap, schemes
from harness.workers import build_model, late_worker, worker_main

import weightsync as ws


@pytest.mark.parametrize("scheme_name", schemes(pipes=True))
def test_an_empty_list_of_pipes_is_refused_at_init_on_sender(scheme_name: str) -> None:
    scheme = make_scheme(scheme_name)
    try:
        with pytest.raises(ValueError, match=r"got no workers \(pipes=\[\]\).*one pipe per worker") as info:
            scheme.init_on_sender("policy", pipes=[], model=build_model("net"))
        assert "num_workers=N (N >= 1)" in str(info.value)
        with pytest.raises(RuntimeError):
            scheme.get_sender()  # nothing was made
    finally:
        scheme.shutdown()


@pytest.mark.parametrize("scheme_name", ["inprocess", "distributed"])
def test_no_workers_is_refused_where_the_scheme_takes_a_number(scheme_name: str) -> None:
    scheme = make_scheme(scheme_name)
    try:
        with pytest.raises(ValueError, match=r"needs num_workers=N \(N >= 1\)"):
            scheme.init_on_sender("policy", num_workers=0, model=build_model("net"))
    finally:
        scheme.shutdown()


def test_an_empty_list_of_actors_is_refused_at_init_on_sender() -> None:
    pytest.importorskip("ray")
    scheme = ws.RayWeightSyncScheme()
    with pytest.raises(ValueError, match=r"remote_collectors=\[actor, \.\.\.\], one actor handle per worker"):
        scheme.init_on_sender("policy", remote_collectors=[], model=build_model("net"))


def test_a_bfloat16_worker_of_a_float32_trainer_is_told_of_wire_dtype(request: pytest.FixtureRequest) -> None:
    c: Cluster = new_cluster(request, "multiprocess", ["bf16"])
    try:
        with pytest.raises(ws.WeightMismatchError) as info:
            c.sender.send()
        message = str(info.value)
        assert "inp.weight: trainer (16, 8) float32 vs worker (16, 8) bfloat16" in message
        assert "Worker 0 holds bfloat16 where the trainer has float32" in message
        assert "wire_dtype=torch.bfloat16" in message
        assert info.value.worker_ids == (0,)
    finally:
        c.close()
    # What the message says fixes it.
    c = new_cluster(request, "multiprocess", ["bf16"], wire_dtype=torch.bfloat16)
    try:
        report = c.sender.send()
        assert report is not None and report.worker_ids == (0,)
    finally:
        c.close()


def test_a_mismatch_names_every_worker_and_each_side(request: pytest.FixtureRequest) -> None:
    # Worker 0 fits; workers 1 and 3 are wider, worker 2 holds bfloat16.
    c: Cluster = new_cluster(request, "multiprocess", ["net", "wide", "bf16", "wide"])
    try:
        before = c.state(0)["weights"]
        c.bump()
        with pytest.raises(ws.WeightMismatchError) as info:
            c.sender.send()
        message = str(info.value)
        assert message.startswith("the trainer's weights do not match the models of 3 workers: ")
        assert "worker 1 and worker 3 (mismatched: " in message
        assert "inp.weight: trainer (16, 8) float32 vs worker (32, 8) float32" in message
        assert "worker 2 (mismatched: " in message
        assert "worker 0" not in message
        assert "Worker 2 holds bfloat16" in message
        assert info.value.worker_ids == (1, 2, 3)
        c.assert_has(0, before)  # refused before anything moved
    finally:
        c.close()


def test_workers_never_announced_are_told_the_likely_causes() -> None:
    """Worker 0 never calls init_on_worker (it sleeps first); worker 1 was
    given the trainer's end of its pipe, so its announcement never reaches
    the trainer."""
    scheme = make_scheme("multiprocess", timeout=1.0)
    procs, conns = [], []
    sleeping, its_end = PROCS.Pipe()
    ctrl0, ctrl0_child = PROCS.Pipe()
    procs.append(PROCS.Process(target=late_worker, args=(scheme, "policy", its_end, ctrl0_child, "net", 600)))
    wrong, kept = PROCS.Pipe()  # ``kept`` stays open here: no EOF, only silence
    ctrl1, ctrl1_child = PROCS.Pipe()
    procs.append(PROCS.Process(target=worker_main, args=(scheme, "policy", wrong, ctrl1_child, "net")))
    for proc in procs:
        proc.daemon = True
        proc.start()
    conns += [sleeping, its_end, ctrl0, ctrl0_child, wrong, kept, ctrl1, ctrl1_child]
    try:
        scheme.init_on_sender("policy", pipes=[sleeping, wrong], model=build_model("net"))
        for name, call in (("wait_for_workers", scheme.wait_for_workers), ("send", scheme.send)):
            with pytest.raises(ws.AckTimeoutError) as info:
                call()
            message = str(info.value)
            assert "worker 0" in message and "worker 1" in message
            what = "did not announce itself (start, then call init_on_worker() for this model)"
            assert message.count(what) == 2
            limit = (
                "wait_for_workers()'s timeout of 1 s"
                if name == "wait_for_workers"
                else ("send()'s timeout of 1 s")
            )
            assert message.count(f"within {limit}") == 2
            assert message.count("likely causes") == 1
            for cause in (
                "never calls it for this model",
                "started with 'spawn' or 'forkserver' failed to import its code",
                "its traceback is in that worker's stderr",
                "was given the trainer's end of its pipe",
            ):
                assert cause in message
    finally:
        for proc in procs:
            proc.kill()
        reap(procs)
        scheme.shutdown()
        for conn in conns:
            conn.close()


# Run in a fresh interpreter: None in sys.modules makes ``import <name>``
# raise ImportError, as if the package were not installed. weightsync's own
# import needs none of them.
_WITHOUT_EXTRAS = """
import json, sys
import torch
import weightsync as ws

def refused(hidden, call):
    sys.modules[hidden] = None
    try:
        call()
    except ws.MissingExtraError as exc:
        return {"message": str(exc), "extra": exc.extra, "name": exc.name,
                "import_error": isinstance(exc, ImportError)}
    finally:
        del sys.modules[hidden]
    return None

def ray_sender():
    scheme = ws.RayWeightSyncScheme()
    scheme.init_on_sender("policy", remote_collectors=[object()], model=torch.nn.Linear(2, 2))

def verify_at_send():
    import copy
    scheme = ws.InProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender("policy", model=torch.nn.Linear(2, 2), num_workers=1)
    worker = copy.copy(scheme)
    worker.init_on_worker("policy", model=torch.nn.Linear(2, 2), worker_idx=0)
    try:
        scheme.send(verify=True)
    finally:
        scheme.shutdown()
        worker.shutdown()

print(json.dumps({
    "delta": refused("blosc2", lambda: ws.DistributedWeightSyncScheme(delta=True)),
    "verify": refused("xxhash", lambda: ws.MultiProcessWeightSyncScheme(verify=True)),
    "verify at send": refused("xxhash", verify_at_send),
    "ray": refused("ray", ray_sender),
}))
"""


def test_a_missing_extra_is_an_import_error_that_names_it() -> None:
    run = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    for case, extra, module in (
        ("delta", "delta", "blosc2"),
        ("verify", "verify", "xxhash"),
        ("verify at send", "verify", "xxhash"),
        ("ray", "ray", "ray"),
    ):
        error = found[case]
        assert error is not None, f"{case}: no MissingExtraError"
        assert error["import_error"] and error["extra"] == extra and error["name"] == module
        assert f"pip install 'weightsync[{extra}]'" in error["message"]
        assert f"{module} cannot be imported" in error["message"]


# -- errors name only public things ----------------------------------------------------
def misuses() -> dict[str, Any]:
    """A user's mistakes, each a call that raises; run in one process, with
    an in-process trainer and one worker thread where one is needed."""
    import asyncio
    import copy

    def trainer(**options: Any) -> ws.InProcessWeightSyncScheme:
        scheme = ws.InProcessWeightSyncScheme(timeout=5, **options)
        scheme.init_on_sender("policy", model=build_model("net"), num_workers=1)
        return scheme

    def send_in_a_coroutine() -> None:
        scheme = trainer()

        async def train() -> None:
            scheme.send()

        try:
            asyncio.run(train())
        finally:
            scheme.shutdown()

    def with_a_worker(call: Any, worker_kind: str = "net") -> Any:
        def run() -> None:
            scheme = trainer()
            worker = copy.copy(scheme)
            worker.init_on_worker("policy", model=build_model(worker_kind), worker_idx=0)
            try:
                call(scheme)
            finally:
                worker.shutdown()
                scheme.shutdown()

        return run

    def shut(scheme: ws.WeightSyncScheme) -> None:
        scheme.shutdown()
        scheme.send()

    def pending_twice(scheme: ws.WeightSyncScheme) -> None:
        scheme.get_sender().send_async()
        scheme.get_sender().send_async()

    return {
        "delta on a pipe scheme": lambda: ws.MultiProcessWeightSyncScheme(delta=True),
        "delta on the shared scheme": lambda: ws.SharedMemWeightSyncScheme(delta=True),
        "an unknown option": lambda: ws.MultiProcessWeightSyncScheme(deltas=True),
        "pipes=[]": lambda: ws.MultiProcessWeightSyncScheme().init_on_sender(
            "policy", pipes=[], model=build_model("net")
        ),
        "num_workers=0": lambda: ws.InProcessWeightSyncScheme().init_on_sender(
            "policy", num_workers=0, model=build_model("net")
        ),
        "get_sender() before init": lambda: ws.MultiProcessWeightSyncScheme().get_sender(),
        "receive() before init": lambda: ws.MultiProcessWeightSyncScheme().receive(),
        "a bad strategy": lambda: ws.MultiProcessWeightSyncScheme(strategy="pickle"),  # type: ignore[arg-type]
        "a bad wire_dtype": lambda: ws.MultiProcessWeightSyncScheme(wire_dtype=torch.int8),
        "init_on_worker without a pipe": lambda: ws.MultiProcessWeightSyncScheme().init_on_worker(
            "policy", model=build_model("net")
        ),
        "send() in a coroutine": send_in_a_coroutine,
        "send() after shutdown()": with_a_worker(shut),
        "send_async() twice": with_a_worker(pending_twice),
        "wait_async() with nothing pending": with_a_worker(lambda s: s.get_sender().wait_async()),
        "an unknown worker id": with_a_worker(lambda s: s.send(worker_ids=[7])),
        "an empty worker list": with_a_worker(lambda s: s.send(worker_ids=[])),
        "weights keyed by worker": with_a_worker(lambda s: s.send({0: build_model("net")})),
        "a tensor the worker lacks": with_a_worker(lambda s: s.send({"nope": torch.zeros(2)}, partial=True)),
        "a worker of another shape": with_a_worker(lambda s: s.send(), worker_kind="wide"),
        "a worker of another dtype": with_a_worker(lambda s: s.send(), worker_kind="bf16"),
        "sparse weights": with_a_worker(
            lambda s: s.send({k: v.to_sparse() for k, v in build_model("net").state_dict().items()})
        ),
        "an unknown key": with_a_worker(lambda s: s.send(keys=["nope"])),
        "delta on a send": with_a_worker(lambda s: s.send(delta=True)),
        "an unknown send_async() option": with_a_worker(lambda s: s.get_sender().send_async(retries=3)),
    }


# A name that starts with "_" (a private class, module or attribute), at the
# start of a word or after a dot: "_PipeScheme", "self._worker_ends".
_PRIVATE_NAME = re.compile(r"(?<![A-Za-z0-9_])_[A-Za-z]\w*")


def test_no_error_for_a_users_mistake_names_a_private_thing() -> None:
    """Every misuse above raises, and its message (with the messages of the
    errors it carries) names only public things."""
    messages: dict[str, str] = {}
    for what, misuse in misuses().items():
        with pytest.raises(Exception) as info:
            misuse()
        error: BaseException | None = info.value
        text = []
        while error is not None:
            text.append(f"{type(error).__name__}: {error}")
            error = error.__cause__
        messages[what] = " <- ".join(text)
    private = {what: _PRIVATE_NAME.findall(m) for what, m in messages.items() if _PRIVATE_NAME.search(m)}
    assert not private, {what: (names, messages[what]) for what, names in private.items()}
    assert (
        "delta sends are for the cross-host schemes, RayWeightSyncScheme(delta=True) and "
        in (messages["delta on a pipe scheme"])
    )
    assert "BlockingCallError" in messages["send() in a coroutine"]
    # keys= lists what the weights hold; an unknown option, what a send takes.
    assert (
        "keys= names 'nope', which the weights of model 'policy' do not hold; they hold: "
        in (messages["an unknown key"])
    )
    assert "out.weight" in messages["an unknown key"]
    takes = "it takes weights, worker_ids, timeout, keys, partial, verify"
    assert f"send() got an unexpected keyword argument 'delta'; {takes}" in messages["delta on a send"]
    assert "DistributedWeightSyncScheme(delta=True)" in messages["delta on a send"]
    assert takes in messages["an unknown send_async() option"]


def test_errors_are_shown_by_their_public_names() -> None:
    """A traceback names ``weightsync.WorkerLostError``, not the private
    module that defines it; a pickled error comes back as the same class."""
    import pickle
    import traceback

    for name in ws.__all__:
        cls = getattr(ws, name)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            assert cls.__module__ == "weightsync", name
    try:
        raise ws.WeightMismatchError("weights do not match", model_id="policy")
    except ws.WeightMismatchError as exc:
        shown = "".join(traceback.format_exception(exc))
        again = pickle.loads(pickle.dumps(exc))
    assert "weightsync.WeightMismatchError: weights do not match" in shown, shown
    assert "_exceptions" not in shown
    assert type(again) is ws.WeightMismatchError
