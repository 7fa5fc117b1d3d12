"""What a checkpoint failure is, by its root cause, through every layer that wraps it.

A write error seldom reaches us as the ``OSError`` it started as. megatron-core's torch_dist writer
runs in worker processes and hands the error back as ``RuntimeError("Worker failure: [Errno 5]
...")``; torch's ``CheckpointException('write', {rank: (exc, traceback)})`` gathers the per-rank
failures on the coordinator after pickling them (which drops ``__cause__``), and raises
``CheckpointException('write', {})`` on every other rank, which knows only that *someone* failed.
:func:`classify` therefore walks ``__cause__``/``__context__``, the ``failures`` of a
``CheckpointException`` and the local error of an agreed failure, and reads an errno from the
exception object or, when only the text survived, from the ``[Errno N]`` that Python's ``OSError``
puts in its message.

Outcomes are ordered so that the ranks can agree with one all-reduce MAX:
``OK < REMOTE < TRANSIENT < PERMANENT``. ``REMOTE`` means "failed here only because another rank
did" and defers to that rank's cause; if no rank knows a cause the failure is permanent.
The transient errnos are those of DESIGN.md ("Write", step 2).
"""

from __future__ import annotations

import errno
import re
from typing import Iterator, Optional

from tierstack.runtime.collectives import CollectiveError

TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ESTALE, errno.EBUSY, errno.ECONNRESET, errno.EINTR}
)
OK, REMOTE, TRANSIENT, PERMANENT = 0, 1, 2, 3
NAMES = {OK: "ok", REMOTE: "remote", TRANSIENT: "transient", PERMANENT: "permanent"}

_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")


class RemoteFailure(Exception):
    """This rank's part went fine, or could not go on, because another rank failed."""


# A checkpoint collective failed or timed out (a rank is gone or hung): never retried, it stops the
# run on every rank that sees it; the others see it within ``checkpoint.collective_timeout_s``.
CollectiveFailure = CollectiveError


class NotRetryable(RuntimeError):
    """Wraps an error that must not be retried whatever its errno (e.g. a write whose own retries
    on the tier's writer thread are spent); :func:`classify` reads its ``outcome``."""

    outcome = PERMANENT


def causes(exc: Optional[BaseException]) -> Iterator[BaseException]:
    """``exc`` and everything it wraps: causes, contexts, CheckpointException failures, agreed errors."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "local_error", None)]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.CheckpointException
        if isinstance(failures, dict):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]


def errno_of(exc: BaseException) -> Optional[int]:
    """The errno of an OSError, or the ``[Errno N]`` in a message that wrapped one; None if neither."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    m = _ERRNO_TEXT.search(str(exc))
    return int(m.group(1)) if m else None


def _failures(exc: BaseException) -> list:
    """The per-rank errors a torch ``CheckpointException`` gathered (none for other errors)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]


def _is_remote_only(exc: BaseException) -> bool:
    if isinstance(exc, RemoteFailure):
        return True
    failures = getattr(exc, "failures", None)
    return isinstance(failures, dict) and not failures and type(exc).__name__ == "CheckpointException"


def classify(exc: Optional[BaseException]) -> int:
    """OK for None; TRANSIENT when every errno found anywhere in the chain is transient; PERMANENT
    when any errno is permanent or no errno is found in a local error (a bug such as TypeError);
    REMOTE when the error only says that another rank failed. Any permanent cause makes the whole
    failure permanent: an inner error marked so (``NotRetryable``), or one rank's failure among
    those a ``CheckpointException`` gathered (each is classified on its own)."""
    if exc is None:
        return OK
    outcome = getattr(exc, "outcome", None)
    if isinstance(outcome, int) and outcome in NAMES:  # already agreed on by an inner step
        return outcome
    chain = list(causes(exc))
    if any(getattr(e, "outcome", None) == PERMANENT for e in chain):
        return PERMANENT
    gathered = [classify(f) for e in chain for f in _failures(e)]
    if PERMANENT in gathered:  # one rank's bug or permanent errno beside another's transient one
        return PERMANENT
    errnos = [n for n in (errno_of(e) for e in chain) if n is not None]
    if errnos:
        return TRANSIENT if all(n in TRANSIENT_ERRNOS for n in errnos) else PERMANENT
    if all(_is_remote_only(e) for e in chain if e.__cause__ is None and e.__context__ is None):
        return REMOTE
    return PERMANENT


def _origin_rank(chain: list, target: BaseException) -> Optional[int]:
    """The rank under which a CheckpointException's ``failures`` hold ``target`` (or its wrapper)."""
    for e in chain:
        failures = getattr(e, "failures", None)
        if not isinstance(failures, dict):
            continue
        for rank, pair in failures.items():
            inner = pair[0] if isinstance(pair, tuple) else pair
            if any(c is target for c in causes(inner)):
                return int(rank)
    return None


def describe(exc: Optional[BaseException]) -> str:
    """One line naming the root cause: the innermost error with an errno (path and errno), else the
    innermost error; for logs and the messages every rank prints."""
    if exc is None:
        return "ok"
    chain = list(causes(exc))
    with_errno = [e for e in chain if errno_of(e) is not None]
    if with_errno:
        e = with_errno[-1]
        n = errno_of(e)
        name = errno.errorcode.get(n, str(n))
        text = str(e) if isinstance(e, OSError) else _ERRNO_TEXT.split(str(e), maxsplit=1)[-1].strip()
        if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
            text += f": {e.filename!r}"
        origin = _origin_rank(chain, e)
        return f"{name} ({type(e).__name__}: {text})" + (f" [reported by rank {origin}]" if origin is not None else "")
    leaves = [e for e in chain if not _is_remote_only(e)]
    e = leaves[-1] if leaves else chain[0]
    return f"{type(e).__name__}: {e}"


class CheckpointLoadError(RuntimeError):
    """A checkpoint cannot be loaded as asked; the message says which setting to change."""
