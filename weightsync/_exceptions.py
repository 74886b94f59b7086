"""Exceptions raised by weightsync.

The tree::

    Exception
    ├── WeightSyncError                      every error weightsync raises
    │   ├── WorkerError                      about one or more named workers
    │   │   ├── WorkerLostError              a worker died or its channel closed
    │   │   ├── AckTimeoutError (TimeoutError)
    │   │   │                                no ack before the deadline
    │   │   ├── WorkerApplyError             the worker failed to apply; carries its message
    │   │   └── WorkerProtocolError          the worker's channel carried a message that is
    │   │                                    not the protocol (garbage, another model, an
    │   │                                    ack of a version never sent)
    │   ├── WeightMismatchError (ValueError) names, shapes or dtypes do not match the model
    │   ├── InvalidWeightsError (ValueError) weights that cannot be sent (sparse, meta, not tensors)
    │   ├── UnknownWorkerError (ValueError)  a worker id that the sender does not know
    │   ├── ResourceExhaustedError           out of open files or memory (``resource`` says which)
    │   ├── SenderGroupError                 (a sender group's trainer ranks) a rank did not
    │   │                                    finish the send: it died, stopped or raised
    │   ├── SenderLostError                  (worker side) the sender died or shut down
    │   │   └── SenderClosedError            the sender shut down cleanly (shutdown())
    │   ├── WaitTimeoutError (TimeoutError)  (worker side) an awaited update did not come
    │   ├── DeltaFrameError (ValueError)     (worker side) a delta frame that is damaged, or
    │   │                                    rebuilds other bytes than the trainer's
    │   ├── MissingExtraError (ImportError)  an optional extra that a feature needs is not
    │   │                                    installed (``extra`` names it)
    │   └── WeightSyncStateError (RuntimeError)
    │       │                                lifecycle misuse: use before init, after
    │       │                                shutdown, a send while one is pending
    │       └── BlockingCallError            a blocking call made inside a coroutine, whose
    │                                        event loop it would stall (names what to await)

Every error carries ``model_id``; :class:`WorkerError` also carries
``worker_ids`` and ``failures`` (worker id -> the error for that worker), so a
send that fails on several workers raises one error naming all of them. When
the failures are of different kinds, the error raised is the closest common
class (at worst :class:`WorkerError`).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "AckTimeoutError",
    "BlockingCallError",
    "DeltaFrameError",
    "InvalidWeightsError",
    "MissingExtraError",
    "ResourceExhaustedError",
    "SenderClosedError",
    "SenderGroupError",
    "SenderLostError",
    "UnknownWorkerError",
    "WaitTimeoutError",
    "WeightMismatchError",
    "WeightSyncError",
    "WeightSyncStateError",
    "WorkerApplyError",
    "WorkerError",
    "WorkerLostError",
    "WorkerProtocolError",
]


class WeightSyncError(Exception):
    """Base class of every error raised by weightsync."""

    def __init__(self, message: str, *, model_id: str | None = None) -> None:
        super().__init__(message)
        self.model_id = model_id


class WeightSyncStateError(WeightSyncError, RuntimeError):
    """The lifecycle was misused: a call before init, after shutdown, or while
    another send is pending."""


class BlockingCallError(WeightSyncStateError):
    """A blocking call (``send()``, ``receive()``, ...) was made inside a
    coroutine running on an event loop: it would stall that loop (every
    other task of it) for as long as it waits. Raised before anything is
    done; the message names the coroutine to await instead."""


class WeightMismatchError(WeightSyncError, ValueError):
    """The weights do not match the model (names, shapes or dtypes).

    Raised before any worker or parameter is touched. Raised by a sender,
    ``worker_ids`` lists every worker whose model does not match (empty
    where no worker is known to, e.g. on a worker).
    """

    def __init__(
        self, message: str, *, model_id: str | None = None, worker_ids: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message, model_id=model_id)
        self.worker_ids = worker_ids


class InvalidWeightsError(WeightSyncError, ValueError):
    """The weights cannot be sent: not a tensor, sparse, on the meta device."""


class UnknownWorkerError(WeightSyncError, ValueError):
    """A worker id that the sender does not know. Raised before anything is sent.

    ``unknown_ids`` lists the ids that were not known.
    """

    def __init__(
        self, message: str, *, model_id: str | None = None, unknown_ids: tuple[object, ...] = ()
    ) -> None:
        super().__init__(message, model_id=model_id)
        self.unknown_ids = unknown_ids


class ResourceExhaustedError(WeightSyncError):
    """A resource of this process ran out: ``resource`` is "open files"
    (RLIMIT_NOFILE) or "memory" (RLIMIT_AS, or the host's). Whatever was
    being created is released again; on a worker the sender is told why the
    update was not applied, and the model is untouched."""

    def __init__(self, message: str, *, resource: str, model_id: str | None = None) -> None:
        super().__init__(message, model_id=model_id)
        self.resource = resource


class SenderLostError(WeightSyncError):
    """Raised on a worker when the sender died or shut down its side."""


class SenderGroupError(WeightSyncError):
    """Raised on every trainer rank of a sender group (a sharded trainer,
    each rank sending its own part) when a rank did not finish a send
    within its deadline (it died, was stopped, or raised: ``ranks`` names
    them, and ``reasons`` says what each raised, where known). A worker
    applies a version only once every part of it came: each worker holds
    the version before or this one, never a mix. ``failures`` maps each
    worker the others know failed to its error."""

    def __init__(
        self,
        message: str,
        *,
        ranks: tuple[int, ...] = (),
        reasons: Mapping[int, str] | None = None,
        failures: Mapping[int, WorkerError] | None = None,
        version: int | None = None,
        model_id: str | None = None,
    ) -> None:
        super().__init__(message, model_id=model_id)
        self.ranks = ranks
        self.reasons = dict(reasons or {})
        self.failures = dict(failures or {})
        self.version = version

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_group_error,
            (str(self), self.ranks, self.reasons, self.failures, self.version, self.model_id),
        )


def _rebuild_group_error(
    message: str,
    ranks: tuple[int, ...],
    reasons: Mapping[int, str],
    failures: Mapping[int, WorkerError],
    version: int | None,
    model_id: str | None,
) -> SenderGroupError:
    return SenderGroupError(
        message, ranks=ranks, reasons=reasons, failures=failures, version=version, model_id=model_id
    )


class DeltaFrameError(WeightSyncError, ValueError):
    """A delta frame is damaged, or what it rebuilds is not the trainer's
    version (the receiver did not hold the base it was taken against). The
    receiver's copy is no longer a base; it needs the full bytes."""


class MissingExtraError(WeightSyncError, ImportError):
    """A feature needs an optional extra that is not installed: ``extra`` is
    its name (``pip install 'weightsync[<extra>]'`` installs it) and ``name``
    the module that could not be imported. Raised when the feature is asked
    for (the scheme is created, or the first call that needs it), before
    anything is sent."""

    def __init__(self, message: str, *, extra: str, module: str, model_id: str | None = None) -> None:
        super().__init__(message, model_id=model_id)
        self.extra = extra
        self.name = module


class WaitTimeoutError(WeightSyncError, TimeoutError):
    """Raised on a worker when the update it waits for (e.g. the initial
    weights of ``connect()``) did not come in time. The model is untouched."""


class SenderClosedError(SenderLostError):
    """Raised on a worker when the sender shut down cleanly (``shutdown()``):
    a worker loop may end quietly on it, and treat any other
    :class:`SenderLostError` (the trainer died) as a failure."""


class WorkerError(WeightSyncError):
    """An error about one or more named workers.

    ``worker_ids`` lists the failed workers, ``failures`` maps each to its own
    error, and ``version`` is the version of the send that failed.
    ``advice``, where the likely causes are known, says what to check; it
    ends the message (``reason`` is the message without it).
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int | None = None,
        model_id: str | None = None,
        version: int | None = None,
    ) -> None:
        super().__init__(message, model_id=model_id)
        self.version = version
        self.worker_ids: tuple[int, ...] = () if worker_id is None else (worker_id,)
        self.failures: dict[int, WorkerError] = {} if worker_id is None else {worker_id: self}
        #: What to check, when the likely causes are known (e.g. of a worker
        #: never heard of); it ends the message.
        self.advice = ""
        #: What the failed send did all the same (a ``SendReport`` whose
        #: ``worker_ids`` are the workers that applied the version, with
        #: how its chains carried it), where a sender raised it; else None.
        self.report: Any = None

    @property
    def reason(self) -> str:
        """The message without the advice."""
        return super().__str__()

    def __str__(self) -> str:
        return f"{self.reason}. {self.advice}" if self.advice else self.reason

    @property
    def worker_id(self) -> int | None:
        """The failed worker when exactly one failed, else None."""
        return self.worker_ids[0] if len(self.worker_ids) == 1 else None


class WorkerLostError(WorkerError):
    """A worker died, or its pipe/channel closed.

    ``exit_code`` (it exited with that status) or ``exit_signal`` (a signal
    killed it: 9 is SIGKILL, also the out-of-memory killer's) say why, when
    the sender can tell: the worker is its child, or a process that
    ``multiprocessing`` started from it, or a zombie not yet reaped.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int | None = None,
        model_id: str | None = None,
        version: int | None = None,
        exit_code: int | None = None,
        exit_signal: int | None = None,
    ) -> None:
        super().__init__(message, worker_id=worker_id, model_id=model_id, version=version)
        self.exit_code = exit_code
        self.exit_signal = exit_signal


class AckTimeoutError(WorkerError, TimeoutError):
    """A worker did not acknowledge the send before the deadline."""


class WorkerApplyError(WorkerError):
    """A worker failed to apply the weights; ``worker_message`` is its reason.

    The worker's model is left as it was before the update.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int | None = None,
        model_id: str | None = None,
        version: int | None = None,
        worker_message: str = "",
    ) -> None:
        super().__init__(message, worker_id=worker_id, model_id=model_id, version=version)
        self.worker_message = worker_message


class WorkerProtocolError(WorkerError):
    """A message on a worker's channel broke the protocol: not a message,
    one for another model, or an ack of a version never sent to it. Nothing
    is completed by such a message; the channel stays usable."""


def combine_worker_errors(
    failures: Mapping[int, WorkerError], *, model_id: str | None, version: int | None
) -> WorkerError:
    """One error naming every failed worker.

    A single failure is returned as it is; several become one error of their
    closest common class, with every worker's reason in the message, and
    each distinct ``advice`` of theirs once, at its end.
    """
    for err in failures.values():
        if err.version is None:
            err.version = version  # the transport knew the worker, not the send
    if len(failures) == 1:
        return next(iter(failures.values()))
    classes = [type(err) for err in failures.values()]
    common: type[WorkerError] = WorkerError
    for candidate in classes[0].__mro__:
        if (
            isinstance(candidate, type)
            and issubclass(candidate, WorkerError)
            and all(issubclass(c, candidate) for c in classes)
        ):
            common = candidate
            break
    lines = "; ".join(f"worker {wid}: {err.reason}" for wid, err in sorted(failures.items()))
    message = f"{len(failures)} workers failed (model {model_id!r}, version {version}): {lines}"
    if common is WorkerApplyError:
        combined: WorkerError = WorkerApplyError(message, model_id=model_id, version=version)
    else:
        combined = common(message, model_id=model_id, version=version)
    combined.worker_ids = tuple(sorted(failures))
    combined.failures = dict(sorted(failures.items()))
    combined.advice = " ".join(dict.fromkeys(err.advice for err in failures.values() if err.advice))
    return combined


# What running out of a resource looks like to the OS calls weightsync makes.
_EXHAUSTED = {
    errno.EMFILE: "open files",
    errno.ENFILE: "open files",
    errno.ENOMEM: "memory",
    errno.ENOSPC: "memory",
}


@contextlib.contextmanager
def out_of_resources(what: str) -> Iterator[None]:
    """Turn an OSError that means "out of files or memory", or torch's out
    of GPU memory, raised while doing ``what``, into a
    :class:`ResourceExhaustedError` that says which. Any other error passes
    through."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise ResourceExhaustedError(
            f"cannot {what}: out of GPU memory ({str(exc).splitlines()[0] if str(exc) else exc!r})",
            resource="GPU memory",
        ) from exc
    except OSError as exc:
        resource = _EXHAUSTED.get(exc.errno or 0)
        if resource is None:
            raise
        raise ResourceExhaustedError(
            f"cannot {what}: this process is out of {resource} ({exc.strerror})", resource=resource
        ) from exc


def import_extra(module: str, *, extra: str, needed_by: str, model_id: str | None = None) -> ModuleType:
    """``import module``, a module of the optional extra ``extra`` that
    ``needed_by`` (e.g. "delta=True") needs.

    :raises MissingExtraError: the module cannot be imported; the message
        says how to install the extra.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{needed_by} needs the {extra!r} extra, and {module} cannot be imported ({exc}): "
            f"pip install 'weightsync[{extra}]'",
            extra=extra,
            module=module,
            model_id=model_id,
        ) from exc


# Every error here is public (re-exported by the package): tracebacks and
# reprs name it as users import it, ``weightsync.WorkerLostError``, and a
# pickled one (a worker's error crossing a pipe) is found there too.
for _name in __all__:
    globals()[_name].__module__ = "weightsync"
del _name
