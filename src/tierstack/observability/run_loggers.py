"""The one interface the training loop logs through: :class:`RunLoggers`, over every logger that is on.

The loop calls :meth:`RunLoggers.log_metrics` once per log interval and the checkpoint manager
calls :meth:`RunLoggers.log_checkpoint` once per published GLOBAL save; neither knows which loggers
(mlflow, TensorBoard, Weights & Biases) are on. Each logger is a class of its own in this package
with the methods of :class:`RunLogger`; on ranks other than the one that logs, each is a no-op.
A failing logger is logged and never fails a training step or a published checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

log = logging.getLogger(__name__)


@runtime_checkable
class RunLogger(Protocol):
    """What every logger offers (mlflow's :class:`~tierstack.observability.experiment_tracker.
    ExperimentTracker`, :class:`~tierstack.observability.tensorboard_logger.TensorBoardLogger`,
    :class:`~tierstack.observability.wandb_logger.WandbLogger`)."""

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Numeric metrics at ``step`` (the iteration); None and non-numeric values are skipped."""

    def log_checkpoint(self, event: Any) -> bool:
        """A published checkpoint (``SaveEvent``: tier, step, path, bytes, seconds); True if logged."""

    def set_tag(self, key: str, value: Any) -> None:
        """A run-level tag (e.g. ``stop_reason``)."""

    def log_artifact(self, path: str | os.PathLike, artifact_path: Optional[str] = None) -> None:
        """A file of the run (e.g. the loss curve)."""

    def finish(self, status: str = "FINISHED") -> None:
        """End the run: FINISHED, FAILED or KILLED."""


class RunLoggers:
    """Fan-out to every logger that is on, in the order added; an empty one does nothing.

    Args:
        loggers: the loggers to start with; more join with :meth:`add` (TensorBoard and W&B need
            the resumed step, known only after the checkpoint is loaded).
    """

    def __init__(self, *loggers: RunLogger) -> None:
        self._loggers: list[RunLogger] = [lg for lg in loggers if lg is not None]
        self._failing: dict[tuple[int, str], int] = {}  # (logger id, method) -> failed calls in a row

    def add(self, logger: Optional[RunLogger]) -> None:
        """Add ``logger`` (None is ignored)."""
        if logger is not None:
            self._loggers.append(logger)

    def __len__(self) -> int:
        return len(self._loggers)

    def _each(self, method: str, *args) -> None:
        """``method(*args)`` on every logger. A failure never fails training or a published save: the
        first one of a logger's method is logged with its traceback, the ones after it are counted
        (a full disk fails every log interval), and the first success after them says how many."""
        for lg in self._loggers:
            key = (id(lg), method)
            try:
                getattr(lg, method)(*args)
            except Exception:  # noqa: BLE001 - a logger hiccup must not fail training or a published save
                n = self._failing.get(key, 0)
                self._failing[key] = n + 1
                if n == 0:
                    log.exception("%s.%s failed (later failures of it are counted, not logged)",
                                  type(lg).__name__, method)
                continue
            if key in self._failing:
                log.info("%s.%s works again after %d failed calls", type(lg).__name__, method, self._failing.pop(key))

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Once per log interval: ``metrics`` at iteration ``step`` to every logger."""
        self._each("log_metrics", step, metrics)

    def log_checkpoint(self, event: Any) -> None:
        """Once per published checkpoint (the checkpoint manager's listener)."""
        self._each("log_checkpoint", event)

    def set_tag(self, key: str, value: Any) -> None:
        """A run-level tag to every logger."""
        self._each("set_tag", key, value)

    def log_artifact(self, path: str | os.PathLike, artifact_path: Optional[str] = None) -> None:
        """A file of the run to every logger that keeps files."""
        self._each("log_artifact", path, artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        """End every logger's run, the last added first (each is tried even if another fails)."""
        for lg in reversed(self._loggers):
            try:
                lg.finish(status)
            except Exception as e:  # noqa: BLE001
                if any(key[0] == id(lg) for key in self._failing):  # its traceback was logged already
                    log.error("%s.finish failed too (%s: %s)", type(lg).__name__, type(e).__name__,
                              (str(e).splitlines() or [""])[-1])
                else:
                    log.exception("%s.finish failed", type(lg).__name__)


def numeric_items(metrics: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``(key, float)`` of each finite numeric value of ``metrics`` (None, strings, nan and inf left out)."""
    import math

    out = []
    for key, value in metrics.items():
        if isinstance(value, str) or value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out.append((key, number))
    return out
