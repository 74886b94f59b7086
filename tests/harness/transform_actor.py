"""A Ray actor that holds a module the way torchrl's ``ModuleTransform``
does (``.module``, ``_init_weight_sync_scheme``, ``_receive_weights_scheme``),
for the tests of :class:`weightsync.RayModuleTransformScheme` that need no
torchrl; tests/test_torchrl.py runs the scheme in torchrl's own transform."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

SIZE = 8


def make_module(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(SIZE, SIZE)


class TransformActor:
    """The actor: ``module`` is what the scheme updates."""

    def __init__(self, with_module: bool = True) -> None:
        self.module = make_module(0) if with_module else None
        self._weight_sync_scheme: Any = None
        self._ptrs = self.data_ptrs() if with_module else {}

    # What torchrl's ModuleTransform offers the scheme.
    def _init_weight_sync_scheme(self, scheme: Any, model_id: str | None) -> None:
        scheme.init_on_receiver(model_id=model_id, context=self)
        scheme.connect()
        self._weight_sync_scheme = scheme

    def _receive_weights_scheme(self) -> Any:
        return self._weight_sync_scheme.receive()

    # What the tests read.
    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def data_ptrs(self) -> dict[str, int]:
        return {k: v.data_ptr() for k, v in self.module.state_dict().items()}

    def kept_its_tensors(self) -> bool:
        return self.data_ptrs() == self._ptrs

    def version(self) -> int:
        return int(self._weight_sync_scheme.get_receiver().version)

    def forward_twice_slowly(self, seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The bias read at the start and at the end of one method call."""
        first = self.module.bias.detach().clone()
        time.sleep(seconds)
        return first, self.module.bias.detach().clone()


class TransformHandle:
    """What the sender side needs of a ``RayModuleTransform``: its ``_actor``."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
