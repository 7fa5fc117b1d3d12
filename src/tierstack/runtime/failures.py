"""How a rank tells "a peer rank is gone" from its own failure, and log records meant for its log file only.

When one rank dies (SIGKILL, an out-of-memory kill, a crash), every other rank's next collective
fails: gloo raises a ``RuntimeError`` (``Read error ... Connection reset by peer. This is typically
caused by a remote worker hanging ... GLHF!``) at the bottom of a 40-frame traceback, NCCL reports a
remote error or an aborted communicator, and tierstack's own checkpoint collectives wrap either in a
``CollectiveError``. That traceback says nothing about the rank that failed; the survivor prints one
line instead and keeps the traceback in its log file (:data:`FILE_ONLY`).

This module imports nothing heavy (no torch): the launcher and the logging set-up use it.
"""

from __future__ import annotations

import re
from typing import Optional

# ``logger.x(..., extra=FILE_ONLY)``: the record goes to the rank's log file
# (``logger.rank_log_dir``), not to the console.
FILE_ONLY_ATTR = "tierstack_file_only"
FILE_ONLY = {FILE_ONLY_ATTR: True}

# What gloo and NCCL say when the other end of a collective is gone or stopped answering
# (matched anywhere in the message, case-sensitive as the libraries print them).
_PEER_GONE = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|Connection refused"
    r"|remote process exited or there was a network error|ncclRemoteError|NCCL communicator was aborted"
)
_TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")
# gloo's advice after the error ("This is typically caused by ... GLHF!"): not part of what happened
_ADVICE = re.compile(r"\s*This is typically caused by.*", re.S)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")  # gloo's "[.../pair.cc:537] "
_GLOO_SOURCE = re.compile(r"^\[[^\]]*gloo[^\]]*\.(?:cc|cpp|h):\d+\]")  # "[.../third_party/gloo/gloo/...cc:78]"


def _chain(exc: BaseException):
    """``exc`` and the errors it was raised from (``__cause__``, else ``__context__``), outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def root_cause(exc: BaseException) -> BaseException:
    """The innermost error ``exc`` was raised from (the last of its ``__cause__``/``__context__`` chain)."""
    *_, last = _chain(exc)
    return last


def peer_lost(exc: BaseException) -> Optional[str]:
    """Whether ``exc`` is a collective that failed because another rank is gone (or stopped answering).

    Args:
        exc: an error that ended this rank's run.

    Returns:
        What the backend said, on one line without its advice (``"gloo: Read error
        [127.0.0.1]:29589: Connection reset by peer"``, ``"timed out: ..."``), or None when ``exc``
        is not such an error (this rank's own failure: its traceback is the report).
    """
    timed_out = None
    for err in _chain(exc):
        if not isinstance(err, RuntimeError):
            continue
        text = _ADVICE.sub("", str(err)).strip()
        first = _SOURCE_PREFIX.sub("", text.splitlines()[0] if text else "")
        if _PEER_GONE.search(text):
            backend = "gloo" if "gloo" in str(err) or "pair.cc" in str(err) else "collective"
            return f"{backend}: {first}"[:300]
        # tierstack's and torch's collective errors, and gloo's own timeout of a training collective
        # (a plain RuntimeError "[.../unbound_buffer.cc:78] Timed out waiting 15000ms for recv ...":
        # the peer stopped answering, e.g. a SIGSTOPped rank; found by the chaos soak)
        collective = type(err).__name__ in ("CollectiveError", "DistBackendError") or _GLOO_SOURCE.match(text)
        if timed_out is None and collective and _TIMED_OUT.search(text):
            timed_out = f"timed out: {first}"[:300]
    return timed_out


__all__ = ["FILE_ONLY", "FILE_ONLY_ATTR", "peer_lost"]


def interrupts(exc: BaseException) -> bool:
    """True for an exception that stops this thread from outside and must never be handled as a
    failure of the work it interrupted: ``KeyboardInterrupt``, ``SystemExit``, and what a restart
    engine raises into the main thread (NVRx in-process restart's ``RankShouldRestart``, a
    ``BaseException``). torch's ``CheckpointException`` is a ``BaseException`` too, but it reports
    a failed save: False for it."""
    return not isinstance(exc, Exception) and type(exc).__name__ != "CheckpointException"
