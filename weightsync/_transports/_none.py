"""The transport of :class:`NoWeightSyncScheme`: moves nothing."""

from __future__ import annotations

from collections.abc import Collection

from .._packet import Manifest, Packet
from ._base import Incoming

__all__ = ["NoEndpoint", "NoTransport"]


class NoTransport:
    """A sender channel that accepts every packet and moves nothing."""

    worker_id = 0
    layout: Manifest | None = None
    devices: tuple[str, ...] | None = None
    reach: tuple[str, ...] = ()

    async def connect(self) -> Manifest | None:
        return None

    def post(self, packet: Packet) -> bool:
        return True

    async def deliver(self, packet: Packet) -> None:
        return None

    def ack_fds(self, packet: Packet) -> tuple[int, ...] | None:
        return None  # acks come through deliver()

    def try_ack(self, packet: Packet, ready: Collection[int] = ()) -> bool | None:
        return None

    def why_late(self) -> str | None:
        return None

    async def aclose(self) -> None:
        return None


class NoEndpoint:
    """A worker endpoint that never has an update."""

    pushes = True  # nothing to pull: a wait only waits

    async def announce(self, manifest: Manifest, devices: tuple[str, ...]) -> None:
        return None

    async def next_update(self, timeout: float) -> Incoming | None:
        return None

    async def reply(self, version: int, error: str | None = None) -> None:
        return None

    def take_ready(self) -> Incoming | None:
        return None

    def try_reply(self, version: int, error: str | None = None) -> bool:
        return True  # nothing to send

    def wait_ready(self, timeout: float) -> bool:
        return False

    async def aclose(self) -> None:
        return None
