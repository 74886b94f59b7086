"""The trainer's read of its module, send after send (``_reads.ModuleReads``):
a warm read hands back the last one only while the module's state dict
would be the same tensors under the same names; every way a state dict can
change makes the next read a full one, equal to ``state_dict()``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from weightsync._reads import ModuleReads


def _expected(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.state_dict(keep_vars=True))


def _same(read: dict[str, torch.Tensor], module: nn.Module) -> bool:
    """``read`` has the state dict's names, in its order, each aliasing
    its tensor's bytes with its layout."""
    want = _expected(module)
    return list(read) == list(want) and all(
        (read[k].data_ptr(), read[k].shape, read[k].dtype)
        == (want[k].data_ptr(), want[k].shape, want[k].dtype)
        for k in want
    )


def _mlp() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2, bias=False), nn.BatchNorm1d(2))
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    return model


def test_a_module_that_did_not_change_is_read_once() -> None:
    model = _mlp()
    reads = ModuleReads()
    first = reads.read(model)
    assert _same(first, model)
    assert "scratch" not in first and "2.bias" not in first  # non-persistent; None
    assert reads.read(model) is first
    assert reads.kept(first)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # new values in the same bytes: the same read
    assert reads.read(model) is first


def _add_param(m: nn.Module) -> None:
    m[0].register_parameter("extra", nn.Parameter(torch.ones(2)))


def _swap_child(m: nn.Module) -> None:
    m[2] = nn.Linear(4, 2, bias=False)  # same name and shapes, another module


def _bias_to_none_and_back(m: nn.Module) -> None:
    # Same names and the same tensor, under the other name: {weight, bias=None} -> {weight=None, bias}.
    linear = m[2]
    weight = linear.weight
    linear.weight = None
    linear.bias = weight


def _hide_buffer(m: nn.Module) -> None:
    bn = m[3]
    running = bn.running_mean
    del bn.running_mean
    bn.register_buffer("running_mean", running, persistent=False)


def _show_buffer(m: nn.Module) -> None:
    scratch = m.scratch
    del m.scratch
    m.register_buffer("scratch", scratch)


def _hook(m: nn.Module) -> None:
    def drop_bias(module: nn.Module, state: dict[str, Any], prefix: str, local: Any) -> None:
        del state[prefix + "bias"]

    m[0]._register_state_dict_hook(drop_bias)


def _override_class(m: nn.Module) -> None:
    class Renamed(nn.Linear):
        def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
            destination[prefix + "w"] = self.weight

    m[0].__class__ = Renamed


def _override_on_instance(m: nn.Module) -> None:
    linear = m[0]

    def save(destination: Any, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "only"] = linear.weight

    linear._save_to_state_dict = save  # type: ignore[method-assign]


def _repoint(m: nn.Module) -> None:
    m[0].weight.data = torch.zeros(4, 4)


def _resize(m: nn.Module) -> None:
    m[0].bias.data = torch.zeros(8)


def _share_child(m: nn.Module) -> None:
    m.append(m[0])  # the same module twice: its tensors twice, under two names


@pytest.mark.parametrize(
    "change",
    [
        _add_param,
        _swap_child,
        _bias_to_none_and_back,
        _hide_buffer,
        _show_buffer,
        _hook,
        _override_class,
        _override_on_instance,
        _repoint,
        _resize,
        _share_child,
    ],
)
def test_every_change_of_the_state_dict_makes_a_full_read(change: Callable[[nn.Module], None]) -> None:
    model = _mlp()
    reads = ModuleReads()
    first = reads.read(model)
    change(model)
    again = reads.read(model)
    assert again is not first
    assert _same(again, model)
    assert reads.read(model) is again or not reads.kept(again)  # warm again, where it can be kept
    assert _same(reads.read(model), model)


class _Custom(nn.Module):
    """A module whose state dict is not its tensors: read through its state dict each time."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(3))
        self.only_a = False

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        out = super().state_dict(*args, **kwargs)
        if self.only_a:
            del out["b"]
        return out


def test_a_module_that_customises_its_state_dict_is_read_through_it() -> None:
    model = _Custom()
    reads = ModuleReads()
    first = reads.read(model)
    assert list(first) == ["a", "b"] and reads.read(model) is first
    model.only_a = True  # nothing in the tree changed; its state dict did
    assert list(reads.read(model)) == ["a"]


def test_a_module_read_is_taken_again_once_a_complex_weight_turns_conjugate() -> None:
    # A real model's reads skip the conjugate bit (a real tensor has none);
    # a complex one's ask it: the same bytes, read conjugated, are new weights.
    module = nn.Module()
    module.register_parameter("w", nn.Parameter(torch.randn(4, dtype=torch.complex64)))
    reads = ModuleReads()
    first = reads.read(module)
    assert reads.read(module) is first  # nothing moved: the same read
    with torch.no_grad():
        module.w.data = module.w.data.conj()  # same address, shape and dtype
    again = reads.read(module)
    assert again is not first and again["w"].is_conj()
    assert reads.read(module) is again


def test_another_module_and_other_sources_are_read_in_full() -> None:
    reads = ModuleReads()
    one, two = _mlp(), _mlp()
    first = reads.read(one)
    assert _same(reads.read(two), two)
    weights = {"x": torch.zeros(2)}
    read = reads.read(weights)
    assert list(read) == ["x"] and not reads.kept(read)
    assert reads.read(one) is not first  # the last read was of another source


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_torchscript_module_is_read_through_its_state_dict() -> None:
    # Its tensors live in C++, behind mappings that are not dicts: no tree.
    scripted = torch.jit.script(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    reads = ModuleReads()
    first = reads.read(scripted)
    assert _same(first, scripted) and reads.read(scripted) is first
    with torch.no_grad():
        scripted[0].weight.data = torch.zeros(3, 3)
    again = reads.read(scripted)
    assert again is not first and _same(again, scripted)


def test_a_state_dict_hook_runs_once_per_read() -> None:
    # A module with a hook is read through its state dict each send: once,
    # a full read after a change included.
    model = _mlp()
    calls: list[int] = []
    model[0]._register_state_dict_hook(lambda *args: calls.append(1))
    reads = ModuleReads()
    first = reads.read(model)
    assert reads.read(model) is first and len(calls) == 2
    model[0].weight.data = torch.zeros(4, 4)
    assert reads.read(model) is not first and len(calls) == 3
