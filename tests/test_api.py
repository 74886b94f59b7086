"""The public surface: names, schemes' lifecycle, strategies, packets (in-process)."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys

import pytest
import torch
from harness.workers import build_model
from tensordict import TensorDict
from torch import nn

import weightsync as ws
from weightsync._packet import Manifest


def test_public_names_are_exactly_all() -> None:
    # A subpackage (weightsync.bench) shows up as an attribute once imported;
    # it is not a name the package exports.
    public = {n for n in dir(ws) if not n.startswith("_") and not inspect.ismodule(getattr(ws, n))}
    assert public == set(ws.__all__) - {"__version__"}
    for name in ws.__all__:
        assert getattr(ws, name) is not None


def test_every_public_name_is_documented_and_nothing_else() -> None:
    """docs/usage.md's table of public names is weightsync.__all__: no name
    exported without a word in the docs, none documented that is gone."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    table = text.split("## Public names", 1)[1]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = {name for cell in rows for name in re.findall(r"`([A-Za-z_]+)`", cell)}
    assert documented == set(ws.__all__)


# Imported only when used: tensordict alone costs seconds (it imports
# torch._dynamo); the others belong to extras.
_HEAVY = ("tensordict", "torch._dynamo", "ray", "blosc2", "xxhash", "uvloop")


def test_import_is_light_and_never_imports_ray() -> None:
    code = (
        "import sys, weightsync\n"
        f"heavy = [m for m in {_HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_needs_no_numpy() -> None:
    # numpy is in the ray and delta extras only. torch imports it where it
    # is installed, so its absence is simulated: None in sys.modules makes
    # ``import numpy`` raise ImportError (torch then warns and goes on).
    code = "import sys\nsys.modules['numpy'] = None\nimport weightsync\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def _import_times(module: str) -> list[tuple[int, int, str]]:
    """``python -X importtime -c 'import <module>'``: (depth, cumulative
    microseconds, name) of each import, in the order they ended."""
    command = [sys.executable, "-X", "importtime", "-c", f"import {module}"]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    out = []
    for line in run.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line[len("import time:") :].split("|")
        out.append(((len(name) - len(name.lstrip())) // 2, int(cumulative), name.strip()))
    return out


def test_import_costs_little_beyond_torch() -> None:
    times = _import_times("weightsync")
    at = {name: i for i, (_, _, name) in enumerate(times)}
    ours, torch_ = times[at["weightsync"]][1], times[at["torch"]][1]
    # torch's own imports are the lines just before its own, deeper than it.
    depth, first = times[at["torch"]][0], at["torch"]
    while first > 0 and times[first - 1][0] > depth:
        first -= 1
    outside_torch = {name for i, (_, _, name) in enumerate(times) if not first <= i <= at["torch"]}
    heavy = {name for name in outside_torch if name.split(".")[0] in (*_HEAVY, "numpy")}
    assert not heavy, f"weightsync itself imports {sorted(heavy)}"
    delta = (ours - torch_) / 1e6
    print(f"import weightsync: {ours / 1e6:.3f} s, torch {torch_ / 1e6:.3f} s of it, {delta:.3f} s its own")
    # The target is 0.3 s (0.15 s measured on an idle 2-core machine); the
    # bound leaves room for a loaded machine and still catches tensordict
    # (about 2 s) or Ray coming back.
    assert delta < 1.0


def test_error_tree() -> None:
    assert issubclass(ws.AckTimeoutError, TimeoutError)
    assert issubclass(ws.AckTimeoutError, ws.WorkerError)
    assert issubclass(ws.WorkerLostError, ws.WeightSyncError)
    assert issubclass(ws.WeightMismatchError, ValueError)
    assert issubclass(ws.WeightSyncStateError, RuntimeError)
    for name in ws.__all__:
        obj = getattr(ws, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, ws.WeightSyncError)


@pytest.mark.parametrize(
    "cls, default", [(ws.MultiProcessWeightSyncScheme, "state_dict"), (ws.NoWeightSyncScheme, "tensordict")]
)
def test_scheme_defaults_and_uninitialised_state(cls: type[ws.WeightSyncScheme], default: str) -> None:
    scheme = cls()
    assert scheme.strategy == ws.WeightStrategy(default)
    assert scheme.model_id is None and scheme.context is None and scheme.model is None
    assert scheme.worker_idx is None and scheme.weights is None
    assert scheme.sender_transports == {} and scheme.receiver_transport is None
    assert scheme.staging is None
    for call in (scheme.get_sender, scheme.get_receiver, scheme.get_async_sender, scheme.get_async_receiver):
        with pytest.raises(RuntimeError):
            call()
    scheme.shutdown()
    scheme.shutdown()


def test_scheme_pickles_configuration_only_before_and_after_init() -> None:
    import multiprocessing as mp

    scheme = ws.MultiProcessWeightSyncScheme(timeout=12.0)
    clone = pickle.loads(pickle.dumps(scheme))
    assert clone.strategy == scheme.strategy and clone.timeout == 12.0
    ours, theirs = mp.Pipe()
    scheme.init_on_sender("policy", pipes=[ours], model=build_model("net"))
    try:
        clone = pickle.loads(pickle.dumps(scheme))
        assert clone.model_id == "policy"
        assert clone.sender_transports == {} and clone.model is None
        with pytest.raises(RuntimeError):
            clone.get_sender()
    finally:
        scheme.shutdown()
        ours.close()
        theirs.close()


def test_init_validates_its_arguments() -> None:
    import multiprocessing as mp

    with pytest.raises(ValueError, match="pipes"):
        ws.MultiProcessWeightSyncScheme().init_on_sender("policy")
    a, b = mp.Pipe()
    try:
        with pytest.raises(ValueError, match="num_workers"):
            ws.MultiProcessWeightSyncScheme().init_on_sender("policy", pipes=[a], num_workers=2)
        with pytest.raises(ValueError, match="model"):
            ws.MultiProcessWeightSyncScheme().init_on_receiver("policy", pipe=b)
        scheme = ws.MultiProcessWeightSyncScheme()
        scheme.init_on_sender("policy", pipes=[a])
        with pytest.raises(RuntimeError, match="already"):
            scheme.init_on_sender("policy", pipes=[a])
        scheme.shutdown()
    finally:
        a.close()
        b.close()


def test_context_provides_pipes_and_model() -> None:
    import multiprocessing as mp

    class Collector:
        def __init__(self) -> None:
            self.pipes = [mp.Pipe()[0]]
            self.num_workers = 1
            self.policy = build_model("net")

        def get_model(self, model_id: str) -> nn.Module:
            assert model_id == "policy"
            return self.policy

    collector = Collector()
    scheme = ws.MultiProcessWeightSyncScheme()
    scheme.init_on_sender("policy", context=collector)
    try:
        assert scheme.context is collector and scheme.model is collector.policy
        assert list(scheme.sender_transports) == [0]
        assert scheme.staging is not None
        assert scheme.create_sender() is scheme.get_sender()
        prepared = scheme.prepare_weights(None, "policy", ws.WeightStrategy("state_dict"), collector)
        assert set(prepared) == set(collector.policy.state_dict())
    finally:
        scheme.shutdown()


def _sent(scheme: ws.WeightSyncScheme) -> dict[str, torch.Tensor]:
    """What ``send(None)`` would send now."""
    weights = scheme.prepare_weights(None, scheme.model_id, ws.WeightStrategy("state_dict"))
    assert isinstance(weights, dict)
    return weights


def _is(weights: dict[str, torch.Tensor], model: nn.Module) -> bool:
    return all(torch.equal(weights[name], value) for name, value in model.state_dict().items())


def test_send_reads_the_model_in_torchrls_order() -> None:
    """An explicit ``model=`` (or ``weights=``) first, then the context's
    ``get_model(model_id)``, ``.model``, attribute ``model_id``."""
    explicit, by_get, by_attr, by_path = (build_model("net", seed=s) for s in (1, 2, 3, 4))

    class RayCollectorLike:  # holds only .policy, as torchrl's RayCollector
        def __init__(self) -> None:
            self.policy = by_attr
            self.env = type("Env", (), {"value_net": by_path})()

    class WithGetModel(RayCollectorLike):
        def get_model(self, model_id: str) -> nn.Module | None:
            return by_get if model_id == "policy" else None

    cases = [
        (RayCollectorLike(), {"model": explicit}, "policy", explicit),
        (RayCollectorLike(), {"weights": explicit}, "policy", explicit),
        (WithGetModel(), {"model": explicit}, "policy", explicit),
        (WithGetModel(), {}, "policy", by_get),
        (RayCollectorLike(), {}, "policy", by_attr),
        (WithGetModel(), {}, "env.value_net", by_path),  # get_model has none: the attribute path
    ]
    for context, kwargs, model_id, expected in cases:
        scheme = ws.InProcessWeightSyncScheme()
        scheme.init_on_sender(model_id, context=context, num_workers=1, **kwargs)
        try:
            assert _is(_sent(scheme), expected), (type(context).__name__, kwargs, model_id)
        finally:
            scheme.shutdown()


def test_a_context_is_read_at_each_send_and_one_without_the_model_is_refused_by_name() -> None:
    class Holder:
        pass

    context = Holder()
    context.policy = build_model("net", seed=1)  # type: ignore[attr-defined]
    scheme = ws.InProcessWeightSyncScheme()
    scheme.init_on_sender("policy", context=context, num_workers=1)
    try:
        context.policy = replaced = build_model("net", seed=2)  # type: ignore[attr-defined]
        assert _is(_sent(scheme), replaced)
        del context.policy  # type: ignore[attr-defined]
        with pytest.raises(ws.InvalidWeightsError, match="Holder holds no model 'policy'"):
            _sent(scheme)
    finally:
        scheme.shutdown()


def test_no_weight_sync_scheme_does_nothing() -> None:
    scheme = ws.NoWeightSyncScheme()
    scheme.init_on_sender("policy")
    assert scheme.send() is None
    scheme.connect()
    scheme.shutdown()
    worker = ws.NoWeightSyncScheme()
    worker.init_on_receiver(model_id="policy", model=build_model("net"))
    assert worker.receive() is None and worker.receive(timeout=0.1) is None
    assert worker.create_transport() is not None
    worker.shutdown()


# -- strategies -------------------------------------------------------------


@pytest.mark.parametrize("extract_as", ["state_dict", "tensordict"])
@pytest.mark.parametrize("apply_as", ["state_dict", "tensordict"])
def test_strategies_interoperate_and_apply_in_place(extract_as: str, apply_as: str) -> None:
    source, target = build_model("net", seed=1), build_model("net", seed=2)
    source.norm.running_mean.fill_(3.0)  # buffers travel with the parameters
    weights = ws.WeightStrategy(extract_as).extract_weights(source)
    if extract_as == "tensordict":
        assert isinstance(weights, TensorDict)
    else:
        assert isinstance(weights, dict)
    before = {k: (id(v), v.data_ptr()) for k, v in target.state_dict(keep_vars=True).items()}
    ws.WeightStrategy(apply_as).apply_weights(target, weights)
    after = target.state_dict(keep_vars=True)
    for name, value in source.state_dict().items():
        assert torch.equal(after[name], value)
        assert (id(after[name]), after[name].data_ptr()) == before[name]


def test_strategy_rejects_a_mismatch_before_writing_anything() -> None:
    source, target = build_model("net", seed=1), build_model("net", seed=2)
    snapshot = {k: v.clone() for k, v in target.state_dict().items()}
    weights = dict(source.state_dict())
    weights["out.weight"] = torch.zeros(2, 2)
    with pytest.raises(ws.WeightMismatchError, match=r"out\.weight"):
        ws.WeightStrategy("state_dict").apply_weights(target, weights)
    for name, value in target.state_dict().items():
        assert torch.equal(value, snapshot[name])


def test_extract_from_context_and_unknown_sources() -> None:
    class Ctx:
        def get_model(self, model_id: str) -> nn.Module:
            return build_model("net")

    strategy = ws.WeightStrategy("state_dict")
    assert "out.bias" in strategy.extract_weights(None, context=Ctx(), model_id="policy")
    with pytest.raises(ws.InvalidWeightsError):
        strategy.extract_weights(None)
    with pytest.raises(ws.InvalidWeightsError):
        strategy.extract_weights(42)
    with pytest.raises(ValueError):
        ws.WeightStrategy("pickle")  # type: ignore[arg-type]


def test_scheme_apply_weights_not_in_place_assigns() -> None:
    scheme = ws.NoWeightSyncScheme()
    model = build_model("net", seed=2)
    scheme.init_on_receiver(model_id="policy", model=model)
    new = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    scheme.apply_weights(new)
    assert torch.equal(model.out.weight, new["out.weight"])
    assert torch.equal(scheme.weights["out"]["weight"], new["out.weight"])
    scheme.apply_weights(new, inplace=False)
    assert model.out.weight.data_ptr() == new["out.weight"].data_ptr()
    scheme.shutdown()


# -- packets ----------------------------------------------------------------


def test_manifest_is_aligned_sorted_and_stable() -> None:
    tensors = {
        "b": torch.zeros(3, dtype=torch.bool),
        "a": torch.zeros(5, dtype=torch.float16),
        "c": torch.tensor(1.0, dtype=torch.float64),
        "d": torch.zeros(0, 4),
    }
    manifest = Manifest.of(tensors)
    assert manifest.names == ["a", "b", "c", "d"]
    assert all(spec.offset % 64 == 0 for spec in manifest.specs)
    assert Manifest.from_signature(manifest.signature).layout_id == manifest.layout_id
    assert Manifest.of({**tensors, "d": torch.zeros(0, 5)}).layout_id != manifest.layout_id
    buffer = torch.zeros(manifest.nbytes, dtype=torch.uint8)
    views = manifest.views(buffer)
    for view, source in zip(views, manifest.ordered(tensors), strict=True):
        assert view.shape == source.shape and view.dtype == source.dtype


def test_a_copy_plan_notices_a_destination_that_moved_or_was_restrided() -> None:
    from weightsync._copy import CopyPlan

    dst, src = torch.zeros(4), torch.arange(4.0)
    param = nn.Parameter(dst)
    plan = CopyPlan([param], [src])
    plan.run()
    assert torch.equal(param.detach(), src) and plan.still_valid()
    param.data = torch.zeros(4)  # the user swapped the storage under the plan
    assert not plan.still_valid()
    square = nn.Parameter(torch.zeros(3, 3))
    plan = CopyPlan([square], [torch.arange(9.0).view(3, 3)])
    assert plan.still_valid()
    square.data = square.data.t()  # the same bytes, read in another order
    assert not plan.still_valid()
    wave = torch.zeros(3, dtype=torch.complex64)
    plan = CopyPlan([wave], [torch.ones(3, dtype=torch.complex64)])
    assert plan.still_valid(sources=True)
    wave.data = wave.data.conj()  # the same bytes, read as their conjugate
    assert not plan.still_valid()
    source = torch.arange(4.0).view(2, 2)
    plan = CopyPlan([torch.zeros(2, 2)], [source])
    source.data = source.data.t()
    assert plan.still_valid() and not plan.still_valid(sources=True)


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("threads", [1, 4])
def test_a_copy_plan_copies_every_byte_of_small_and_large_spans(threads: int, large: bool) -> None:
    # In a plan of at most PARALLEL_COPY_BYTES, small spans are copied
    # through byte views and large ones by memmove; a larger plan copies
    # every span by memmove, over several threads where it may: each byte
    # lands once, as often as the plan runs.
    from weightsync._copy import PARALLEL_COPY_BYTES, CopyPlan

    sizes = [1, 7, (64 << 10) // 4, (64 << 10) // 4 + 1, 3 * PARALLEL_COPY_BYTES // (4 if large else 16)]
    src = [torch.randn(n) for n in sizes] + [torch.arange(5, dtype=torch.int16)]
    dst = [torch.zeros_like(t) for t in src]
    plan = CopyPlan(dst, src)
    assert (plan.total <= PARALLEL_COPY_BYTES) is not large
    assert bool(plan._views) is not large  # (the path this case is for)
    for _ in range(2):
        plan.run(threads)
        assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
        for t in src:
            t.add_(1)


def test_a_copy_plan_refuses_tensors_that_differ() -> None:
    from weightsync._copy import CopyPlan

    with pytest.raises(ValueError):
        CopyPlan([torch.zeros(4)], [torch.zeros(5)])
    with pytest.raises(ValueError):
        CopyPlan([torch.zeros(4)], [torch.zeros(4, dtype=torch.float64)])
