"""Parts of a torchrl collector run (imported by its spawned workers): a
mock environment and a policy whose every action is its version.

The policy is a linear map with zero weight and a bias of ``version``, so
each element of ``batch["action"]`` names the version of the weights that
produced it, and a step that ran on a mix of two versions would show both.
"""

from __future__ import annotations

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
