"""Retries of collective writes: transient I/O errors again with backoff, everything else not.

The decision is collective: each rank reports how its attempt ended (ok, transient, permanent), the
ranks all-reduce the worst outcome, and all of them retry or give up together. The caller gives each
attempt a fresh staging location, so no two attempts ever write at the same place.
"""

from __future__ import annotations

import errno
import logging
from typing import Callable, Optional, TypeVar

import tenacity

from tierstack.runtime import collectives as _dist

log = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ESTALE, errno.EBUSY, errno.ECONNRESET, errno.EINTR}
)
OK, TRANSIENT, PERMANENT = 0, 1, 2


def _chain(exc: BaseException):
    """The exception, its causes and contexts, and failures wrapped by torch's CheckpointException."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.CheckpointException
        if isinstance(failures, dict):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]


def classify(exc: Optional[BaseException]) -> int:
    """OK for None; TRANSIENT when an OSError with a transient errno is anywhere in the chain and no
    permanent OSError is; PERMANENT otherwise (EACCES, EROFS, ENOSPC, a bug like TypeError)."""
    if exc is None:
        return OK
    if isinstance(exc, SaveAttemptFailed):  # already agreed on by an inner step
        return exc.outcome
    errnos = [e.errno for e in _chain(exc) if isinstance(e, OSError) and e.errno is not None]
    if errnos and all(n in TRANSIENT_ERRNOS for n in errnos):
        return TRANSIENT
    return PERMANENT


class SaveAttemptFailed(Exception):
    """An attempt failed on at least one rank; raised on every rank with the agreed outcome."""

    def __init__(self, outcome: int, local_error: Optional[BaseException]):
        self.outcome = outcome
        self.local_error = local_error
        kind = "transient" if outcome == TRANSIENT else "permanent"
        where = f"here: {local_error!r}" if local_error is not None else "on another rank"
        super().__init__(f"{kind} failure {where}")

    @property
    def transient(self) -> bool:
        return self.outcome == TRANSIENT


def agree(local_error: Optional[BaseException], reduce_max: Callable[[int], int] = _dist.all_reduce_max) -> None:
    """Collective: raise :class:`SaveAttemptFailed` on every rank if any rank failed."""
    outcome = reduce_max(classify(local_error))
    if outcome != OK:
        raise SaveAttemptFailed(outcome, local_error)


def run_agreed(fn: Callable[[], T]) -> T:
    """Collective: run a rank-local piece of a save, then make every rank agree on how it ended.

    Returns:
        What ``fn`` returned on this rank (when it succeeded on every rank).

    Raises:
        SaveAttemptFailed: on every rank, when ``fn`` raised on any rank.
    """
    result, err = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - classified by agree()
        err = e
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
        result, error = None, None
        try:
            result = attempt(n)
        except Exception as e:  # noqa: BLE001 - classified and agreed on below
            error = e
        except BaseException as e:  # torch's CheckpointException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            error = e
        try:
            agree(error, reduce_max)
        except SaveAttemptFailed as failed:
            on_failure(n, failed)
            raise
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
