"""Planned exits: SIGTERM/SIGINT become a request to checkpoint and stop at the next step boundary."""

from __future__ import annotations

import logging
import signal
from typing import Optional

from tierstack.runtime import collectives

log = logging.getLogger(__name__)


class ExitRequest:
    """Records SIGTERM (the scheduler's pre-emption notice) and lets all ranks agree on it.

    The handler only sets a flag; :meth:`agreed` runs one all-reduce at a step boundary, so every
    rank stops after the same step and the GLOBAL checkpoint taken then is complete.
    A second signal restores the default handler, so a third one kills the process as usual.
    """

    def __init__(self, signals: tuple = (signal.SIGTERM,)):
        self._requested: Optional[str] = None
        self._previous = {}
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be installed there
                pass

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._requested is not None:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
        self._requested = name
        log.warning("received %s: will save a GLOBAL checkpoint and stop after this step", name)

    def request(self, reason: str) -> None:
        """Ask for a planned exit from code (e.g. the straggler monitor)."""
        self._requested = reason

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to exit. Collective: call on all ranks."""
        return collectives.any_true(bool(self._requested))

    @property
    def reason(self) -> Optional[str]:
        return self._requested

    def restore(self) -> None:
        """Put the previous signal handlers back."""
        for sig, prev in self._previous.items():
            try:
                signal.signal(sig, prev)
            except (ValueError, TypeError):
                pass
        self._previous = {}
