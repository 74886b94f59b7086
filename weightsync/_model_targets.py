"""Where an update lands on a worker: the model's tensors it writes, found
and checked before anything is written, and the check of its bytes against
the sender's digests."""

from __future__ import annotations

from typing import Any

import torch

from ._copy import check_writable_in_place
from ._digest import mismatched
from ._exceptions import WeightMismatchError
from ._memory._placement import devices_of
from ._packet import Manifest, Signature
from ._strategy import materialize, model_tensors
from ._transports._base import Incoming

__all__ = ["ModelTargets"]


def _still_fit(targets: list[torch.Tensor], manifest: Manifest) -> bool:
    """Whether cached targets still have their layout's shapes and dtypes."""
    # (One comparison of two lists: this runs on every update.)
    return [(t.shape, t.dtype) for t in targets] == manifest.fit


class ModelTargets:
    """The tensors of one worker's model that updates are written into,
    looked up once per layout and checked before any write.

    ``device``: where a model tensor on the meta device (a model built
    without storage) gets its storage, at the first update."""

    def __init__(self, model: Any, model_id: str | None, device: torch.device) -> None:
        self.model = model
        self.model_id = model_id
        self.device = device
        self._layout: tuple[str, Manifest, list[torch.Tensor]] | None = None
        # The layouts of partial updates seen: layout id -> (manifest, targets).
        self._subsets: dict[str, tuple[Manifest, list[torch.Tensor]]] = {}

    def set_model(self, model: Any) -> None:
        """Write the next updates into ``model`` (same layout) instead."""
        self.model = model
        self._layout = None
        self._subsets = {}

    def _manifest(self) -> tuple[Manifest, list[torch.Tensor]]:
        tensors = model_tensors(self.model, model_id=self.model_id)
        manifest = Manifest.of(tensors)
        return manifest, manifest.ordered(tensors)

    def devices(self) -> tuple[str, ...]:
        """The devices the model's tensors are on (see ``_placement``)."""
        return devices_of(model_tensors(self.model, model_id=self.model_id).values())

    def manifest(self) -> Manifest:
        """The layout of the model as it is now."""
        return self._manifest()[0]

    def of(self, incoming: Incoming) -> tuple[list[torch.Tensor], Manifest]:
        """The model's tensors in the update's layout, checked before any write.

        Looked up once per layout: replacing a parameter object of the model
        (instead of writing into it) needs a new ``init_on_receiver``.

        :raises WeightMismatchError: the update does not fit the model.
        """
        if incoming.subset is not None:
            return self._subset_targets(incoming.layout_id, incoming.subset, incoming.version)
        layout = self._layout
        if layout is not None and layout[0] == incoming.layout_id:
            _, manifest, targets = layout
            if _still_fit(targets, manifest):
                return targets, manifest
            # A tensor of the model was re-pointed to another shape since
            # the layout was cached: look the model up again (this raises).
        self._layout = None
        manifest, targets = self._manifest()
        if manifest.layout_id == incoming.layout_id and materialize(self.model, self.device):
            # A model built on the meta device gets its storage now, once the
            # update is known to fit it; it is acked only once it holds the
            # update. Its tensors are new objects: look them up again.
            manifest, targets = self._manifest()
        if manifest.layout_id != incoming.layout_id:
            raise WeightMismatchError(
                f"version {incoming.version} has layout {incoming.layout_id}, but this worker's model "
                f"has layout {manifest.layout_id} (names, shapes or dtypes changed since init)",
                model_id=self.model_id,
            )
        check_writable_in_place(zip(manifest.names, targets, strict=True), model_id=self.model_id)
        self._layout = (manifest.layout_id, manifest, targets)
        return targets, manifest

    def _subset_targets(
        self, layout_id: str, subset: Signature, version: int
    ) -> tuple[list[torch.Tensor], Manifest]:
        """The model's tensors that a partial update writes, in its order."""
        cached = self._subsets.get(layout_id)
        if cached is not None and _still_fit(cached[1], cached[0]):
            return cached[1], cached[0]
        manifest = Manifest.from_signature(subset)
        tensors = model_tensors(self.model, model_id=self.model_id)
        manifest.check_within(
            Manifest.of(tensors),
            model_id=self.model_id,
            where=f"this worker's model (version {version})",
            sides=("trainer", "worker"),
        )
        targets = manifest.ordered(tensors)
        if any(t.is_meta for t in tensors.values()):
            raise WeightMismatchError(
                f"version {version} is a partial update, but this worker's model is on the meta device "
                "(no storage yet): it needs a whole update first",
                model_id=self.model_id,
            )
        check_writable_in_place(zip(manifest.names, targets, strict=True), model_id=self.model_id)
        self._subsets[layout_id] = (manifest, targets)
        return targets, manifest

    def corrupt(self, incoming: Incoming, manifest: Manifest) -> str | None:
        """Why the update's bytes are not what the sender digested (None:
        they are, or it sent no digests). Read before the model is written."""
        if incoming.digests is None:
            return None
        if incoming.checked_on_host:
            # The sender checked these bytes for the whole host, in memory
            # that nothing can write any more: make sure it is that memory.
            wrong = incoming.check_mapping(manifest)
            if wrong is None:
                return None
            return (
                f"version {incoming.version} failed its integrity check: {wrong}; the model was "
                "left as it was"
            )
        bad = mismatched(manifest.names, incoming.sources(manifest), incoming.digests, incoming.threads)
        if not bad:
            return None
        shown = ", ".join(bad[:5]) + (f", ... ({len(bad)} in all)" if len(bad) > 5 else "")
        return (
            f"version {incoming.version} failed its integrity check: the bytes of {shown} differ from "
            "what the sender sent; the model was left as it was"
        )
