"""A process that an in-process restart cannot heal: the same error of its own, twice in a row,
before the first step of the attempt.

NVRx interrupts an attempt by raising in the main thread wherever it is. What it cuts in half can
stay broken in that process: an import (``module 'sympy' has no attribute 'core'``, reproduced by
raising into ``import torch._dynamo``), a library's global state. Every later attempt of that
process then fails the same way during set-up, while every other rank is healthy; restarting it in
the same process again only burns ``resiliency.max_in_process_restarts``. Such a process leaves
the job instead (:func:`tierstack.resiliency.in_process.run`), so that a fresh process takes its
rank: a warm spare of its node, else the launcher's restart.

What counts (:meth:`RepeatedFailure.is_repeated`): the error is the rank's own (not one met after
the attempt was interrupted, e.g. from the released process groups), it came before the attempt's
first step, and the previous attempt of the process failed in the same way (same type, same
message). An error raised on every rank together (bad input) never gets here: it ends the job.
"""

from __future__ import annotations

from typing import Optional


class RepeatedFailure:
    """The failures of one process's in-process attempts, to tell a damaged process (see module)."""

    def __init__(self) -> None:
        self._last: Optional[tuple[str, str]] = None

    def is_repeated(self, error: BaseException, before_first_step: bool, interrupted: bool) -> bool:
        """Record a failed attempt; True when it is this process's own error before the first step,
        the same (type and message) as the previous attempt's."""
        mine = before_first_step and not interrupted
        signature = (type(error).__name__, str(error)[:500]) if mine else None
        repeated = signature is not None and signature == self._last
        self._last = signature
        return repeated

    def succeeded(self) -> None:
        """An attempt reached its first step: earlier failures say nothing about this process."""
        self._last = None
