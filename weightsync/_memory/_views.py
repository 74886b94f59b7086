"""The tensors of a layout over a buffer, made once: every staging and the
trainer's host buffers look them up here, by (buffer, layout), instead of
each keeping a cache of its own."""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable

import torch

from .._packet import Manifest

__all__ = ["LayoutViews"]


class LayoutViews:
    """Views of ``manifest``'s tensors over buffers, by the buffer's key
    (a segment's or slab's token, or any hashable that names the buffer for
    as long as it lives) and the layout. :meth:`forget` a buffer before it
    is freed or replaced."""

    def __init__(self) -> None:
        self._views: dict[tuple[Hashable, str], list[torch.Tensor]] = {}

    def of(
        self, key: Hashable, manifest: Manifest, data: torch.Tensor | Callable[[], torch.Tensor]
    ) -> list[torch.Tensor]:
        """The views of ``manifest`` over ``data`` (the buffer named ``key``;
        or a function that returns it, called only where the views are not
        made yet): the same list object for as long as both stay."""
        views = self._views.get((key, manifest.layout_id))
        if views is None:
            buffer = data if isinstance(data, torch.Tensor) else data()
            views = self._views[(key, manifest.layout_id)] = manifest.views(buffer)
        return views

    def forget_all_but(self, keys: Container[Hashable]) -> None:
        """Drop the views over every buffer but those of ``keys``."""
        self._views = {k: v for k, v in self._views.items() if k[0] in keys}

    def forget(self, key: Hashable | None = None) -> None:
        """Drop the views over the buffer ``key`` (None: over every buffer)."""
        if key is None:
            self._views = {}
        else:
            self._views = {k: v for k, v in self._views.items() if k[0] != key}
