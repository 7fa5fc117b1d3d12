"""Save intervals from measurements: ``checkpoint.local_save_interval=auto`` / ``save_interval=auto``.

The interval that maximises expected goodput for a save that blocks training ``C`` seconds, in a
job whose failures come every ``M`` seconds on average (mean time between failures of the whole
job, ``checkpoint.mtbf_s``), is to first order

    T_opt = sqrt(2 * C * M)      (seconds of training between saves)

(J. W. Young, "A first order approximation to the optimum checkpoint interval", Commun. ACM 17(9),
1974; J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22(3), 2006, whose higher-order terms matter only when C is
not small against M). In iterations: ``round(T_opt / step time)``, at least 1.

:class:`IntervalPlanner` starts from a guess (the save cost is unknown before the first save),
re-estimates after every save from the measured blocking time of the saves of that tier and the
measured step time (medians), and logs each new interval with the numbers it used. Only unplanned
failures belong in ``M``: a planned exit (SIGTERM at the end of an allocation, ``exit_interval``)
loses nothing and must not shorten the interval.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Optional

log = logging.getLogger(__name__)

AUTO = "auto"
FIRST_GUESS_ITERATIONS = 10  # before any save was measured: save early, then measure


def young_daly_interval(save_cost_s: float, step_time_s: float, mtbf_s: float) -> int:
    """Iterations between saves: ``round(sqrt(2 * save_cost_s * mtbf_s) / step_time_s)``, >= 1.

    Args:
        save_cost_s: seconds one save blocks training (seconds, > 0 for a meaningful result).
        step_time_s: seconds per training iteration (> 0).
        mtbf_s: mean time between (unplanned) failures of the whole job, seconds (> 0).

    Raises:
        ValueError: a non-positive step time or MTBF (names the argument).
    """
    if not step_time_s > 0:
        raise ValueError(f"step_time_s={step_time_s}: must be > 0 seconds")
    if not mtbf_s > 0:
        raise ValueError(f"mtbf_s={mtbf_s}: must be > 0 seconds (checkpoint.mtbf_s)")
    seconds = math.sqrt(2.0 * max(save_cost_s, 0.0) * mtbf_s)
    return max(1, round(seconds / step_time_s))


class IntervalPlanner:
    """The current ``auto`` interval of one tier, re-estimated from measurements.

    Args:
        tier: a name for the log ("LOCAL", "GLOBAL").
        mtbf_s: ``checkpoint.mtbf_s``.
    """

    def __init__(self, tier: str, mtbf_s: float) -> None:
        self.tier, self.mtbf_s = tier, mtbf_s
        self.interval = FIRST_GUESS_ITERATIONS
        self.save_costs: list[float] = []
        self.step_times: list[float] = []
        self.last_save_step: Optional[int] = None

    def record_step(self, seconds: float) -> None:
        """One iteration's wall time (seconds)."""
        self.step_times.append(seconds)
        del self.step_times[:-200]  # the recent past only

    def due(self, step: int) -> bool:
        """Whether ``step`` should save: ``interval`` iterations after the last save (or from 0)."""
        return step - (self.last_save_step or 0) >= self.interval

    def record_save(self, step: int, blocked_s: Optional[float]) -> int:
        """A save of this tier at ``step`` that blocked ``blocked_s`` seconds (None: it failed).

        Returns the interval these measurements call for (iterations); it takes effect with
        :meth:`adopt`, once the ranks agreed on one (each rank measures its own times).
        """
        self.last_save_step = step
        if blocked_s is not None:
            self.save_costs.append(blocked_s)
        if not self.save_costs or not self.step_times:
            return self.interval
        cost, step_time = statistics.median(self.save_costs[-10:]), statistics.median(self.step_times)
        self._basis = (cost, step_time)
        return young_daly_interval(cost, step_time, self.mtbf_s)

    def adopt(self, interval: int, announce: bool = False) -> None:
        """Use ``interval`` from now on (logged with the numbers it came from when it changes and ``announce``)."""
        if interval != self.interval and announce and getattr(self, "_basis", None):
            cost, step_time = self._basis
            log.info("%s save interval auto: %d iterations (Young/Daly sqrt(2 * %.3fs save * %.0fs MTBF) = %.1fs "
                     "at %.3fs per iteration; was %d)", self.tier, interval, cost, self.mtbf_s,
                     math.sqrt(2 * cost * self.mtbf_s), step_time, self.interval)
        self.interval = interval
