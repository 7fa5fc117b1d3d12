"""Closing what a run started, in reverse order, without ever hiding the error that ended it.

``pretrain`` owns one :class:`contextlib.ExitStack`; ``setup`` registers each resource on it the
moment the resource exists (process groups, tracker, checkpoint manager, straggler monitor), so a
failure anywhere, setup included, closes exactly what was built. A closer that fails is logged
and, while another error is in flight, never replaces it; with no error in flight its failure is
raised (a final checkpoint that could not be published must fail the run).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional

from tierstack.runtime.failures import interrupts

log = logging.getLogger(__name__)


def status_of(exc_type: Optional[type]) -> str:
    """mlflow run status for how the run ended: FINISHED, KILLED (Ctrl-C) or FAILED."""
    if exc_type is None:
        return "FINISHED"
    return "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"


def register(stack: contextlib.ExitStack, name: str, close: Callable[..., None], *, with_status: bool = False,
             with_error: bool = False) -> None:
    """Run ``close()`` (``close(status)`` when ``with_status``, ``close(error)`` with the error in
    flight or None when ``with_error``) when ``stack`` unwinds.

    Raises (at unwind): the closer's own error, only when no other error is in flight.
    """

    def _exit(exc_type, exc, tb) -> bool:
        try:
            if with_status:
                close(status_of(exc_type))
            else:
                close(exc) if with_error else close()
        except BaseException as e:  # noqa: BLE001 - logged; re-raised only if nothing else is in flight
            if exc is None or interrupts(e):  # an interruption (in-process restart, Ctrl-C) is never swallowed
                raise
            log.error("closing %s failed (%s: %s); the error that ended the run is kept",
                      name, type(e).__name__, e, exc_info=e)
        return False

    stack.push(_exit)
