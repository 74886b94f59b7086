"""The bookkeeping of versioned slots, host or GPU: which slots each worker
may be reading, so that a send is written only into a slot none is."""

from __future__ import annotations

from typing import Any

__all__ = ["SlotLedger"]


class SlotLedger:
    """Which slots each worker may be reading, by slot token: the slots it
    was told about and has not answered for, and the slots it runs on (more
    than one after partial updates: each tensor runs on the slot of the last
    update that wrote it). A slot no worker may be reading is free to be
    rewritten."""

    def __init__(self) -> None:
        # Per worker: token -> newest version told, and the tokens it runs on.
        self._told: dict[int, dict[bytes, int]] = {}
        self._holding: dict[int, frozenset[bytes]] = {}

    def busy(self) -> set[bytes]:
        """The tokens of the slots some worker may be reading."""
        busy: set[bytes] = set().union(*self._holding.values())
        for told in self._told.values():
            busy |= told.keys()
        return busy

    def told(self, worker_id: int, token: bytes, version: int) -> None:
        """Worker ``worker_id`` was told that slot ``token`` holds ``version``."""
        self._told.setdefault(worker_id, {})[token] = version

    def released(self, worker_id: int, version: int, holding: Any) -> None:
        """As ``Staging.released``: ``holding`` is the tokens the worker's
        ack named (tokens of other stagings among them are ignored by
        :meth:`busy`'s callers, which look up their own slots only)."""
        if not holding:
            self._holding.pop(worker_id, None)  # a fresh worker runs on its own memory
        else:
            self._holding[worker_id] = frozenset(holding)
        # Updates up to this version are answered: the worker is past them.
        told = self._told.get(worker_id)
        if told:
            self._told[worker_id] = {t: v for t, v in told.items() if v > version}
