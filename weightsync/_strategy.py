"""How weights are extracted from a source and applied to a model in place.

Internally every source is reduced to one flat mapping ``name -> tensor`` with
dotted names, the names of ``nn.Module.state_dict()``: parameters and
persistent buffers (BatchNorm running statistics travel with the weights).
Both strategies share that mapping, so weights extracted under one apply under
the other; they differ only in the form handed back to the user.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from ._exceptions import InvalidWeightsError
from ._packet import Manifest

if TYPE_CHECKING:
    from tensordict import TensorDictBase

__all__ = [
    "is_dtensor",
    "refuse_sharded",
    "resolve_source",
    "WeightStrategy",
    "checked_read",
    "flat_weights",
    "is_tensordict",
    "materialize",
    "model_of",
    "model_tensors",
    "values_of",
]

StrategyName = Literal["state_dict", "tensordict"]


def is_tensordict(obj: Any) -> bool:
    """Whether ``obj`` is a ``TensorDict`` (any ``TensorDictBase``).

    tensordict is imported only by whoever builds a TensorDict (it costs
    seconds, as it imports ``torch._dynamo``), so where it was never imported
    nothing can be one, and the check imports nothing.
    """
    tensordict = sys.modules.get("tensordict")
    return tensordict is not None and isinstance(obj, tensordict.TensorDictBase)


def _attribute_path(context: Any, path: str) -> Any | None:
    """``context.a.b`` for ``path='a.b'``, or None where a link is missing."""
    obj = context
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def model_of(context: Any, model_id: str | None) -> Any | None:
    """The model a context (e.g. a collector) holds for ``model_id``, looked
    up as torchrl's schemes look it up: its ``get_model(model_id)``, else its
    ``model`` attribute, else the attribute named by ``model_id`` (a dotted
    path such as ``"policy"`` or ``"env.value_net"``); None if none holds
    one. An error raised by ``get_model`` propagates."""
    if context is None:
        return None
    get_model = getattr(context, "get_model", None)
    if callable(get_model):
        model = get_model(model_id)
        if model is not None:
            return model
    model = getattr(context, "model", None)
    if model is None and model_id:
        model = _attribute_path(context, model_id)
    return model


def resolve_source(source: Any, context: Any, model_id: str | None) -> Any:
    if source is not None:
        return source
    if context is None:
        raise InvalidWeightsError(
            "weights=None needs a context (or a model given at init) to read the model from",
            model_id=model_id,
        )
    model = model_of(context, model_id)
    if model is None:
        raise InvalidWeightsError(
            f"the context {type(context).__name__} holds no model {model_id!r}: it has no "
            f"get_model() that returns one, no .model and no attribute {model_id!r}",
            model_id=model_id,
        )
    return model


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (one rank's
    shard of a tensor sharded over a device mesh: FSDP2's ``fully_shard``,
    tensor parallelism). Never imports torch.distributed: where it is not
    imported, no DTensor exists."""
    if type(value) is torch.Tensor or type(value) is nn.Parameter:
        return False  # (the common case, in two pointer compares)
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(value, dtensor)


def values_of(source: Any) -> dict[str, Any]:
    """The values of a module's state dict, a TensorDict or a nested
    mapping, by dotted name, as they are (DTensors too; nothing checked)."""
    return _values(source)


def _values(source: Any, prefix: str = "") -> dict[str, Any]:
    """The values of a module's state dict, a TensorDict or a nested
    mapping, by dotted name, as they are (nothing checked)."""
    if isinstance(source, nn.Module):
        return dict(source.state_dict(keep_vars=True))
    if is_tensordict(source):
        return {str(k): v for k, v in source.flatten_keys(".").items()}
    out: dict[str, Any] = {}
    if isinstance(source, Mapping):
        for key, value in source.items():
            if not isinstance(value, torch.Tensor) and (isinstance(value, Mapping) or is_tensordict(value)):
                out.update(_values(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
    return out


def refuse_sharded(source: Any, model_id: str | None, *, side: str, flat: bool = False) -> None:
    """Refuse weights (a module, a TensorDict, a mapping of tensors; anything
    else passes) that hold DTensors, naming them: a DTensor's storage holds
    one rank's shard, never the global tensor its shape describes, so
    reading it as a whole one would copy out of bounds. ``side`` says whose
    they are ("the trainer's" or "the worker's"); ``flat``: ``source`` is
    a flat dict of tensors already (a read of the weights).

    :raises InvalidWeightsError: a value is a DTensor.
    """
    tensors = source if flat else _values(source)
    sharded = [name for name, value in tensors.items() if is_dtensor(value)]
    if not sharded:
        return
    first = tensors[sharded[0]]
    shown = ", ".join(sharded[:3]) + (f", ... ({len(sharded)} in all)" if len(sharded) > 3 else "")
    raise InvalidWeightsError(
        f"{side} weights of model {model_id!r} are sharded: {shown} are DTensors (FSDP2's fully_shard or "
        f"tensor parallelism; {sharded[0]!r} is {tuple(first.shape)} over placements "
        f"{tuple(first.placements)}), and this rank holds only its shard of each. "
        "DistributedWeightSyncScheme sends a sharded trainer's model from every rank, each its own "
        "part (init_on_sender and send() on every rank); this scheme sends from one process: gather "
        "the weights first, on every rank of the mesh (full = {name: t.full_tensor() for name, t in "
        "model.state_dict().items()}), and send them from one rank (send(full)). A worker gets a model "
        "of whole tensors",
        model_id=model_id,
    )


def _check_tensor(name: str, value: Any, model_id: str | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidWeightsError(
            f"weight {name!r} is a {type(value).__name__}, not a tensor", model_id=model_id
        )
    if value.layout != torch.strided:
        raise InvalidWeightsError(
            f"weight {name!r} has layout {value.layout}; only dense (strided) tensors can be sent",
            model_id=model_id,
        )
    if value.is_meta:
        raise InvalidWeightsError(
            f"weight {name!r} is on the meta device and holds no data", model_id=model_id
        )
    return value.detach()


def checked_read(live: Mapping[str, Any], model_id: str | None) -> dict[str, torch.Tensor]:
    """A module's ``state_dict(keep_vars=True)``, each value checked and detached."""
    return {name: _check_tensor(name, value, model_id) for name, value in live.items()}


def _flatten_mapping(
    mapping: Mapping[Any, Any],
    prefix: str,
    out: dict[str, torch.Tensor],
    model_id: str | None,
    *,
    detach: bool = True,
) -> None:
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        # Tensors first: the common case, and a cheaper check than the ABCs.
        if not isinstance(value, torch.Tensor) and (isinstance(value, Mapping) or is_tensordict(value)):
            _flatten_mapping(value, name + ".", out, model_id, detach=detach)
        else:
            checked = _check_tensor(name, value, model_id)
            out[name] = checked if detach else value


def flat_weights(source: Any, *, context: Any = None, model_id: str | None = None) -> dict[str, torch.Tensor]:
    """Reduce a weights source to ``{dotted name: detached tensor}``.

    ``source`` may be None (read the model from ``context``), an ``nn.Module``,
    a ``TensorDict`` or a (nested) mapping of tensors.

    :raises InvalidWeightsError: a value is not a dense tensor with data.
    """
    source = resolve_source(source, context, model_id)
    out: dict[str, torch.Tensor] = {}
    if isinstance(source, nn.Module):
        out = checked_read(source.state_dict(keep_vars=True), model_id)
    elif is_tensordict(source):
        for name, value in source.flatten_keys(".").items():
            out[name] = _check_tensor(str(name), value, model_id)
    elif isinstance(source, Mapping):
        _flatten_mapping(source, "", out, model_id)
    else:
        raise InvalidWeightsError(
            f"cannot read weights from a {type(source).__name__}; "
            "expected None, nn.Module, TensorDict or a dict of tensors",
            model_id=model_id,
        )
    refuse_sharded(out, model_id, side="the trainer's", flat=True)
    return out


def model_tensors(model: Any, *, model_id: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a worker's model that an update writes into, by name.

    Unlike :func:`flat_weights` these are the model's own tensors (parameters
    are not detached), so an in-place copy keeps identity and ``data_ptr()``.
    A DTensor (a tensor-parallel worker's, whose scheme took it) is its
    local shard, the storage this process holds.
    """
    tensors = _model_tensors(model, model_id)
    if any(is_dtensor(t) for t in tensors.values()):
        # (Outside autograd, to_local() is the DTensor's own local tensor.)
        with torch.no_grad():
            return {name: t.to_local() if is_dtensor(t) else t for name, t in tensors.items()}  # type: ignore[attr-defined]
    return tensors


def _model_tensors(model: Any, model_id: str | None) -> dict[str, torch.Tensor]:
    if isinstance(model, nn.Module):
        return dict(model.state_dict(keep_vars=True))
    if is_tensordict(model):
        return {str(k): v for k, v in model.flatten_keys(".").items()}
    if isinstance(model, Mapping):
        out: dict[str, torch.Tensor] = {}
        # The tensors themselves, not detached aliases: an update that
        # re-points a tensor (``tensor.data = ...``) must reach the mapping.
        _flatten_mapping(model, "", out, model_id, detach=False)
        return out
    raise InvalidWeightsError(
        f"cannot apply weights to a {type(model).__name__}; "
        "expected nn.Module, TensorDict or a dict of tensors",
        model_id=model_id,
    )


def materialize(model: Any, device: torch.device) -> bool:
    """Give every tensor of ``model`` that is on the meta device (a model
    built without storage) empty storage on ``device``. Returns whether any
    was. The contents are undefined until an update is copied in.

    A module's meta parameter is replaced by a new ``nn.Parameter`` (torch
    cannot move a tensor off the meta device in place); its other tensors
    are left alone.
    """
    changed = False
    if isinstance(model, nn.Module):
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    empty = torch.empty_like(param, device=device)
                    module._parameters[name] = nn.Parameter(empty, requires_grad=param.requires_grad)
                    changed = True
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device=device)
                    changed = True
    elif is_tensordict(model):
        for key, value in list(model.items(include_nested=True, leaves_only=True)):
            if isinstance(value, torch.Tensor) and value.is_meta:
                model.set(key, torch.empty_like(value, device=device))
                changed = True
    elif isinstance(model, Mapping):
        for key, value in list(model.items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                model[key] = torch.empty_like(value, device=device)  # type: ignore[index]
                changed = True
            elif isinstance(value, Mapping) or is_tensordict(value):
                changed = materialize(value, device) or changed
    return changed


class WeightStrategy:
    """Extract weights from a source and apply them to a model in place.

    ``WeightStrategy('state_dict')`` hands weights back as a ``dict`` of
    tensors, ``WeightStrategy('tensordict')`` as a nested ``TensorDict``; both
    read the same names, so weights extracted under one apply under the other.
    """

    def __init__(self, extract_as: StrategyName = "tensordict") -> None:
        if extract_as not in ("state_dict", "tensordict"):
            raise ValueError(f"unknown strategy {extract_as!r}; expected 'state_dict' or 'tensordict'")
        self.extract_as: StrategyName = extract_as

    def __repr__(self) -> str:
        return f"WeightStrategy({self.extract_as!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WeightStrategy) and other.extract_as == self.extract_as

    def __hash__(self) -> int:
        return hash(self.extract_as)

    def extract_weights(
        self, source: Any = None, *, context: Any = None, model_id: str | None = None
    ) -> dict[str, torch.Tensor] | TensorDictBase:
        """Read the weights of ``source`` (None: the context's model).

        Returns detached tensors that share memory with the source: nothing is
        copied here.

        :raises InvalidWeightsError: the source holds something that is not a
            dense tensor with data.
        """
        flat = flat_weights(source, context=context, model_id=model_id)
        if self.extract_as == "state_dict":
            return flat
        from tensordict import TensorDict  # only this strategy needs it

        return TensorDict(flat, batch_size=[]).unflatten_keys(".")

    def apply_weights(
        self, destination: Any, weights: Any, *, inplace: bool = True, model_id: str | None = None
    ) -> None:
        """Copy ``weights`` into ``destination``.

        With ``inplace=True`` every tensor of the destination keeps its
        identity and its ``data_ptr()``. Names, shapes and dtypes are checked
        for every tensor before the first one is written, so a mismatch leaves
        the destination untouched. With ``inplace=False`` an ``nn.Module``
        takes the new tensors themselves (``load_state_dict(assign=True)``).

        :raises WeightMismatchError: names, shapes or dtypes differ.
        """
        flat = flat_weights(weights, model_id=model_id)
        targets = model_tensors(destination, model_id=model_id)
        Manifest.of(flat).check_matches(Manifest.of(targets), model_id=model_id, where="the model")
        if not inplace and isinstance(destination, nn.Module):
            destination.load_state_dict(flat, assign=True)
            return
        names = list(targets)
        with torch.inference_mode():
            torch._foreach_copy_([targets[n] for n in names], [flat[n] for n in names])
