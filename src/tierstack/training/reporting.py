"""What a person sees of a run: console progress, the metrics history and the loss-curve image."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger("tierstack")


def configure_logging(level: int = logging.INFO, log_file: Optional[Path] = None) -> None:
    """Rank 0 logs INFO to stderr; other ranks log WARNING and above, prefixed with their rank.

    Third-party loggers that flood a CPU run (megatron-core's per-call INFO lines) are raised to
    WARNING. With ``log_file`` (``logger.rank_log_path(rank)``), every rank also appends its
    tierstack records from INFO up to that file, with the records marked
    :data:`~tierstack.runtime.failures.FILE_ONLY` (tracebacks the console gets as one line). A file
    that cannot be opened is said once on the console; the run goes on without it.
    """
    rank = int(os.environ.get("RANK", "0"))
    root = logging.getLogger()
    if not any(getattr(h, "_tierstack", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._tierstack = True  # type: ignore[attr-defined]
        prefix = "" if rank == 0 else f"[rank {rank}] "
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler.addFilter(_console_only)
        handler.setLevel(level if rank == 0 else logging.WARNING)
        root.addHandler(handler)
    # Libraries that log INFO on the root logger (NVRx local checkpointing does) stay quiet;
    # tierstack's own lines say what happened.
    root.setLevel(logging.WARNING)
    logging.getLogger("tierstack").setLevel(level)  # the console handler keeps other ranks to WARNING
    for noisy in ("megatron", "megatron.core", "nvidia_resiliency_ext", "mlflow", "alembic", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if log_file is not None:
        _open_rank_log(Path(log_file), rank, root)


def _console_only(record: logging.LogRecord) -> bool:
    """The console's filter: every record but those meant for the rank's log file alone."""
    from tierstack.runtime.failures import FILE_ONLY_ATTR

    return not getattr(record, FILE_ONLY_ATTR, False)


class _RankLogFile(logging.FileHandler):
    """A rank's log file that a full disk (ENOSPC) or EIO does not flood the console about: logging's
    own handler prints a traceback to stderr for every record it cannot write; this one says it
    once per failing stretch, and once when the file is written again (the console keeps every line)."""

    failing = False

    def emit(self, record: logging.LogRecord) -> None:
        self._failed_now = False
        super().emit(record)
        if self.failing and not self._failed_now:
            self.failing = False
            sys.stderr.write(f"tierstack: the log file {self.baseFilename} is written again\n")

    def handleError(self, record: Optional[logging.LogRecord]) -> None:
        self._failed_now = True
        if not self.failing:
            self.failing = True
            sys.stderr.write(f"tierstack: cannot write the log file {self.baseFilename} ({sys.exc_info()[1]}); its "
                             "lines are left out until it can be written again (the console keeps its own)\n")

    def write_line(self, text: str) -> None:
        """Write ``text`` and a newline as is (no record), failing as a record would."""
        try:
            self.stream.write(text + "\n")
            self.flush()
        except OSError:
            self.handleError(None)


def _open_rank_log(path: Path, rank: int, root: logging.Logger) -> None:
    """Append this rank's records to ``path`` (one handler per process: a second call with the
    same path adds none), after a line that says which start of the rank follows."""
    if any(getattr(h, "_tierstack_file", None) == str(path) for h in root.handlers):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = _RankLogFile(path, mode="a", encoding="utf-8")
    except OSError as exc:
        log.warning("rank %d: cannot write its log file %s (%s); logging to the console only", rank, path, exc)
        return
    handler._tierstack_file = str(path)  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root.addHandler(handler)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    handler.write_line(f"==== rank {rank}, pid {os.getpid()}, torchrun restart count {restart} ====")


@contextlib.contextmanager
def run_reporters(s):
    """Console progress and metrics history for a run; the loss-curve image on the way out.

    Yields ``(progress, history)`` for :func:`tierstack.training.train.train`. On rank 0 only:
    ``<run_dir>/metrics.jsonl`` (continued across resumes) and ``<run_dir>/loss_curve.png``
    (train and validation loss, checkpoint and resume steps marked; ``logger.loss_curve``), also
    logged to mlflow; not after an error that torchrun restarts the ranks for, nor after a failed attempt
    of an in-process restart (the next start or attempt draws it).
    """
    from tierstack.observability.console import ProgressLogger
    from tierstack.observability.history import MetricsHistory

    cfg, ts, rank = s.config, s.train_state, s.layout.rank
    run_dir = Path(cfg.logger.run_dir)
    if s.resume_info is not None:
        log.info(
            "resumed from %s checkpoint at iteration %d (%s): consumed %d samples",
            s.resume_info.tier.value.upper(),
            ts.step,
            s.resume_info.path,
            ts.consumed_train_samples,
        )
    else:
        log.info("starting a fresh run (no checkpoint found)")
    history = MetricsHistory(run_dir / "metrics.jsonl", rank=rank, resume_step=ts.step)
    if s.resume_info is not None:
        history.add_resume(ts.step)
    progress = ProgressLogger(cfg.logger, total_iters=cfg.train.train_iters, start_iter=ts.step, rank=rank,
                              global_batch_size=cfg.train.global_batch_size)
    error = None
    try:
        yield progress, history
    except BaseException as e:  # re-raised: the close must know whether this rank unwinds alone
        error = e
        raise
    finally:
        progress.close()
        # Publish in-flight async saves first, so the image marks every checkpoint of the run
        # (not with an error of this rank's own in flight: CheckpointManager.close).
        s.checkpoint_manager.close(error)
        if rank == 0 and cfg.logger.loss_curve:
            # A start that failed and that torchrun restarts leaves the image to the next start
            # (the plot took 0.5 s here, and torchrun waits for every rank before it restarts), and
            # so does a failed attempt of an in-process restart: the next attempt draws it, and the
            # plot would sit on the restart's path, where NVRx may interrupt it half done.
            from tierstack.resiliency.restarts import launcher_restarts_left

            restarts_follow = cfg.resiliency.in_process or launcher_restarts_left()
            _write_loss_curve(s, history, run_dir, quiet=error is not None,
                              plot=error is None or not restarts_follow)


def _write_loss_curve(s, history, run_dir: Path, quiet: bool = False, plot: bool = True) -> None:
    """Record this run's checkpoints in the history, then (``plot``) plot the whole history (all
    runs); with ``quiet`` (the run is stopping on an error), its path goes to the rank's log file only."""
    from tierstack.runtime.failures import FILE_ONLY

    from tierstack.checkpointing import CheckpointTier
    from tierstack.observability.plots import plot_loss_curve

    try:
        recorded = history.checkpoint_steps()
        for tier in CheckpointTier:
            for step in s.checkpoint_manager.saved_steps(tier):
                if step not in recorded.get(tier.name, []):
                    history.add_checkpoint(step, tier)
        if not plot:
            return
        out = plot_loss_curve(
            history.metrics(), run_dir / "loss_curve.png", history.checkpoint_steps(), history.resume_steps()
        )
        log.info("loss curve: %s", out, extra=FILE_ONLY if quiet else None)
        s.loggers.log_artifact(out)
    except Exception as exc:  # a plot must never turn a finished run into a failed one
        log.warning("could not write the loss curve: %s", exc)
