"""A scheme's configuration is written once: a frozen config, checked when
the scheme is made, that crosses processes as it is (pickle, ``copy.copy``),
with the options readable on the scheme as before."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import pytest
import torch
from harness.clusters import start_worker

import weightsync as ws
from weightsync.schemes._pipes import PipeSchemeConfig

# Each scheme class, with options that differ from its defaults.
MADE: dict[str, tuple[type[ws.WeightSyncScheme], dict[str, Any]]] = {
    "multiprocess": (ws.MultiProcessWeightSyncScheme, {"sync": False}),
    "shared": (ws.SharedMemWeightSyncScheme, {"sync": False}),
    "ray": (ws.RayWeightSyncScheme, {}),
    "distributed": (ws.DistributedWeightSyncScheme, {"sync": False, "share_on_host": False}),
    "none": (ws.NoWeightSyncScheme, {}),
}
COMMON: dict[str, Any] = {"timeout": 7.5, "per_worker_weights": True, "wire_dtype": torch.bfloat16}


def _make(name: str) -> ws.WeightSyncScheme:
    cls, own = MADE[name]
    return cls(strategy="state_dict", **COMMON, **own)


@pytest.mark.parametrize("name", sorted(MADE))
def test_a_scheme_pickles_as_its_config(name: str) -> None:
    scheme = _make(name)
    clone = pickle.loads(pickle.dumps(scheme))
    assert type(clone) is type(scheme)
    assert clone.config == scheme.config and type(clone.config) is type(scheme.config)
    assert clone.strategy == ws.WeightStrategy("state_dict") and clone.strategy_str == "state_dict"
    assert (clone.timeout, clone.per_worker_weights, clone.wire_dtype) == (7.5, True, torch.bfloat16)
    for option, value in MADE[name][1].items():
        assert getattr(clone, option) == value == getattr(clone.config, option)
    assert not clone.initialized_on_sender and not clone.initialized_on_receiver


@pytest.mark.parametrize("name", sorted(MADE))
def test_the_config_is_frozen_and_so_are_the_options(name: str) -> None:
    scheme = _make(name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        scheme.config.timeout = 1.0  # type: ignore[misc]
    for option in ("timeout", "verify", "strategy", "per_worker_weights", "wire_dtype", *MADE[name][1]):
        with pytest.raises(AttributeError):
            setattr(scheme, option, getattr(scheme, option))
    assert scheme.config.timeout == 7.5


def test_the_defaults_are_torchrls() -> None:
    assert ws.MultiProcessWeightSyncScheme().config.strategy == "state_dict"
    assert ws.SharedMemWeightSyncScheme().strategy_str == "tensordict"
    assert ws.MultiProcessWeightSyncScheme().sync and ws.InProcessWeightSyncScheme().sync
    dist = ws.DistributedWeightSyncScheme()
    assert (dist.backend, dist.sync, dist.share_on_host, dist.delta) == ("gloo", True, True, False)
    # torchrl's positional order: backend, sync, timeout, strategy.
    dist = ws.DistributedWeightSyncScheme("gloo", False, 3.0, "state_dict")
    assert (dist.sync, dist.timeout, dist.strategy_str) == (False, 3.0, "state_dict")


def test_options_are_checked_once_when_the_scheme_is_made() -> None:
    with pytest.raises(ValueError, match="strategy"):
        ws.MultiProcessWeightSyncScheme("pickle")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ws.SharedMemWeightSyncScheme(wire_dtype=torch.int8)
    with pytest.raises(ValueError, match="gloo"):
        ws.DistributedWeightSyncScheme(backend="nccl")
    with pytest.raises(TypeError):
        ws.RayWeightSyncScheme(sync=False)  # type: ignore[call-arg]
    # A new config from a valid one is checked again.
    config = ws.DistributedWeightSyncScheme().config
    with pytest.raises(ValueError, match="gloo"):
        dataclasses.replace(config, backend="mpi")


def test_the_in_process_scheme_copies_its_config_and_refuses_pickle() -> None:
    scheme = ws.InProcessWeightSyncScheme(timeout=4.0, verify=False)
    worker = copy.copy(scheme)
    assert worker.config is scheme.config and worker.timeout == 4.0
    with pytest.raises(TypeError, match=r"copy\.copy"):
        pickle.dumps(scheme)


def test_a_pipe_scheme_made_pipes_travel_with_it_once_initialised() -> None:
    scheme = ws.MultiProcessWeightSyncScheme(timeout=30.0, sync=False)
    scheme.init_on_sender("policy", num_workers=2, model=torch.nn.Linear(2, 2))
    try:
        state = scheme.__getstate__()
        assert set(state) == {"config", "model_id", "worker_ends"} and sorted(state["worker_ends"]) == [0, 1]
        clone = copy.copy(scheme)
        assert clone.config == scheme.config and clone.model_id == "policy" and not clone.sync
        assert sorted(clone._worker_ends) == [0, 1]
        for end in clone._worker_ends.values():
            end.close()
    finally:
        scheme.shutdown()


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TaggedConfig(PipeSchemeConfig):
    tag: str = "none"


class _TaggedScheme(ws.MultiProcessWeightSyncScheme):
    """A user's scheme with an option of its own."""

    _config_class = _TaggedConfig

    def __init__(self, tag: str, **options: Any) -> None:
        self._configure(None, tag=tag, **options)


def _tag_of(scheme: _TaggedScheme, out: Any) -> None:
    out.send((scheme.config.tag, scheme.timeout, scheme.strategy_str))


def test_a_subclass_option_survives_pickling_into_a_worker_process() -> None:
    scheme = _TaggedScheme("mine", timeout=9.0, sync=False)
    expected = _TaggedConfig(strategy="state_dict", timeout=9.0, sync=False, tag="mine")
    assert pickle.loads(pickle.dumps(scheme)).config == expected
    proc, ours = start_worker(_tag_of, lambda conn: (scheme, conn))
    try:
        assert ours.poll(120)
        assert ours.recv() == ("mine", 9.0, "state_dict")
    finally:
        proc.join(60)
        ours.close()
    assert proc.exitcode == 0
