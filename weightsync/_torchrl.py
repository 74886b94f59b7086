"""torchrl's collectors check ``isinstance(scheme, torchrl.weight_update.WeightSyncScheme)``.

That class is an ABC, so registering weightsync's scheme base with it is
enough. weightsync never imports torchrl on its own: the registration happens
when torchrl is already loaded (each scheme's init and unpickling look), or
when the user asks for it (:func:`register_with_torchrl`).

:func:`is_torchrl_collector` tells a worker whether its context is one of
torchrl's collectors (whose loop never calls ``receive()``), also without
importing torchrl.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_torchrl_collector", "register_with_torchrl"]

_TORCHRL_BASE = "torchrl.weight_update.weight_sync_schemes"
_TORCHRL_COLLECTORS = "torchrl.collectors._base"
_registered: set[type] = set()


def register_with_torchrl(scheme_class: Any, *, load: bool = False) -> bool:
    """Register ``scheme_class`` as a virtual subclass of torchrl's
    ``WeightSyncScheme``. With ``load=False`` only if torchrl is imported
    already. Returns whether it is registered. Idempotent.

    :raises ImportError: ``load=True`` and torchrl is not installed.
    """
    if scheme_class in _registered:
        return True
    module = sys.modules.get(_TORCHRL_BASE)
    if module is None:
        if not load:
            return False
        import importlib

        module = importlib.import_module(_TORCHRL_BASE)
    module.WeightSyncScheme.register(scheme_class)
    _registered.add(scheme_class)
    return True


def is_torchrl_collector(obj: Any) -> bool:
    """Whether ``obj`` is one of torchrl's collectors (an instance of its
    ``BaseCollector``). Imports nothing: such an object exists only in a
    process that imported torchrl's collectors."""
    module = sys.modules.get(_TORCHRL_COLLECTORS)
    base = getattr(module, "BaseCollector", None)
    return isinstance(base, type) and isinstance(obj, base)
