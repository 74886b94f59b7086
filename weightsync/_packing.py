"""The read-and-stage step of a send: the model read into the next packet
(its tensors, laid out once), then cast, staged and digested.

A model whose tensors stay put is neither read nor laid out again from send
to send: the sender keeps its last read and what was derived from it (the
manifest, the tensors in manifest order), and the staging keeps its copy
plan for that very list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ._copy import WireCast, usable_cores
from ._digest import digests
from ._exceptions import WeightMismatchError
from ._memory._placement import Placement, devices_of, on_gpu
from ._packet import Manifest, Packet, signature_of
from ._reads import ModuleReads
from ._transports._base import Staging

__all__ = ["Keys", "Packer"]

#: Which weights a partial send takes: names, or a test on names.
Keys = Iterable[str] | Callable[[str], bool]


class Packer:
    """Makes the packets of one model's sends."""

    def __init__(self, model_id: str | None, context: Any, wire: WireCast | None) -> None:
        self.model_id = model_id
        self.context = context
        self._wire = wire
        self._manifests: dict[Any, Manifest] = {}
        self._reads = ModuleReads()
        self._derived: (
            tuple[dict[str, torch.Tensor], Manifest, list[torch.Tensor], tuple[str, ...]] | None
        ) = None

    def packet(
        self,
        version: int,
        weights: Any,
        *,
        fanout: int = 1,
        keys: Keys | None = None,
        partial: bool = False,
        stream: Any = None,
    ) -> Packet:
        """``weights`` (None: the context's model) as the packet of
        ``version``: all of them, or (``keys``) those named. ``stream``:
        the caller's CUDA stream (``_placement.caller_stream``), kept only
        where the weights are on a GPU.

        :raises InvalidWeightsError: the weights hold something unsendable.
        :raises WeightMismatchError: ``keys`` names something the weights lack.
        :raises ValueError: ``keys`` selects nothing.
        """
        tensors = self._reads.read(weights, context=self.context, model_id=self.model_id)
        if keys is not None:
            tensors = self._select(tensors, keys)
            partial = True
        derived = self._derived
        if derived is None or derived[0] is not tensors:
            manifest = self._manifest(tensors)
            ordered = manifest.ordered(tensors)
            derived = (tensors, manifest, ordered, devices_of(ordered))
            # The same list, send after send, lets the staging keep its copy
            # plan: kept for a module's read (it aliases the module), never
            # for weights the caller made for this send (kept, they would
            # live until the next one).
            self._derived = derived if self._reads.kept(tensors) else None
        stream = stream if stream is not None and on_gpu(derived[3]) else None
        return Packet(
            version,
            derived[1],
            derived[2],
            fanout,
            partial,
            devices=derived[3],
            stream=stream,
            reused=self._derived is derived,
        )

    def _manifest(self, tensors: Mapping[str, torch.Tensor]) -> Manifest:
        key = signature = signature_of(tensors)
        manifest = self._manifests.get(key)
        if manifest is None:
            if self._wire is not None:
                # What the workers get: float32 weights as the wire dtype.
                wire = str(self._wire.dtype).removeprefix("torch.")
                signature = tuple((n, wire if d == "float32" else d, s) for n, d, s in signature)
            manifest = self._manifests[key] = Manifest.from_signature(signature)
        return manifest

    def _select(self, tensors: dict[str, torch.Tensor], keys: Keys) -> dict[str, torch.Tensor]:
        if callable(keys):
            chosen = {name: t for name, t in tensors.items() if keys(name)}
        else:
            names = [keys] if isinstance(keys, str) else list(keys)
            unknown = [n for n in names if n not in tensors]
            if unknown:
                valid = list(tensors)
                shown = ", ".join(valid[:20]) + (f", ... ({len(valid)} in all)" if len(valid) > 20 else "")
                raise WeightMismatchError(
                    f"keys= names {', '.join(map(repr, unknown))}, which the weights of model "
                    f"{self.model_id!r} do not hold; they hold: {shown}",
                    model_id=self.model_id,
                )
            chosen = {name: tensors[name] for name in names}
        if not chosen:
            raise ValueError(f"keys= selects no weight of model {self.model_id!r}: nothing to send")
        return chosen

    def stage(
        self,
        packet: Packet,
        staging: Staging | None,
        verify: bool,
        placements: Mapping[int, Placement],
    ) -> Packet:
        """Cast (to the wire dtype), stage and (``verify``) digest
        ``packet``, blocking for the copies: the packet as staged, with its
        digests and without the caller's tensors, which are no longer read.

        :raises ResourceExhaustedError: out of memory or descriptors for the staging.
        :raises InvalidWeightsError: a verified send's staged bytes differ from the weights.
        """
        sums: tuple[int, ...] | None = None
        if self._wire is not None:
            # Cast once, here: every staging then moves the cast bytes.
            cast = self._wire.cast(packet.tensors, usable_cores(), packet.stream, keep=packet.reused)
            packet = packet._replace(tensors=cast)
        if staging is not None:
            # A staging digests what it stages, each block as it is copied.
            sums = staging.write(packet, verify, placements)
        if verify and sums is None:
            sums = digests(packet.tensors, usable_cores())
        return packet.staged(sums if verify else None)
