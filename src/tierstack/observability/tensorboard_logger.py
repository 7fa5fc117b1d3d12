"""TensorBoard event files for a run (``logger.tensorboard_dir``), written by rank 0 alone.

The writer is ``torch.utils.tensorboard.SummaryWriter`` over the ``tensorboard`` package's event
file writer. What the files hold: every metric of each log interval as a scalar at its iteration
(the same keys as mlflow: ``loss``, ``val_loss``, ``lr``, ``grad_norm``, ``tokens_per_s``,
``tflops_per_rank``, ``timers/*``, ``checkpoint/*``, ``straggler/*``, ...), GLOBAL checkpoint
events (``checkpoint/global_save_seconds`` and ``checkpoint/global_bytes`` at their step), and the
run config as text (tag ``config``) at the step the run starts from.

A resume continues the same curves: a resumed run opens its writer with ``purge_step`` = the
resumed iteration + 1, so TensorBoard drops what the earlier run logged beyond the checkpoint
(those steps are trained again), and no step shows twice or out of order; a fresh start in a
directory that holds an earlier run's files hides all of them (as ``metrics.jsonl`` starts over). Events are flushed
at each log interval, so a run killed without warning loses at most the current interval.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from tierstack.observability.run_loggers import numeric_items

log = logging.getLogger(__name__)

CONFIG_TAG = "config"


def _summary_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer needs the tensorboard package
        raise ImportError("logger.tensorboard_dir is set: pip install tensorboard (or set logger.tensorboard_dir=null)") from e
    return SummaryWriter


class TensorBoardLogger:
    """Rank-0 TensorBoard writer of one run (every method a no-op on other ranks).

    Args:
        log_dir: the event file directory (created if missing).
        rank: global rank of this process; only rank 0 writes.
        resume_step: the iteration this run starts from (0 for a fresh start); events the earlier
            run logged beyond it are purged from TensorBoard's view.
        config: the run config as nested dicts, written once as text (pretty JSON).

    Raises:
        ImportError: the ``tensorboard`` package is missing (names it).
    """

    def __init__(self, log_dir: str | os.PathLike, rank: int, resume_step: int = 0,
                 config: Optional[Mapping[str, Any]] = None) -> None:
        self.enabled = rank == 0
        self.log_dir = Path(log_dir)
        self._writer = None
        if not self.enabled:
            return
        writer_class = _summary_writer_class()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # purge_step: a SessionLog START event at that step tells readers to drop the events of
        # earlier files from there on: what a resumed run trains again, or all of an earlier
        # run's events when this one starts fresh in the same directory (step 1).
        self._writer = writer_class(log_dir=str(self.log_dir), purge_step=resume_step + 1, flush_secs=30)
        if config is not None:
            text = "```\n" + json.dumps(config, indent=2, default=str) + "\n```"  # markdown code block
            self._writer.add_text(CONFIG_TAG, text, global_step=resume_step)
        log.info("tensorboard: %s (tensorboard --logdir %s)", self.log_dir, self.log_dir)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Each finite numeric metric as a scalar at ``step``, then flush (see the module doc)."""
        if self._writer is None:
            return
        for key, value in numeric_items(metrics):
            self._writer.add_scalar(key, value, global_step=int(step))
        self._writer.flush()

    def log_checkpoint(self, event: Any) -> bool:
        """A published GLOBAL save: its blocking seconds and bytes at its step. Returns True if written."""
        if self._writer is None or str(getattr(event.tier, "name", event.tier)).upper() != "GLOBAL":
            return False
        self._writer.add_scalar("checkpoint/global_save_seconds", float(event.seconds), global_step=int(event.step))
        self._writer.add_scalar("checkpoint/global_bytes", float(event.bytes), global_step=int(event.step))
        self._writer.flush()
        return True

    def set_tag(self, key: str, value: Any) -> None:
        """A run-level tag as text under ``tags/<key>``."""
        if self._writer is not None:
            self._writer.add_text(f"tags/{key}", str(value))
            self._writer.flush()

    def log_artifact(self, path: str | os.PathLike, artifact_path: Optional[str] = None) -> None:
        """TensorBoard keeps no files: nothing to do (the loss curve is in the run directory)."""

    def finish(self, status: str = "FINISHED") -> None:
        """Flush and close the event file (idempotent); ``status`` is written as the tag ``status``."""
        if self._writer is None:
            return
        self._writer.add_text("tags/status", status)
        self._writer.close()
        self._writer = None
