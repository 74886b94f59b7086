"""gloo, the chain's link today (``_link.ChainLink``): a process group of
the chain's ranks over a store prefix, its point-to-point sends and
receives moving host memory over TCP, and the store clients the transports
meet in."""

from __future__ import annotations

from typing import Any

from ._link import PeerGroup
from ._pipeline import seconds

__all__ = ["GLOO", "GlooLink", "connect_store", "gloo_group"]


def connect_store(host: str, port: int, timeout: float) -> Any:
    """A client of the TCPStore at ``host:port``; waits up to ``timeout``
    seconds for it.

    :raises RuntimeError: it did not answer in time.
    """
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=seconds(timeout))


def gloo_group(store: Any, prefix: str, rank: int, size: int, address: str, stall: float) -> Any:
    """This process's member of a new gloo group (rank ``rank`` of ``size``)
    over ``PrefixStore(prefix, store)``: no global state, so a group with a
    dead member is simply dropped and a new one formed under another
    prefix. Its sockets bind to ``address`` and connect to a peer only when
    first used, so a chain connects neighbours only. Never waits for the
    others: the first send or receive with a peer waits for it to join
    (up to ``stall`` seconds, then raises ``RuntimeError``).
    """
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = seconds(stall)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address, lazy_init=True)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


class GlooLink:
    """The chain's link over gloo: host memory, over TCP."""

    name = "gloo"

    def form(self, store: Any, prefix: str, rank: int, size: int, address: str, stall: float) -> PeerGroup:
        group: PeerGroup = gloo_group(store, prefix, rank, size, address, stall)
        return group


#: The link every chain uses unless given another.
GLOO = GlooLink()
