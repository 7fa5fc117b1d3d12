"""Config sections of what a person sees of a run: console and run directory, TensorBoard, mlflow,
Weights & Biases and the profiler (kept apart from :mod:`tierstack.config.sections` so each module
stays small; that module re-exports them)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tierstack.config.base import _at_least, _Section, writable_dir_problem

WANDB_MODES = ("online", "offline", "disabled")  # wandb.init(mode=...)
RUN_DIR_TOKEN = "{run_dir}"  # in logger.tensorboard_dir: replaced by logger.run_dir


def _importable(name: str) -> bool:
    """True when package ``name`` can be imported (checked without importing it: wandb takes seconds)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ValueError, ImportError):  # a module set to None in sys.modules (blocked), a broken parent
        return False


LOG_FORMATS = ("tierstack", "megatron")  # logger.format


@dataclass(kw_only=True)
class LoggerConfig(_Section):
    """Console progress, run directory and TensorBoard."""

    run_dir: str = "runs/default"  # where logs, plots and the default mlflow store go
    log_interval: int = 10  # iterations between rank-0 log lines
    progress_bar: bool = True  # tqdm bar on rank 0
    loss_curve: bool = True  # write <run_dir>/loss_curve.png at the end of the run (rank 0, matplotlib)
    # TensorBoard event files, written by rank 0 (the same scalars as mlflow, the config as text);
    # "{run_dir}" stands for logger.run_dir; null = off.
    tensorboard_dir: Optional[str] = "{run_dir}/tensorboard"
    # Per-phase step timers (data, forward-backward, optimizer, checkpoint, eval) averaged over
    # the log interval, slowest rank named: one small all-gather per log line.
    timers: bool = True
    # the log line and the experiment tracker's metric names: "tierstack", or "megatron" (Megatron-LM's
    # training log line and metric names: lm loss, learning-rate, grad-norm, ...)
    format: str = "tierstack"
    # every rank's own log file, <rank_log_dir>/rank<R>.log (appended across restarts): its INFO lines
    # and warnings, and the traceback of an error that stopped it, which the console gets as one
    # line when another rank is gone; "{run_dir}" stands for logger.run_dir; null = off.
    rank_log_dir: Optional[str] = "{run_dir}/logs"

    def rank_log_path(self, rank: int) -> Optional[Path]:
        """``<rank_log_dir>/rank<rank>.log`` with ``{run_dir}`` replaced, or None when the files are off."""
        if self.rank_log_dir is None:
            return None
        return Path(self.rank_log_dir.replace(RUN_DIR_TOKEN, self.run_dir)) / f"rank{rank}.log"

    def tensorboard_path(self) -> Optional[Path]:
        """``tensorboard_dir`` with ``{run_dir}`` replaced, or None when TensorBoard is off."""
        if self.tensorboard_dir is None:
            return None
        return Path(self.tensorboard_dir.replace(RUN_DIR_TOKEN, self.run_dir))

    def problems(self) -> list[str]:
        p = _at_least("logger", self, ("log_interval",))
        if self.format not in LOG_FORMATS:
            p.append(f"logger.format={self.format!r}: use one of {list(LOG_FORMATS)}")
        if self.tensorboard_dir is not None and not _importable("tensorboard"):
            p.append("logger.tensorboard_dir is set but the tensorboard package is not installed: pip install "
                     "tensorboard (or set logger.tensorboard_dir=null)")
        return p

    def path_problems(self) -> list[str]:
        """``tensorboard_dir`` and ``rank_log_dir`` creatable and writable as this process sees it."""
        out = []
        problem = writable_dir_problem(None if self.tensorboard_dir is None else str(self.tensorboard_path()))
        if problem:
            out.append(f"logger.tensorboard_dir={self.tensorboard_path()}: {problem}")
        log_path = self.rank_log_path(0)
        problem = writable_dir_problem(None if log_path is None else str(log_path.parent))
        if problem:
            out.append(f"logger.rank_log_dir={log_path.parent}: {problem}")
        return out


@dataclass(kw_only=True)
class MlflowConfig(_Section):
    """mlflow tracking; only rank 0 talks to mlflow."""

    tracking_uri: Optional[str] = None  # None = sqlite store inside logger.run_dir
    experiment_name: str = "tierstack"
    run_name: Optional[str] = None


@dataclass(kw_only=True)
class WandbConfig(_Section):
    """Weights & Biases (the ``wandb`` package); only rank 0 talks to it. The run id is kept in
    ``<run_dir>/wandb_run_id.txt`` so that a resume continues the same W&B run."""

    project: str = "tierstack"  # W&B project
    # online, offline (no network: sync later with `wandb sync`), disabled; null = $WANDB_MODE, else online
    mode: Optional[str] = None
    entity: Optional[str] = None  # W&B team or user; None = the account's default
    run_name: Optional[str] = None  # display name; None = W&B's own
    tags: list = field(default_factory=list)  # W&B run tags
    dir: Optional[str] = None  # where wandb writes its files; None = logger.run_dir

    def problems(self) -> list[str]:
        p = []
        if self.mode is not None and self.mode not in WANDB_MODES:
            p.append(f"wandb.mode={self.mode!r}: use one of {list(WANDB_MODES)}")
        if not self.project:
            p.append("wandb.project: give a project name (or wandb=null to turn W&B off)")
        if not _importable("wandb"):
            p.append("wandb: the section is on but the wandb package is not installed: pip install wandb "
                     "(or set wandb=null)")
        return p


@dataclass(kw_only=True)
class ProfileConfig(_Section):
    """``torch.profiler`` over a window of steps: a Chrome/Perfetto trace and a table of the top
    operators per profiled rank under ``<run_dir>/profile/``; NVTX ranges on GPU."""

    enabled: bool = False
    step_start: int = 5  # first profiled iteration (1-based, as in the log lines)
    step_end: int = 7  # last profiled iteration (inclusive)
    ranks: list = field(default_factory=lambda: [0])  # global ranks that profile
    top_operators: int = 25  # rows of the operator table (by self CPU time; CUDA time on GPU)

    def problems(self) -> list[str]:
        if not self.enabled:
            return []
        p = _at_least("profile", self, ("step_start", "top_operators"))
        if self.step_end < self.step_start:
            p.append(f"profile.step_end={self.step_end} is before profile.step_start={self.step_start}: "
                     "give step_end >= step_start")
        if not self.ranks or any(not isinstance(r, int) or r < 0 for r in self.ranks):
            p.append(f"profile.ranks={self.ranks}: give a list of global ranks >= 0, e.g. [0]")
        return p
