"""weightsync: move model weights from a trainer to its workers, and know they
were applied.

Importing weightsync has no side effects and never imports ray. The layers,
what a transport implements and how blocking calls enter the event loop are
described in ``docs/architecture.md``.
"""

# Errors
from ._exceptions import (
    AckTimeoutError,
    BlockingCallError,
    DeltaFrameError,
    InvalidWeightsError,
    MissingExtraError,
    ResourceExhaustedError,
    SenderClosedError,
    SenderGroupError,
    SenderLostError,
    UnknownWorkerError,
    WaitTimeoutError,
    WeightMismatchError,
    WeightSyncError,
    WeightSyncStateError,
    WorkerApplyError,
    WorkerError,
    WorkerLostError,
    WorkerProtocolError,
)

# Sync facade
from ._facade import SendHandle, WeightReceiver, WeightSender

# Legacy updaters
from ._legacy import MultiProcessedRemoteWeightUpdate, RemoteWeightUpdaterBase

# Async core
from ._receiver import AsyncWeightReceiver
from ._sender import DEFAULT_TIMEOUT, AsyncWeightSender, ChainReport, PendingSend, SendReport

# Strategies
from ._strategy import WeightStrategy

# Schemes
from .schemes import (
    DistributedWeightSyncScheme,
    InProcessWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    NoWeightSyncScheme,
    RayModuleTransformScheme,
    RayWeightSyncMixin,
    RayWeightSyncScheme,
    RPCWeightSyncScheme,
    SharedMemWeightSyncScheme,
    WeightSyncScheme,
    register_with_torchrl,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "AckTimeoutError",
    "BlockingCallError",
    "ChainReport",
    "AsyncWeightReceiver",
    "AsyncWeightSender",
    "DeltaFrameError",
    "DistributedWeightSyncScheme",
    "InProcessWeightSyncScheme",
    "InvalidWeightsError",
    "MissingExtraError",
    "MultiProcessWeightSyncScheme",
    "MultiProcessedRemoteWeightUpdate",
    "NoWeightSyncScheme",
    "PendingSend",
    "RPCWeightSyncScheme",
    "RayModuleTransformScheme",
    "RayWeightSyncMixin",
    "RayWeightSyncScheme",
    "RemoteWeightUpdaterBase",
    "ResourceExhaustedError",
    "SendHandle",
    "SendReport",
    "SenderClosedError",
    "SenderGroupError",
    "SenderLostError",
    "SharedMemWeightSyncScheme",
    "UnknownWorkerError",
    "WaitTimeoutError",
    "WeightMismatchError",
    "WeightReceiver",
    "WeightSender",
    "WeightStrategy",
    "WeightSyncError",
    "WeightSyncScheme",
    "WeightSyncStateError",
    "WorkerApplyError",
    "WorkerError",
    "WorkerLostError",
    "WorkerProtocolError",
    "__version__",
    "register_with_torchrl",
]
