"""How a sender group's send ends: each trainer rank's outcome, and the one
report or error every rank returns (:func:`merge`), the same on every rank
that read the same outcomes. Pure: the exchange of outcomes is the
transport's (``_transports._distributed._group.SenderGroup``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection

from ._exceptions import (
    AckTimeoutError,
    InvalidWeightsError,
    SenderGroupError,
    WeightMismatchError,
    WeightSyncError,
    WorkerError,
    combine_worker_errors,
)
from ._send import ChainReport, SendReport

__all__ = ["Outcome", "combine", "merge"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one rank's send ``seq`` ended: its report, or the workers that
    failed (their errors), or what else it raised (``error``)."""

    rank: int
    seq: int
    report: SendReport | None = None
    failures: dict[int, WorkerError] = dataclasses.field(default_factory=dict)
    version: int | None = None
    error: str | None = None
    #: What it refused before anything moved (weights that do not fit a
    #: worker, or cannot be sent): every rank raises rank 0's.
    refused: WeightSyncError | None = None


def _joined(reports: list[SendReport]) -> SendReport:
    """Sends of one version (a rank's to each class of workers, or every
    rank's) as one report: every worker acked in any, the bytes of all, the
    time of the slowest."""
    first = reports[0]
    chains = [r.chain for r in reports if r.chain is not None]
    chain = functools.reduce(ChainReport.joined, chains) if chains else None
    return dataclasses.replace(
        first,
        placements={w: p for r in reports for w, p in r.placements.items()},
        worker_bytes={w: n for r in reports for w, n in r.worker_bytes.items()},
        chain=chain,
        worker_ids=tuple(sorted({w for r in reports for w in r.worker_ids})),
        nbytes=sum(r.nbytes for r in reports),
        seconds=max(r.seconds for r in reports),
        staged_seconds=max(r.staged_seconds for r in reports),
        announce_seconds=max(r.announce_seconds for r in reports),
    )


def combine(rank: int, seq: int, results: list[SendReport | Exception]) -> Outcome:
    """Rank ``rank``'s outcome of send ``seq``, from what each of its sends
    (one per class of workers) returned or raised."""
    reports = [r for r in results if isinstance(r, SendReport)]
    failures: dict[int, WorkerError] = {}
    errors = []
    refused: WeightSyncError | None = None
    for result in results:
        if isinstance(result, WorkerError):
            for wid, error in (dict(result.failures) or dict.fromkeys(result.worker_ids, result)).items():
                failures[wid] = error
        elif isinstance(result, WeightMismatchError | InvalidWeightsError):
            refused = refused or result
            errors.append(f"{type(result).__name__}: {result}")
        elif isinstance(result, Exception):
            errors.append(f"{type(result).__name__}: {result}")
    versions = [r.version for r in reports] + [
        e.version for e in results if isinstance(e, WorkerError) and e.version is not None
    ]
    return Outcome(
        rank,
        seq,
        report=_joined(reports) if reports and not failures and not errors else None,
        failures=failures,
        version=max(versions) if versions else None,
        error="; ".join(errors) or None,
        refused=refused if len(errors) == len(results) else None,
    )


def _prefer(a: WorkerError, b: WorkerError) -> WorkerError:
    """Of two ranks' errors for one worker, the one that says more: a
    death or a failure to apply over a missed deadline; of two missed
    deadlines, the one that says where a chain broke."""
    if isinstance(a, AckTimeoutError) and not isinstance(b, AckTimeoutError):
        return b
    if isinstance(a, AckTimeoutError) and isinstance(b, AckTimeoutError):
        return b if "chain broke" in str(b) and "chain broke" not in str(a) else a
    return a


def merge(
    outcomes: dict[int, Outcome],
    size: int,
    seq: int,
    model_id: str | None,
    dead: Collection[int] = (),
) -> SendReport:
    """The one result of send ``seq`` over ``size`` ranks, the same on every
    rank that has the same ``outcomes`` (by rank; a rank missing did not
    publish one in time, or was found ``dead``: its process is gone).

    :raises SenderGroupError: a rank is missing, or raised something other
        than a worker's error.
    :raises WorkerError: workers failed (every rank's failures, each worker
        named once, with the error that says most).
    """
    failures: dict[int, WorkerError] = {}
    for rank in sorted(outcomes):
        for wid, error in outcomes[rank].failures.items():
            failures[wid] = error if wid not in failures else _prefer(failures[wid], error)
    versions = [o.version for o in outcomes.values() if o.version is not None]
    version = max(versions) if versions else None
    missing = tuple(r for r in range(size) if r not in outcomes)
    refusals = [o.refused for _, o in sorted(outcomes.items()) if o.refused is not None]
    if not missing and len(refusals) == size and len({type(r) for r in refusals}) == 1:
        # Refused alike by every rank, before anything moved.
        raise refusals[0]
    raised = {r: o.error for r, o in sorted(outcomes.items()) if o.error is not None}
    if len({o.version for o in outcomes.values() if o.report is not None}) > 1:
        raised.update(
            {
                r: f"a report of version {o.report.version}"
                for r, o in outcomes.items()
                if o.report is not None
            }
        )
    if missing or raised:
        said = [
            f"rank {r} died during it (its process is gone)"
            if r in dead
            else f"rank {r} did not finish it in time (it died, was stopped or interrupted)"
            for r in missing
        ]
        said += [f"rank {r} raised {why}" for r, why in raised.items()]
        workers = (
            f"; workers that failed: {', '.join(f'{w}: {e}' for w, e in sorted(failures.items()))}"
            if failures
            else ""
        )
        raise SenderGroupError(
            f"send {seq} of model {model_id!r} by a sender group of {size} trainer ranks failed: "
            f"{'; '.join(said)}. A worker applies a version only once every rank's part came: each holds "
            f"version {version} or the one before{workers}",
            ranks=tuple(sorted(set(missing) | set(raised))),
            reasons=raised,
            failures=failures,
            version=version,
            model_id=model_id,
        )
    if failures:
        raise combine_worker_errors(failures, model_id=model_id, version=version)
    return _joined([o.report for _, o in sorted(outcomes.items()) if o.report is not None])
