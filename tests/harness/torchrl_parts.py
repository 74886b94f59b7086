"""Parts of a torchrl collector run (imported by its spawned workers): a
mock environment and a policy whose every action is its version.

The policy is a linear map with zero weight and a bias of ``version``, so
each element of ``batch["action"]`` names the version of the weights that
produced it, and a step that ran on a mix of two versions would show both.
"""

from __future__ import annotations

import time

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

SIZE = 7  # the mock environment's observation and action size


def make_env() -> ContinuousActionVecMockEnv:
    return ContinuousActionVecMockEnv()


def make_policy(version: float = 0.0) -> TensorDictModule:
    policy = TensorDictModule(nn.Linear(SIZE, SIZE), in_keys=["observation"], out_keys=["action"])
    set_version(policy, version)
    return policy


def set_version(policy: nn.Module, version: float) -> None:
    with torch.no_grad():
        linear = policy.module
        linear.weight.zero_()
        linear.bias.fill_(version)


def versions_in(actions: torch.Tensor) -> set[float]:
    return {float(v) for v in actions.unique()}


class StepProbe(nn.Module):
    """A policy network whose forward call reads its ``SIZE`` parameters one
    after the other, slowly: action ``i`` is parameter ``i``'s value, so an
    update that landed during the call shows as two values in one action."""

    def __init__(self) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(4096)) for _ in range(SIZE))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        values = []
        for param in self.params:
            values.append(param[0].detach().clone())
            time.sleep(0.0005)  # room for an update to land mid-call, were it allowed to
        return torch.stack(values).expand(*observation.shape[:-1], SIZE).clone()


def make_probe_policy(version: float = 0.0) -> TensorDictModule:
    policy = TensorDictModule(StepProbe(), in_keys=["observation"], out_keys=["action"])
    with torch.no_grad():
        for param in policy.parameters():
            param.fill_(version)
    return policy


def fill(policy: nn.Module, version: float) -> None:
    with torch.no_grad():
        for param in policy.parameters():
            param.fill_(version)


class WeightEcho(nn.Module):
    """A policy network that writes beside its action every one of its
    weights as it read them in that step (``echo``): each step of a batch
    shows, bit for bit, the weights it ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(SIZE, SIZE)

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = flat_weights(self)
        return self.linear(observation), flat.expand(*observation.shape[:-1], flat.numel()).clone()


def make_echo_policy() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(WeightEcho(), in_keys=["observation"], out_keys=["action", "echo"])


def flat_weights(policy: nn.Module) -> torch.Tensor:
    """Every parameter and buffer of ``policy``, in one flat tensor (a copy)."""
    return torch.cat([t.detach().reshape(-1) for t in policy.state_dict().values()])


def perturb(policy: nn.Module, generator: torch.Generator) -> None:
    """New weights: random in every bit, so that equal means copied."""
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=generator))


def make_transform_module(version: float = 0.0) -> TensorDictModule:
    """The module of a ``RayModuleTransform``: it replaces each observation
    with its version, so ``batch["next", "observation"]`` names the version
    of the transform's weights that produced it."""
    module = TensorDictModule(nn.Linear(SIZE, SIZE), in_keys=["observation"], out_keys=["observation"])
    set_version(module, version)
    return module
