"""Retries of collective writes: transient I/O errors again with backoff, everything else not.

The decision is collective: each rank reports how its attempt ended (ok, transient, permanent), the
ranks all-reduce the worst outcome, and all of them retry or give up together. The caller gives each
attempt a fresh staging location, so no two attempts ever write at the same place.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, TypeVar

import tenacity

from tierstack.checkpointing import errors
from tierstack.runtime import collectives as _dist
from tierstack.runtime.failures import interrupts

log = logging.getLogger(__name__)

T = TypeVar("T")

# Re-exported: the classification lives in errors.py (root cause through every wrapping layer).
TRANSIENT_ERRNOS = errors.TRANSIENT_ERRNOS
OK, REMOTE, TRANSIENT, PERMANENT = errors.OK, errors.REMOTE, errors.TRANSIENT, errors.PERMANENT
classify = errors.classify


class SaveAttemptFailed(Exception):
    """An attempt failed on at least one rank; raised on every rank with the agreed outcome.

    ``causes`` holds, per rank, the root cause it saw (None where that rank only saw another
    rank's failure), so the message every rank logs names the rank, the path and the errno.
    """

    def __init__(self, outcome: int, local_error: Optional[BaseException], causes: Optional[list] = None):
        self.outcome = outcome
        self.local_error = local_error
        self.causes = list(causes or [])
        kind = errors.NAMES.get(outcome, "permanent")
        where = "; ".join(f"rank {r}: {c}" for r, c in enumerate(self.causes) if c)
        if not where:
            where = f"here: {errors.describe(local_error)}" if local_error is not None else "on another rank"
        super().__init__(f"{kind} failure {where}")

    @property
    def transient(self) -> bool:
        return self.outcome == TRANSIENT


def _is_collective_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(exc, (dist.DistError, errors.CollectiveFailure))


def agree(local_error: Optional[BaseException], reduce_max: Callable[[int], int] = _dist.all_reduce_max) -> None:
    """Collective: raise :class:`SaveAttemptFailed` on every rank if any rank failed.

    Raises:
        SaveAttemptFailed: the worst outcome over ranks (REMOTE alone counts as permanent).
        CollectiveFailure: the agreement itself failed (a rank is gone or hung).
    """
    mine = classify(local_error)
    try:
        outcome = reduce_max(mine)
        if outcome == OK:
            return
        # A second collective, on the failure path only: every rank learns every rank's cause.
        inner = isinstance(local_error, SaveAttemptFailed)  # agreed by an inner step: causes known
        detail = errors.describe(local_error) if mine not in (OK, REMOTE) and not inner else None
        causes = _dist.all_gather_object(detail) if reduce_max is _dist.all_reduce_max else [detail]
        if inner and not any(causes):
            causes = local_error.causes
    except Exception as e:  # noqa: BLE001 - a broken collective is fatal, whatever torch calls it
        raise errors.CollectiveFailure(f"checkpoint agreement failed ({e}); a rank is gone or hung") from e
    raise SaveAttemptFailed(PERMANENT if outcome == REMOTE else outcome, local_error, causes)


def _capture(fn: Callable[[], T]) -> tuple[Optional[T], Optional[BaseException]]:
    """Run ``fn``; return ``(result, None)`` or ``(None, error)``. A broken collective inside ``fn``
    is re-raised as :class:`CollectiveFailure`: agreeing over a broken group would hang or lie."""
    try:
        return fn(), None
    except BaseException as e:
        if interrupts(e):  # Ctrl-C, an in-process restart's interruption: not this save's failure
            raise  # noqa: BLE001 - torch's CheckpointException derives from BaseException
        if _is_collective_error(e):
            if isinstance(e, errors.CollectiveFailure):
                raise
            raise errors.CollectiveFailure(f"checkpoint collective failed ({e}); a rank is gone or hung") from e
        return None, e


def run_agreed(fn: Callable[[], T]) -> T:
    """Collective: run a rank-local piece of a save, then make every rank agree on how it ended.

    Returns:
        What ``fn`` returned on this rank (when it succeeded on every rank).

    Raises:
        SaveAttemptFailed: on every rank, when ``fn`` raised on any rank.
        CollectiveFailure: a collective inside ``fn`` or the agreement failed or timed out.
    """
    result, err = _capture(fn)
    agree(err)
    return result  # type: ignore[return-value]


def run_attempts(
    attempt: Callable[[int], T],
    *,
    attempts: int,
    backoff_s: float,
    on_failure: Callable[[int, SaveAttemptFailed], None] = lambda n, e: None,
    reduce_max: Callable[[int], int] = _dist.all_reduce_max,
    sleep: Callable[[float], None] = tenacity.nap.sleep,
) -> T:
    """Run ``attempt(n)`` (n = 1, 2, ...) until it succeeds on every rank.

    ``attempt`` returns normally or raises; either way the ranks agree on the outcome. A transient
    failure is retried after ``backoff_s * 2**(n-1)`` seconds, at most ``attempts`` attempts in all;
    ``on_failure(n, exc)`` runs on every rank after each failed attempt (remove its staging files).

    Raises:
        SaveAttemptFailed: the last failure, on every rank, when no attempt succeeded.
    """

    def one(n: int) -> T:
        result, error = _capture(lambda: attempt(n))
        try:
            agree(error, reduce_max)
        except SaveAttemptFailed as failed:
            on_failure(n, failed)
            if not failed.transient:
                log.error("checkpoint attempt %d failed (%s); not retried", n, failed)
            elif n >= attempts:
                log.error("checkpoint attempt %d of %d failed (%s); no attempts left", n, attempts, failed)
            raise
        if n > 1:
            log.warning("checkpoint attempt %d succeeded after %d failed attempt(s)", n, n - 1)
        return result  # type: ignore[return-value]

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(max(1, attempts)),
        wait=tenacity.wait_exponential(multiplier=backoff_s, min=0, max=max(backoff_s, 1e-9) * 64),
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, SaveAttemptFailed) and e.transient),
        sleep=sleep,
        reraise=True,
        before_sleep=lambda rs: log.warning(
            "checkpoint attempt %d failed (%s); retrying in %.1fs",
            rs.attempt_number, rs.outcome.exception(), rs.next_action.sleep if rs.next_action else 0.0,
        ),
    )
    counter = {"n": 0}

    def wrapped() -> T:
        counter["n"] += 1
        return one(counter["n"])

    return retrying(wrapped)
