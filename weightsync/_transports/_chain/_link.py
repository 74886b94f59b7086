"""The link under a chain: what moves a chain's frames between two of its
ranks. The chain (``_pipeline``, driven by ``_driver``) needs only what is
here, so a link that moves GPU memory directly (NCCL, RDMA) is one more
class beside gloo's (``_gloo.GlooLink``); docs/scaling.md says what such a
link must guarantee.
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol

import torch

__all__ = ["ChainLink", "PeerGroup", "Transfer"]


class Transfer(Protocol):
    """One send or receive under way."""

    def wait(self, timeout: datetime.timedelta) -> Any:
        """Block until it completed.

        :raises RuntimeError: it failed (the peer is gone, its connection
            closed), or ``timeout`` passed first; then nothing more may be
            sent or received in its group (the chain drops the group).
        """


class PeerGroup(Protocol):
    """The ranks of one chain generation, point to point. Messages between
    two ranks with the same tag arrive in the order they were sent."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Transfer:
        """Start sending ``tensors[0]`` (its bytes as they are now: the
        caller does not change them until the transfer completed) to rank
        ``dst``. Never blocks on the peer."""

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Transfer:
        """Start receiving the next message of ``tag`` from rank ``src`` into
        ``tensors[0]``, which is exactly its size. Never blocks on the peer."""


class ChainLink(Protocol):
    """A kind of link: how a chain's group is formed, and where its frames land."""

    #: Its name, in reports and errors.
    name: str

    def form(self, store: Any, prefix: str, rank: int, size: int, address: str, stall: float) -> PeerGroup:
        """This process's member (rank ``rank`` of ``size``) of a new group,
        met over ``store`` under ``prefix`` (keys of its own: no global
        state), its connections bound to ``address``. It may return before
        the others joined (gloo's connections are made on first use): a
        send or receive with a member that has not joined waits for it up
        to ``stall`` seconds.

        :raises RuntimeError: not every member joined within ``stall``
            seconds (a link that waits for them here).
        """
