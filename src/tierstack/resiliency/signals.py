"""Planned exits: SIGTERM (and SIGHUP, the launcher gone) become a request to checkpoint and stop
at the next step boundary."""

from __future__ import annotations

import logging
import os
import signal
from typing import Optional

from tierstack.runtime import collectives

log = logging.getLogger(__name__)

_held: list[str] = []  # stop signals that came while a failed run unwound (see ExitRequest.restore)
_served: list[str] = []  # the planned exit a run of this process ended with (see served_stop)
_unserved: list[str] = []  # a stop request whose run returned without keeping its checkpoint (see unserved_stop)


def _hold(signum, frame) -> None:
    _held.append(signal.Signals(signum).name)
    if len(_held) >= 3:  # a third one ends the process as the default action does
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def held_stop_signal() -> Optional[str]:
    """The name of the first SIGTERM that came after a failed run restored its handlers
    (:meth:`ExitRequest.restore` with an error), or None. The rank's exit path ends at once when
    one came (torchrun's agent stopping the workers) instead of waiting for it."""
    return _held[0] if _held else None


def note_served(reason: str) -> None:
    """The training loop stopped for ``reason`` (a planned exit, ``train.exit_interval``, the time
    budget...) and its last checkpoint is kept: the job is done with this stop."""
    _served.append(reason)


def unserved_stop() -> Optional[str]:
    """A stop request that the last run of this process returned with, without keeping its last
    checkpoint (its save failed); None otherwise. An in-process restart holds it
    (:func:`hold_stop`), so that the next attempt stops at its first step boundary and saves."""
    return _unserved[-1] if _unserved else None


def hold_stop(reason: str) -> None:
    """The next :class:`ExitRequest` of this process starts with ``reason`` requested."""
    if reason not in _held:
        _held.append(reason)


def served_stop() -> Optional[str]:
    """The reason of the stop a run of this process ended with, its checkpoint kept
    (:func:`note_served`); None when none did. An in-process restart after it must not train again
    (:mod:`tierstack.resiliency.in_process`)."""
    return _served[-1] if _served else None


class ExitRequest:
    """Records SIGTERM (the scheduler's pre-emption notice), SIGHUP (the launcher died, see
    :func:`stop_with_the_launcher`) or the early-warning signal (``train.exit_signal``, e.g. the
    SIGUSR1 of SLURM's ``--signal=USR1@120``) and lets all ranks agree on it.

    The handler only sets a flag (and says nothing); :meth:`agreed` runs one all-reduce at a step
    boundary, so every rank stops after the same step and the GLOBAL checkpoint taken then is
    complete; the training loop announces that checkpoint once the ranks agreed.
    A second SIGTERM restores the default handler, so a third one kills the process as usual;
    SIGHUP and the early-warning signal are counted once, however often they come.

    Args:
        signals: the signals that always ask for a planned exit.
        early_warning: a signal name (``"SIGUSR1"``) that asks for it too; None: none.
    """

    def __init__(self, signals: tuple = (signal.SIGTERM, signal.SIGHUP), early_warning: Optional[str] = None):
        self._requested: Optional[str] = None
        self._previous = {}
        if _held:  # a stop signal came between a failed attempt and this one (in-process restart)
            self._requested = _held[0]
        self._once = {signal.SIGHUP}
        if early_warning is not None:
            self._once.add(signal.Signals[early_warning])
            signals = (*signals, signal.Signals[early_warning])
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be installed there
                pass

    def _handle(self, signum, frame) -> None:
        # Only recorded: the ranks agree on it at the next step boundary, and the loop announces
        # the planned exit's checkpoint then, when it can be saved (a rank that is stopping on an
        # error, or whose peer is gone, gets torchrun's SIGTERM too, and saves nothing).
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:  # the launcher died (stop_with_the_launcher); may come several times
            if self._requested is None:
                self._requested = "SIGHUP (the launcher is gone)"
            return
        if signum in self._once:  # the early warning (train.exit_signal): ahead of the scheduler's SIGTERM
            if self._requested is None:
                self._requested = f"{name} (train.exit_signal)"
            return
        if self._requested is not None:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
        self._requested = name

    def request(self, reason: str) -> None:
        """Ask for a planned exit from code (e.g. the straggler monitor)."""
        self._requested = reason

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to exit. Collective: call on all ranks."""
        return collectives.any_true(bool(self._requested))

    def reasons(self) -> list[Optional[str]]:
        """Every rank's reason, by rank (None where a rank was not asked). Collective: call on all
        ranks, once :meth:`agreed` said True, so that every rank names the same cause."""
        return collectives.all_gather_object(self._requested)

    @property
    def reason(self) -> Optional[str]:
        return self._requested

    def restore(self, error: Optional[BaseException] = None) -> None:
        """Put the previous signal handlers back.

        Args:
            error: what ended the run, if it failed. Then SIGTERM is held instead
                (:func:`held_stop_signal`; a third one kills): the rank still has to say why it
                stops (:mod:`tierstack.recipes.rank_exit`), and torchrun's agent, which saw a peer
                die, sends its SIGTERM in that instant; with the default action back, it killed the
                rank before its one line (seen in CI: the survivor said nothing about a killed peer).
        """
        if error is not None and self._requested == "SIGTERM" and not _held:
            _held.append("SIGTERM")  # it came while the run unwound: the exit path need not wait for it
        elif error is None:
            _held.clear()  # a run that ended well served any stop request it took over...
            _unserved[:] = [self._requested] if self._requested is not None and not _served else []  # ...or not
        for sig, prev in self._previous.items():
            try:
                signal.signal(sig, _hold if error is not None and sig == signal.SIGTERM else prev)
            except (ValueError, TypeError):
                pass
        self._previous = {}


def planned_exit_grace_s(config) -> int:
    """Seconds a launcher must give the ranks between its stop signal and SIGKILL so that the
    planned exit's checkpoint can be published: the step in progress (bounded by
    ``distributed.timeout_s``), the wait for the save in flight and the final save's own write
    (each bounded by ``checkpoint.async_write_timeout_s``). An upper bound: ranks that are done
    sooner end the launch sooner.

    Args:
        config: the run's :class:`~tierstack.config.ConfigContainer`.
    """
    return int(2 * config.checkpoint.async_write_timeout_s + config.distributed.timeout_s)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_the_launcher() -> bool:
    """Ask Linux to send this rank SIGHUP when its launcher dies (``prctl(PR_SET_PDEATHSIG)``).

    torchrun starts each rank in a session of its own, so a launcher killed with SIGKILL (an
    out-of-memory kill, ``kill -9``, a node agent gone) left its ranks training as orphans: they
    went on writing the run's checkpoints while a relaunch on the same run directory resumed and
    wrote beside them. With this, such a rank gets SIGHUP, a planned exit: it checkpoints and stops
    with the other ranks (:class:`ExitRequest`). The signal comes each time the rank's parent
    *thread* exits: a dying multi-threaded launcher hands the rank to its other threads one after
    the other, so it can come several times (seen: 2-3), which is why it is SIGHUP, counted once,
    and not SIGTERM, whose third delivery kills (before training starts, the default action of
    SIGHUP ends the rank).

    Returns:
        True when set; False where ``prctl`` is unavailable (not Linux). A launcher that died in
        the instant of this call is seen (the parent changed) and gives the same SIGHUP; one that
        died earlier, while the rank imported, is not (the parent is then not known).
    """
    import ctypes
    import ctypes.util
    import os
    import sys

    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGHUP), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the launcher died while the request was made
        os.kill(os.getpid(), signal.SIGHUP)
    return True
