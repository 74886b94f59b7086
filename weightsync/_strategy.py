"""How weights are extracted from a source and applied to a model in place.

Internally every source is reduced to one flat mapping ``name -> tensor`` with
dotted names, the names of ``nn.Module.state_dict()``: parameters and
persistent buffers (BatchNorm running statistics travel with the weights).
Both strategies share that mapping, so weights extracted under one apply under
the other; they differ only in the form handed back to the user.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ._exceptions import InvalidWeightsError, WeightMismatchError

__all__ = ["WeightStrategy", "check_same_layout", "describe_mismatch", "flat_weights", "model_tensors"]

StrategyName = Literal["state_dict", "tensordict"]


def _resolve_source(source: Any, context: Any, model_id: str | None) -> Any:
    if source is not None:
        return source
    if context is None:
        raise InvalidWeightsError(
            "weights=None needs a context (or a model given at init) to read the model from",
            model_id=model_id,
        )
    get_model = getattr(context, "get_model", None)
    if get_model is not None:
        return get_model(model_id)
    model = getattr(context, "model", None)
    if model is None:
        raise InvalidWeightsError(
            f"the context {type(context).__name__} has neither get_model() nor .model",
            model_id=model_id,
        )
    return model


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


def _flatten_mapping(
    mapping: Mapping[Any, Any], prefix: str, out: dict[str, torch.Tensor], model_id: str | None
) -> None:
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        # Tensors first: the common case, and a cheaper check than the ABCs.
        if not isinstance(value, torch.Tensor) and isinstance(value, Mapping | TensorDictBase):
            _flatten_mapping(value, name + ".", out, model_id)
        else:
            out[name] = _check_tensor(name, value, model_id)


def flat_weights(source: Any, *, context: Any = None, model_id: str | None = None) -> dict[str, torch.Tensor]:
    """Reduce a weights source to ``{dotted name: detached tensor}``.

    ``source`` may be None (read the model from ``context``), an ``nn.Module``,
    a ``TensorDict`` or a (nested) mapping of tensors.

    :raises InvalidWeightsError: a value is not a dense tensor with data.
    """
    source = _resolve_source(source, context, model_id)
    out: dict[str, torch.Tensor] = {}
    if isinstance(source, nn.Module):
        for name, value in source.state_dict(keep_vars=True).items():
            out[name] = _check_tensor(name, value, model_id)
    elif isinstance(source, TensorDictBase):
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
    return out


def model_tensors(model: Any, *, model_id: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a worker's model that an update writes into, by name.

    Unlike :func:`flat_weights` these are the model's own tensors (parameters
    are not detached), so an in-place copy keeps identity and ``data_ptr()``.
    """
    if isinstance(model, nn.Module):
        return dict(model.state_dict(keep_vars=True))
    if isinstance(model, TensorDictBase):
        return {str(k): v for k, v in model.flatten_keys(".").items()}
    if isinstance(model, Mapping):
        out: dict[str, torch.Tensor] = {}
        _flatten_mapping(model, "", out, model_id)
        return out
    raise InvalidWeightsError(
        f"cannot apply weights to a {type(model).__name__}; "
        "expected nn.Module, TensorDict or a dict of tensors",
        model_id=model_id,
    )


def check_same_layout(
    weights: Mapping[str, torch.Tensor],
    model: Mapping[str, torch.Tensor],
    *,
    model_id: str | None = None,
    where: str = "the model",
) -> None:
    """Raise :class:`WeightMismatchError` unless names, shapes and dtypes match."""
    missing = [n for n in model if n not in weights]
    extra = [n for n in weights if n not in model]
    wrong = [
        f"{n}: {tuple(weights[n].shape)} {weights[n].dtype} vs {tuple(model[n].shape)} {model[n].dtype}"
        for n in weights
        if n in model and (weights[n].shape != model[n].shape or weights[n].dtype != model[n].dtype)
    ]
    if missing or extra or wrong:
        raise WeightMismatchError(describe_mismatch(missing, extra, wrong, where=where), model_id=model_id)


def describe_mismatch(missing: list[str], extra: list[str], wrong: list[str], *, where: str) -> str:
    parts = []
    for label, items in (("missing", missing), ("unexpected", extra), ("mismatched", wrong)):
        if items:
            shown = ", ".join(items[:5]) + (f", ... ({len(items)} in all)" if len(items) > 5 else "")
            parts.append(f"{label}: {shown}")
    return f"weights do not match {where} ({'; '.join(parts)})"


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
        check_same_layout(flat, targets, model_id=model_id)
        if not inplace and isinstance(destination, nn.Module):
            destination.load_state_dict(flat, assign=True)
            return
        names = list(targets)
        with torch.inference_mode():
            torch._foreach_copy_([targets[n] for n in names], [flat[n] for n in names])
