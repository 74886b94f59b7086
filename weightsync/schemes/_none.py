"""The scheme that synchronises nothing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._send import refuse_options
from .._sender import Keys
from .._transports._base import SenderTransport, Staging
from .._transports._none import NoEndpoint, NoTransport
from ._base import EndpointFactory, WeightSyncScheme

__all__ = ["NoWeightSyncScheme"]


class NoWeightSyncScheme(WeightSyncScheme):
    """No synchronisation: ``send`` and ``receive`` do nothing and return None.

    Default strategy: ``'tensordict'``.
    """

    _needs_model = False

    def _refuse_sharded(self, model: Any, side: str) -> None:
        """Nothing is read or written: a sharded model is as good as any."""

    def _sender_side(
        self, context: Any, kwargs: dict[str, Any]
    ) -> tuple[dict[int, SenderTransport], Staging | None]:
        return {}, None

    def _receiver_side(self, context: Any, kwargs: dict[str, Any]) -> EndpointFactory:
        return lambda receiver: NoEndpoint()

    def create_transport(self, **kwargs: Any) -> NoTransport:
        """A transport that moves nothing."""
        return NoTransport()

    def connect(
        self,
        *,
        worker_idx: int | None = None,
        weights: Any = None,
        timeout: float | None = None,
        background: bool = True,
    ) -> None:
        """Nothing to exchange: marks this side synchronised."""
        if self._async_sender is not None:
            self._synchronized_on_sender = True
        elif self._async_receiver is not None:
            self._synchronized_on_receiver = True

    def send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
        keys: Keys | None = None,
        partial: bool = False,
        verify: bool | None = None,
        **unknown: Any,
    ) -> None:
        """No-op send: does nothing."""
        refuse_options(unknown, "send()")
        return None

    def receive(self, timeout: float | None = None) -> None:
        """No-op receive: always returns None."""
        return None
