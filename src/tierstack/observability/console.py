"""Rank-0 console progress: a tqdm bar with ETA and one readable line per log interval.

Lines go through the ``logging`` module (logger ``tierstack.progress``); while the bar is shown,
console handlers are routed through ``tqdm.write`` so a line never breaks the bar.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Mapping, Optional

from tierstack.config.sections import LoggerConfig
from tierstack.observability import megatron_log
from tierstack.observability.timers import short_summary

log = logging.getLogger("tierstack.progress")

# Metric keys the training loop reports; others are appended as "key value".
LOSS = "loss"
VAL_LOSS = "val_loss"
LR = "lr"
GRAD_NORM = "grad_norm"
TOKENS_PER_S = "tokens_per_s"
STEP_TIME_S = "step_time_s"
TFLOPS_PER_RANK = "tflops_per_rank"

MAX_LINE = 160  # characters: a console line never wraps on a 160-column terminal

# Groups of (key, format) in display order; a group's parts are joined by one space.
_GROUPS = (
    ((LOSS, "loss {:.3f}"), (VAL_LOSS, "val {:.3f}")),
    ((LR, "lr {:.1e}"), (GRAD_NORM, "gnorm {:.2f}")),
    ((TOKENS_PER_S, "{:.0f} tok/s"), (STEP_TIME_S, "{:.2f} s/it"), (TFLOPS_PER_RANK, "{:.3g} TF/s")),
)
_KNOWN = tuple(item for group in _GROUPS for item in group)
_KNOWN_KEYS = {k for k, _ in _KNOWN}


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m"``, ``130`` -> ``"2m10s"``, ``9.4`` -> ``"9s"``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


_STRAGGLER_PREFIX = "straggler/"


def _straggler_summary(metrics: Mapping[str, Any]) -> list[str]:
    """``straggler rel 0.04 ind 1.00``: the lowest score of each kind over sections (all go to mlflow)."""
    lows = {}
    for kind, short in (("relative", "rel"), ("individual", "ind")):
        values = [
            float(v)
            for k, v in metrics.items()
            if k.startswith(_STRAGGLER_PREFIX) and k.endswith(f"_{kind}_min") and v is not None
        ]
        if values:
            lows[short] = min(values)
    if not lows:
        return []
    return ["straggler " + " ".join(f"{k} {v:.2f}" for k, v in lows.items())]


def format_step_line(iteration: int, total_iters: int, metrics: Mapping[str, Any]) -> str:
    """One console line of at most :data:`MAX_LINE` characters, e.g. ``iter 120/200 | loss 2.913
    val 2.801 | lr 2.1e-03 gnorm 0.84 | 1712 tok/s 1.21 s/it 0.0123 TF/s | fb 1.02 opt 0.12 ckpt
    0.05 max r1 | eta 1m37s`` (TF/s: model TFLOP/s per rank; the timers: seconds per step).

    Missing or None metrics are left out; ETA comes from ``step_time_s`` (seconds per iteration).
    The timers are in the short form of :func:`~tierstack.observability.timers.short_summary`
    (phases per step, slowest rank). The straggler summary and other plain metrics follow while
    the line stays within :data:`MAX_LINE`; namespaced metrics (``timers/``, ``memory/``,
    ``checkpoint/``, single ``straggler/`` scores) go to the loggers only, in full.
    """
    parts = [f"iter {iteration}/{total_iters}"]
    for group in _GROUPS:
        shown = [fmt.format(float(metrics[key])) for key, fmt in group if metrics.get(key) is not None]
        if shown:
            parts.append(" ".join(shown))
    timers = short_summary(metrics)
    if timers:
        parts.append(timers)
    optional = _straggler_summary(metrics)
    for key, value in metrics.items():
        if key in _KNOWN_KEYS or value is None or "/" in key:  # namespaced metrics: the loggers have them all
            continue
        optional.append(f"{key} {value:.4g}" if isinstance(value, (int, float)) else f"{key} {value}")
    step_time = metrics.get(STEP_TIME_S)
    eta = []
    if step_time is not None and total_iters > iteration:
        eta = [f"eta {format_duration(float(step_time) * (total_iters - iteration))}"]
    for part in optional:  # while they fit, leaving room for the ETA
        if len(" | ".join(parts + [part] + eta)) <= MAX_LINE:
            parts.append(part)
    line = " | ".join(parts + eta)
    if len(line) > MAX_LINE:  # a huge run with every phase shown: the ETA goes (the bar has it), then a cut
        line = " | ".join(parts)
    return line[:MAX_LINE]


class ProgressLogger:
    """Progress of the training loop on rank 0 (every method is a no-op on other ranks).

    Args:
        logger_cfg: the ``logger`` section (``log_interval`` in iterations, ``progress_bar``).
        total_iters: the last iteration of the run.
        start_iter: iterations already done (a resumed run starts its bar there).
        rank: global rank of this process.
        stream: where the bar draws (default ``sys.stderr``); the bar is off when it is not a TTY.
        global_batch_size: samples per iteration (the consumed samples of ``logger.format=megatron``).
    """

    def __init__(
        self,
        logger_cfg: LoggerConfig,
        total_iters: int,
        start_iter: int = 0,
        rank: int = 0,
        stream: Any = None,
        global_batch_size: int = 0,
    ) -> None:
        self.cfg = logger_cfg
        self.global_batch_size = global_batch_size  # for logger.format=megatron (consumed samples)
        self.total_iters = total_iters
        self.enabled = rank == 0
        self._bar = None
        self._redirect: Optional[contextlib.AbstractContextManager] = None
        stream = stream if stream is not None else sys.stderr
        is_tty = bool(getattr(stream, "isatty", lambda: False)())
        if self.enabled and logger_cfg.progress_bar and is_tty:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(
                total=total_iters, initial=start_iter, unit="it", desc="train", file=stream, dynamic_ncols=True
            )
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    @property
    def bar_shown(self) -> bool:
        """True when a tqdm bar is drawn."""
        return self._bar is not None

    def advance(self, iteration: int) -> None:
        """Move the bar to ``iteration`` without logging a line (the iterations between log lines)."""
        if self._bar is not None:
            self._bar.update(iteration - self._bar.n)

    def log_step(self, iteration: int, metrics: Mapping[str, Any]) -> Optional[str]:
        """Advance the bar to ``iteration`` and log one line (rank 0).

        The training loop decides when a line is due (every ``log_interval``, the first step of a
        run or resume, evaluations, the last step); this method does not filter again.

        Returns:
            The line logged, or None on other ranks.
        """
        if not self.enabled:
            return None
        self.advance(iteration)
        if self._bar is not None:
            if metrics.get(LOSS) is not None:
                self._bar.set_postfix(loss=f"{float(metrics[LOSS]):.3f}", refresh=False)
        if self.cfg.format == megatron_log.MEGATRON:
            line = megatron_log.format_megatron_line(iteration, self.total_iters, metrics, self.global_batch_size)
            if metrics.get(VAL_LOSS) is not None:
                log.info(megatron_log.format_megatron_validation(iteration, float(metrics[VAL_LOSS])))
        else:
            line = format_step_line(iteration, self.total_iters, metrics)
        log.info(line)
        return line

    def close(self) -> None:
        """Close the bar and restore console handlers (idempotent)."""
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
