"""Schemes: the configuration of how ONE model is synchronised, and the
entry point that builds each side. One module per scheme family, laid out
like the transports: ``_base`` (``WeightSyncScheme``, the whole public
surface), ``_pipes`` (multiprocess, shared memory, in-process), ``_ray``,
``_distributed`` (torch.distributed), ``_rpc`` (torch.distributed.rpc) and
``_none``; ``_ray_transform``
(the module of a torchrl ``RayModuleTransform``) builds on ``_ray``.
"""

from ._base import WeightSyncScheme, register_with_torchrl
from ._distributed import DistributedWeightSyncScheme
from ._none import NoWeightSyncScheme
from ._pipes import InProcessWeightSyncScheme, MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme
from ._ray import RayWeightSyncMixin, RayWeightSyncScheme
from ._ray_transform import RayModuleTransformScheme
from ._rpc import RPCWeightSyncScheme

__all__ = [
    "DistributedWeightSyncScheme",
    "InProcessWeightSyncScheme",
    "MultiProcessWeightSyncScheme",
    "NoWeightSyncScheme",
    "RPCWeightSyncScheme",
    "RayModuleTransformScheme",
    "RayWeightSyncMixin",
    "RayWeightSyncScheme",
    "SharedMemWeightSyncScheme",
    "WeightSyncScheme",
    "register_with_torchrl",
]
