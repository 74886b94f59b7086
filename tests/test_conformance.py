"""The conformance suite: every behaviour of a scheme, over every scheme.

Real worker processes, real pipes, real shared memory and a real Ray cluster;
and worker threads over the in-process scheme.
"""

from __future__ import annotations

import time

import pytest
import torch
from harness import Cluster, spec
from tensordict import TensorDict

import weightsync as ws


def test_send_reaches_every_worker_in_place(cluster: Cluster) -> None:
    cluster.bump()
    report = cluster.sender.send()
    assert report.worker_ids == (0, 1, 2)
    expected = cluster.expected()
    for i in range(3):
        cluster.assert_has(i, expected)
        assert cluster.state(i)["applied"][-1] == report.version


def test_workers_announce_their_device_and_the_report_says_how_each_was_reached(cluster: Cluster) -> None:
    """Each worker names the device its model is on when it says hello (the
    host here: a GPU would be named by its UUID, see tests/test_cuda.py),
    and every report says how the weights reached each worker."""
    cluster.sender.wait_for_workers()
    assert cluster.sender.worker_devices == {0: ("cpu",), 1: ("cpu",), 2: ("cpu",)}
    cluster.bump()
    report = cluster.sender.send()
    assert report.placements == {0: "host", 1: "host", 2: "host"}
    assert report.worker_bytes == dict.fromkeys((0, 1, 2), report.nbytes)
    report = cluster.sender.send(worker_ids=[1])
    assert report.placements == {1: "host"}
    assert report.worker_bytes == {1: report.nbytes}


def test_the_report_says_how_the_chains_carried_the_send(cluster: Cluster) -> None:
    """A chain's routes and wire bytes are the send's own, in its report
    (the scheme's last_* only repeat the last send's); a send with no
    chain says so with None."""
    cluster.bump()
    report = cluster.sender.send()
    if cluster.scheme_name != "distributed":
        assert report.chain is None  # (Ray: every actor on this one node, no relay)
        return
    chain = report.chain
    assert chain is not None
    assert [(tuple(c), dict(f)) for c, f in chain.routes] == [
        (tuple(c), dict(f)) for c, f in cluster.scheme.last_routes
    ]
    assert chain.wire_bytes == cluster.scheme.last_wire_bytes == sum(chain.sent)
    assert chain.delta == tuple(cluster.scheme.last_delta) and not any(chain.delta)
    # Every worker was reached, in a chain or fed on its host.
    reached = {m for members, _ in chain.routes for m in members}
    reached |= {w for _, fed in chain.routes for followers in fed.values() for w in followers}
    assert {1, 2, 3} <= reached, chain


def test_versions_increase_and_acks_match(cluster: Cluster) -> None:
    versions = []
    for _ in range(5):
        cluster.bump()
        versions.append(cluster.sender.send().version)
    assert versions == sorted(versions) and len(set(versions)) == 5
    for i in range(3):
        assert cluster.state(i)["applied"][-5:] == versions


def test_send_to_a_subset(cluster: Cluster) -> None:
    cluster.sender.send()
    before = cluster.expected()
    cluster.bump()
    report = cluster.sender.send(worker_ids=[1])
    assert report.worker_ids == (1,)
    cluster.assert_has(1, cluster.expected())
    cluster.assert_has(0, before)
    cluster.assert_has(2, before)
    cluster.sender.send(worker_ids=2)
    cluster.assert_has(2, cluster.expected())
    cluster.sender.send()


@pytest.mark.parametrize("form", ["module", "state_dict", "tensordict", "nested_dict"])
def test_every_weights_form(cluster: Cluster, form: str) -> None:
    cluster.bump()
    sd = {k: v.detach().clone() for k, v in cluster.model.state_dict().items()}
    weights = {
        "module": cluster.model,
        "state_dict": sd,
        "tensordict": TensorDict(sd, batch_size=[]).unflatten_keys("."),
        "nested_dict": TensorDict(sd, batch_size=[]).unflatten_keys(".").to_dict(),
    }[form]
    cluster.sender.send(weights)
    for i in range(3):
        cluster.assert_has(i, sd)


def test_unknown_worker_id_is_rejected_before_sending(cluster: Cluster) -> None:
    cluster.sender.send()
    before = cluster.expected()
    cluster.bump()
    with pytest.raises(ws.UnknownWorkerError, match="7") as info:
        cluster.sender.send(worker_ids=[0, 7])
    assert info.value.unknown_ids == (7,)
    for i in range(3):
        cluster.assert_has(i, before)


def test_a_send_rejected_before_anything_moved_uses_no_version(cluster: Cluster) -> None:
    version = cluster.sender.send().version
    bad = cluster.expected()
    bad["out.weight"] = torch.zeros(5, 16)
    with pytest.raises(ws.WeightMismatchError):
        cluster.sender.send(bad)
    with pytest.raises(ws.UnknownWorkerError):
        cluster.sender.send(worker_ids=[9])
    with pytest.raises(ws.InvalidWeightsError):
        cluster.sender.send({**cluster.expected(), "out.bias": 3})
    with pytest.raises(ValueError, match="no worker"):
        cluster.sender.send(worker_ids=[])
    cluster.bump()
    assert cluster.sender.send().version == version + 1
    for i in range(3):
        assert cluster.state(i)["applied"][-1] == version + 1
        cluster.assert_has(i, cluster.expected())


@pytest.mark.parametrize("defect", ["shape", "dtype", "missing", "extra"])
def test_mismatched_weights_touch_no_worker(cluster: Cluster, defect: str) -> None:
    cluster.sender.send()
    before = cluster.expected()
    bad = {k: v + 1 for k, v in before.items()}
    if defect == "shape":
        bad["out.weight"] = torch.zeros(5, 16)
    elif defect == "dtype":
        bad["out.weight"] = bad["out.weight"].double()
    elif defect == "missing":
        del bad["out.bias"]
    else:
        bad["extra.weight"] = torch.zeros(3)
    with pytest.raises(ws.WeightMismatchError) as info:
        cluster.sender.send(bad)
    assert "out." in str(info.value) or "extra.weight" in str(info.value)
    for i in range(3):
        cluster.assert_has(i, before)
    cluster.sender.send()  # the scheme is still usable


def test_invalid_values_are_rejected(cluster: Cluster) -> None:
    sd = cluster.expected()
    with pytest.raises(ws.InvalidWeightsError, match=r"out\.bias"):
        cluster.sender.send({**sd, "out.bias": [1.0, 2.0]})
    with pytest.raises(ws.InvalidWeightsError, match=r"sparse|layout"):
        cluster.sender.send({**sd, "out.bias": sd["out.bias"].to_sparse()})
    with pytest.raises(ws.InvalidWeightsError, match="meta"):
        cluster.sender.send({**sd, "out.bias": torch.empty(4, device="meta")})


def test_non_contiguous_and_grad_tensors_arrive_bit_exact(cluster: Cluster) -> None:
    sd = {k: v.detach().clone() for k, v in cluster.model.state_dict().items()}
    sd["inp.weight"] = torch.randn(8, 16).t()  # a transposed view
    sd["out.weight"] = torch.randn(4, 32)[:, ::2].requires_grad_()  # strided, needs grad
    cluster.sender.send(sd)
    for i in range(3):
        cluster.assert_has(i, {k: v.detach() for k, v in sd.items()})


def test_a_worker_with_another_model_is_rejected_before_sending(make_cluster) -> None:
    c = make_cluster(["net", "wide"])
    c.sender.send(worker_ids=[0])
    before = c.expected()
    c.bump()
    with pytest.raises(ws.WeightMismatchError, match="worker 1"):
        c.sender.send()
    c.assert_has(0, before)


def test_apply_failure_reaches_the_sender_with_the_workers_message(make_cluster) -> None:
    c = make_cluster(["net", "overlap"])
    before = c.state(1)["weights"]  # the refusing worker's whole model
    c.bump()
    sent = c.expected()
    # Every tensor sent differs from the worker's own: a write into any shows.
    assert [n for n in before if torch.equal(before[n], sent[n])] == []
    with pytest.raises(ws.WorkerApplyError) as info:
        c.sender.send()
    assert info.value.worker_ids == (1,)
    assert "overlap" in info.value.worker_message
    c.assert_has(0, sent)  # the healthy worker still got it
    after = c.state(1)
    assert after["same_identity"], "the refusing worker's tensors were replaced"
    if spec(c.scheme_name).keeps_data_ptr:
        assert after["same_ptr"], "the refusing worker's tensors were moved"
    assert set(after["weights"]) == set(before)
    written = [n for n, v in before.items() if not torch.equal(after["weights"][n], v)]
    assert written == [], f"the refusing worker's model was partly written: {written}"


def test_deadline_raises_a_timeout_naming_the_worker(make_cluster) -> None:
    c = make_cluster(["net", "net"], timeout=1.0)  # the scheme's own deadline: 1 s
    c.sender.send()
    c.pause(1)
    c.bump()
    started = time.monotonic()
    with pytest.raises(ws.AckTimeoutError) as info:
        c.sender.send()  # no timeout= given: the scheme's
    waited = time.monotonic() - started
    assert isinstance(info.value, TimeoutError)
    assert info.value.worker_ids == (1,)
    assert 0.9 <= waited < 5, f"a send with a 1 s deadline waited {waited:.2f} s"
    c.assert_has(0, c.expected())


def test_a_stale_ack_never_completes_a_newer_send(make_cluster) -> None:
    c = make_cluster(["net"])
    c.sender.send()
    c.pause(0)
    with pytest.raises(ws.AckTimeoutError):
        c.sender.send(timeout=0.5)
    stale = c.sender.async_sender.version
    c.resume(0)
    deadline = time.monotonic() + 10
    while stale not in c.state(0)["applied"]:  # the late ack of `stale` is now in the pipe
        assert time.monotonic() < deadline
        time.sleep(0.05)
    c.pause(0)
    with pytest.raises(ws.AckTimeoutError):
        c.sender.send(timeout=0.5)
    c.resume(0)
    c.bump()
    report = c.sender.send()
    assert c.state(0)["applied"][-1] == report.version
    c.assert_has(0, c.expected())


def test_a_killed_worker_is_reported_promptly_and_the_others_still_update(make_cluster) -> None:
    c = make_cluster(["net", "net", "net"])
    c.sender.send()
    c.kill(1)
    c.bump()
    started = time.monotonic()
    with pytest.raises(ws.WorkerLostError) as info:
        c.sender.send(timeout=30)
    assert time.monotonic() - started < 5
    assert info.value.worker_ids == (1,)
    assert "worker 1" in str(info.value)
    c.assert_has(0, c.expected())
    c.assert_has(2, c.expected())
    c.bump()
    c.sender.send(worker_ids=[0, 2])
    c.assert_has(2, c.expected())


def test_two_failures_are_named_in_one_error(make_cluster) -> None:
    c = make_cluster(["net", "net", "net"])
    c.sender.send()
    c.kill(0)
    c.kill(2)
    with pytest.raises(ws.WorkerLostError) as info:
        c.sender.send(timeout=30)
    assert info.value.worker_ids == (0, 2)
    assert "worker 0" in str(info.value) and "worker 2" in str(info.value)
    c.assert_has(1, c.expected())


def test_every_dtype_0d_and_empty_tensors_arrive_bit_exact(make_cluster) -> None:
    c = make_cluster(["mixed", "mixed"], trainer_kind="mixed")
    for _ in range(2):
        c.bump()
        c.sender.send()
        for i in range(2):
            c.assert_has(i, c.expected())


def test_a_worker_whose_model_is_a_dict_of_tensors_gets_exact_updates(make_cluster) -> None:
    # The dict's own tensors must change (in place, or re-pointed under the
    # shared scheme), not aliases of them.
    c = make_cluster(["dict", "net"])
    for _ in range(2):
        c.bump()
        c.sender.send()
        for i in range(2):
            c.assert_has(i, c.expected())


def test_an_empty_model_sends_nothing_but_still_acks(make_cluster) -> None:
    c = make_cluster(["empty", "net"], trainer_kind="empty")
    report = c.sender.send(worker_ids=[0])
    assert report.nbytes == 0
    assert c.state(0)["applied"][-1] == report.version
    assert c.sender.send({}, worker_ids=[0]).version == report.version + 1
    with pytest.raises(ws.WeightMismatchError):
        c.sender.send(worker_ids=[1])  # an empty model does not match one with weights


def test_a_worker_that_repoints_its_parameters_still_gets_exact_updates(make_cluster) -> None:
    c = make_cluster(["net"])
    c.sender.send()
    assert c.command(0, "repoint") == "ok"
    c.bump()
    c.sender.send()
    c.assert_has(0, c.expected())
    # Same address, shape and dtype, the elements in another order (strides):
    # the update must land in that order, not as the bytes lay before.
    assert c.command(0, "restride") == "ok"
    c.bump()
    c.sender.send()
    c.assert_has(0, c.expected())
    assert c.command(0, "reshape") == "ok"
    c.bump()
    with pytest.raises(ws.WorkerApplyError, match="layout"):
        c.sender.send()
    assert c.state(0)["weights"]["out.weight"].shape == (5, 16)


def test_a_trainer_that_repoints_its_parameters_sends_what_they_now_hold(cluster: Cluster) -> None:
    # The sender reuses its last read of a model whose tensors stayed put;
    # each kind of move below must be seen at the next send.
    weight = cluster.model.inp.weight
    cluster.sender.send()
    with torch.no_grad():
        weight.data = weight.data.clone().add_(1.0)  # other memory
    cluster.sender.send()
    for i in range(3):
        cluster.assert_has(i, cluster.expected())
    rows, cols = weight.shape
    with torch.no_grad():
        # The same bytes, read in another order: same address, shape and dtype.
        weight.data = weight.data.as_strided((rows, cols), (1, rows))
    assert not weight.is_contiguous()
    cluster.sender.send()
    for i in range(3):
        cluster.assert_has(i, cluster.expected())
    before = cluster.expected()
    weight.requires_grad_(False)  # (torch refuses integer data under a tensor needing gradients)
    weight.data = weight.data.contiguous()
    cluster.sender.send()
    weight.data = weight.data.view(torch.int32)  # same address and shape, other dtype
    with pytest.raises(ws.WeightMismatchError):
        cluster.sender.send()
    for i in range(3):
        cluster.assert_has(i, before)
    # (The module's cluster goes on with the model as it was.)
    weight.data = weight.data.view(torch.float32)
    weight.requires_grad_(True)


def test_a_worker_writing_its_own_buffers_keeps_running_and_touches_no_other(make_cluster) -> None:
    c = make_cluster(["net", "net"])
    c.sender.send()
    before = c.expected()
    assert c.command(0, "train_step") == "ok"  # BatchNorm in train mode writes its statistics
    mine = c.state(0)["weights"]
    assert not torch.equal(mine["norm.running_mean"], before["norm.running_mean"])
    assert mine["norm.num_batches_tracked"] == before["norm.num_batches_tracked"] + 1
    c.assert_has(1, before)  # the other worker reads what the trainer sent, unchanged
    c.bump()
    c.sender.send()  # the next update replaces the worker's own statistics
    c.assert_has(0, c.expected())
    c.assert_has(1, c.expected())


def test_a_clean_shutdown_is_told_apart_from_a_lost_sender(make_cluster, scheme_name: str) -> None:
    if scheme_name == "ray":
        pytest.skip("a Ray actor is never told of a shutdown: it keeps serving until the trainer's end")
    c = make_cluster(["net", "net"])
    c.sender.send()
    c.scheme.shutdown()
    for i in range(2):
        deadline = time.monotonic() + 10
        while not c.state(i)["errors"]:
            assert time.monotonic() < deadline, "the worker was not told of the shutdown"
            time.sleep(0.02)
        assert c.state(i)["errors"][0].startswith("SenderClosedError"), c.state(i)["errors"]


@pytest.mark.parametrize("path", ["send", "send_async"])
def test_a_finished_send_holds_neither_itself_nor_the_callers_weights(cluster: Cluster, path: str) -> None:
    """Weights made for one send are the caller's: once the send is over, no
    staging, cache or record of it keeps their memory (or the send) alive."""
    import gc

    from harness.workers import build_model
    from torch.multiprocessing.reductions import StorageWeakRef

    sender = cluster.sender
    # (Weights of the workers' layout, whatever the trainer's model holds now.)
    sender.send(build_model("net", seed=3))  # the layouts known, the stagings made
    weights = {k: v.detach() + 1 for k, v in build_model("net", seed=4).state_dict().items()}
    memory = [StorageWeakRef(t.untyped_storage()) for t in weights.values()]
    if path == "send":
        sender.send(weights)
    else:
        sender.send_async(weights)
        sender.wait_async()
    del weights
    gc.collect()
    assert all(ref.expired() for ref in memory)
    # Nor is the send itself (its machine, what a chain was handed) held.
    from weightsync._send import SendMachine, _Outgoing

    # (type(), not isinstance(): some objects of torch warn when their class is asked.)
    held = [type(o).__name__ for o in gc.get_objects() if type(o) in (SendMachine, _Outgoing)]
    assert held == [], held


def test_a_wait_that_takes_over_a_send_the_loop_thread_has_not_started_goes_on_from_there(
    cluster: Cluster,
) -> None:
    """send_async() hands a chain's send (torch.distributed, Ray) to
    weightsync's loop thread; a wait that comes before that thread got to
    it takes it over, from where send_async() left it. Here the loop
    thread is held busy meanwhile, so the wait always takes it over."""
    from weightsync._runtime import RUNTIME

    async def busy() -> None:
        time.sleep(0.5)  # (blocks the loop thread: the send's job waits its turn)

    blocker = RUNTIME.start(busy)
    cluster.bump()
    handle = cluster.sender.send_async()
    report = handle.wait()
    blocker.result(timeout=30)
    assert report.version == handle.version and report.worker_ids == (0, 1, 2)
    expected = cluster.expected()
    for i in range(3):
        cluster.assert_has(i, expected)
