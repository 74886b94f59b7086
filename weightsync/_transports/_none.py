"""The transport of :class:`NoWeightSyncScheme`: moves nothing."""

from __future__ import annotations

import torch

from .._packet import Manifest, Packet
from ._base import Update

__all__ = ["NoReceiverTransport", "NoTransport"]


class NoTransport:
    """A sender channel that accepts every packet and moves nothing."""

    worker_id = 0
    layout: Manifest | None = None

    async def connect(self) -> Manifest | None:
        return None

    def post(self, packet: Packet) -> bool:
        return True

    async def deliver(self, packet: Packet) -> None:
        return None

    async def aclose(self) -> None:
        return None


class NoReceiverTransport:
    """A worker endpoint that never has an update."""

    zero_copy = False
    applies_on_arrival = False

    async def announce(self, manifest: Manifest) -> None:
        return None

    def wait_ready(self, timeout: float) -> bool:
        return False

    async def next_update(self, timeout: float) -> Update | None:
        return None

    def sources(self, update: Update, manifest: Manifest) -> list[torch.Tensor]:
        return []

    def is_current(self, update: Update) -> bool:
        return False

    async def ack(self, version: int) -> None:
        return None

    async def reject(self, version: int, message: str) -> None:
        return None

    async def aclose(self) -> None:
        return None
