"""A rank that fails under torchrun ends as soon as its error is printed, so the restart comes sooner.

torchrun restarts the ranks only once every rank of the start has ended. A surviving rank whose
peer died fails at once in its next collective (gloo: "Connection reset by peer"), closes its run
(``pretrain``'s closers) and prints the traceback; then the interpreter's own teardown (atexit
handlers, the final garbage collection and module teardown over torch's and megatron-core's
objects, library destructors) took 1.3-1.4 s more on 2 busy CPU cores, measured with
``scripts/bench_detection.py``: over half of the time from a rank's SIGKILL to the survivors
stopped. Nothing in that teardown matters once the run's closers ran: the process and its memory
go away with it.
"""

from __future__ import annotations

import logging
import os
import sys

FAILED_STATUS = 1  # the interpreter's own exit status for an uncaught exception


def exit_now(status: int) -> None:
    """End this process now with ``status``, after stopping its child processes (multiprocessing
    managers, at most 5 s each) and flushing logs and standard streams. Never returns.

    Call only once everything that must be closed is closed (``pretrain()`` closes the checkpoint
    writers, trackers and process groups before it returns or raises).
    """
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=5)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def exit_after_traceback() -> None:
    """Make an exception that ends this process end it at once: ``sys.excepthook`` prints the
    traceback as before (the hook that was installed), then :func:`exit_now` with status 1, the
    interpreter's status for an uncaught exception, instead of the interpreter's teardown.

    Nothing changes for an exception that a caller catches. Install it where the exception has
    already passed the run's closers (``pretrain()`` raised).
    """
    previous = sys.excepthook
    if getattr(previous, "_tierstack_exit_now", False):
        return

    def hook(exc_type, exc, tb) -> None:
        try:
            previous(exc_type, exc, tb)
        finally:
            exit_now(FAILED_STATUS)

    hook._tierstack_exit_now = True  # type: ignore[attr-defined]
    sys.excepthook = hook
