"""weightsync: move model weights from a trainer to its workers, and know they
were applied.

Importing weightsync has no side effects and never imports ray. The layers,
what a transport implements and how blocking calls enter the event loop are
described in ``docs/architecture.md``.
"""

# Delta codec (what delta=True sends; lazy: blosc2 and xxhash are imported on first use)
from ._delta import DeltaDecoder, DeltaEncoder, version_digest

# Errors
from ._exceptions import (
    AckTimeoutError,
    DeltaFrameError,
    InvalidWeightsError,
    MissingExtraError,
    ResourceExhaustedError,
    SenderClosedError,
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
from ._facade import WeightReceiver, WeightSender

# Legacy updaters
from ._legacy import MultiProcessedRemoteWeightUpdate, RemoteWeightUpdaterBase

# Packets
from ._packet import Manifest, Packet, TensorSpec

# Async core
from ._receiver import AsyncWeightReceiver
from ._sender import DEFAULT_TIMEOUT, AsyncWeightSender, PendingSend, SendReport

# Strategies
from ._strategy import WeightStrategy

# Schemes
from .schemes import (
    DistributedWeightSyncScheme,
    InProcessWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    NoWeightSyncScheme,
    RayWeightSyncMixin,
    RayWeightSyncScheme,
    SharedMemWeightSyncScheme,
    WeightSyncScheme,
    register_with_torchrl,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "AckTimeoutError",
    "AsyncWeightReceiver",
    "AsyncWeightSender",
    "DeltaDecoder",
    "DeltaEncoder",
    "DeltaFrameError",
    "DistributedWeightSyncScheme",
    "InProcessWeightSyncScheme",
    "InvalidWeightsError",
    "Manifest",
    "MissingExtraError",
    "MultiProcessWeightSyncScheme",
    "MultiProcessedRemoteWeightUpdate",
    "NoWeightSyncScheme",
    "Packet",
    "PendingSend",
    "RayWeightSyncMixin",
    "RayWeightSyncScheme",
    "RemoteWeightUpdaterBase",
    "ResourceExhaustedError",
    "SendReport",
    "SenderClosedError",
    "SenderLostError",
    "SharedMemWeightSyncScheme",
    "TensorSpec",
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
    "version_digest",
]
