"""One keyword-only dataclass per config section, each checking its own fields.

Every field has a comment saying what it means and its unit. ``None`` turns a feature off.
Each section's ``problems()`` lists what is wrong with its own fields (naming each field to change)
and ``validate()`` raises them at once; a component that takes one section (the straggler monitor,
the tokenizer builder, the dataset builder) calls the same method, so a rule is written once.
Rules that span sections (TP divides heads, ...) live in ``ConfigContainer.validate``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from tierstack.config.data_path import parse_data_path  # noqa: F401 - re-exported (its home was here)
from tierstack.config.base import ConfigError, _at_least, _Section, writable_dir_problem  # noqa: F401 - ConfigError re-exported
from tierstack.config.observability_sections import (  # noqa: F401 - re-exported: logger sections live there
    LOG_FORMATS,
    WANDB_MODES,
    LoggerConfig,
    MlflowConfig,
    ProfileConfig,
    WandbConfig,
)
from tierstack.config.resiliency_section import ResiliencyConfig  # noqa: F401 - re-exported: its own module
from tierstack.config.memory_steps import memory_step_problems
from tierstack.config.model_section import (  # noqa: F401 - re-exported: the model section lives in its own module
    ACTIVATION_FUNCS,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    TRANSFORMER_IMPLS,
    ModelConfig,
)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
# checkpoint.best_metric: metric name -> lower is better (only metrics the training loop computes)
BEST_METRICS = {"val_loss": True}
ON_NONFINITE = ("stop", "skip")  # checkpoint.on_nonfinite
TOKENIZER_TYPES = ("byte", "huggingface")
# train.exit_signal: signals a rank can catch that no launcher or library here uses for something else
_EXIT_SIGNALS = frozenset({"SIGUSR1", "SIGUSR2", "SIGXCPU", "SIGALRM"})


@dataclass(kw_only=True)
class TrainConfig(_Section):
    """Loop length and batch sizes (in samples)."""

    train_iters: int = 200  # optimizer steps
    micro_batch_size: int = 8  # samples per forward/backward per data-parallel rank
    global_batch_size: int = 8  # samples per optimizer step; multiple of micro_batch_size * DP
    eval_interval: Optional[int] = 50  # iterations between validation runs; None = never
    eval_iters: int = 4  # global batches per validation run
    exit_interval: Optional[int] = None  # stop (after checkpointing) when iteration % this == 0
    # A signal that asks for the planned exit (checkpoint, then stop) like SIGTERM, sent ahead of
    # it: SLURM's `--signal=USR1@120`. Our launcher forwards it to the ranks; null = none.
    exit_signal: Optional[str] = "SIGUSR1"
    # Time budget of the job in minutes, counted from its start: the run saves GLOBAL and exits
    # (a planned exit, status 0) when the next step and that save would pass it. None = no budget.
    exit_duration_in_mins: Optional[float] = None

    def problems(self) -> list[str]:
        p = _at_least("train", self, ("train_iters", "micro_batch_size", "global_batch_size"))
        if self.eval_interval is not None and self.eval_interval < 1:
            p.append("train.eval_interval must be >= 1 or null")
        if self.eval_iters < 0:
            p.append("train.eval_iters must be >= 0")
        if self.exit_signal is not None and self.exit_signal not in _EXIT_SIGNALS:
            p.append(f"train.exit_signal={self.exit_signal!r}: use one of {sorted(_EXIT_SIGNALS)}, or null")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            p.append(f"train.exit_duration_in_mins={self.exit_duration_in_mins}: must be > 0 minutes or null")
        return p


@dataclass(kw_only=True)
class OptimizerConfig(_Section):
    """Adam over megatron-core ``get_megatron_optimizer``."""

    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # floor of the cosine decay
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global gradient-norm clip; 0 disables
    use_distributed_optimizer: bool = False  # shard optimizer state across data-parallel ranks

    def problems(self) -> list[str]:
        if self.lr > 0 and self.min_lr > self.lr:  # an lr override leaves the recipe's min_lr behind
            return [f"optimizer.min_lr={self.min_lr:g} is above optimizer.lr={self.lr:g} (the decay would raise the LR): "
                    f"set optimizer.min_lr too, e.g. optimizer.min_lr={self.lr / 10:g}"]
        if self.lr <= 0 or self.min_lr < 0:
            return [f"optimizer.lr={self.lr} / optimizer.min_lr={self.min_lr}: need 0 <= min_lr <= lr, lr > 0"]
        return []


@dataclass(kw_only=True)
class SchedulerConfig(_Section):
    """LR schedule (megatron-core ``OptimizerParamScheduler``)."""

    lr_warmup_iters: int = 20  # linear warmup length in iterations
    lr_decay_iters: Optional[int] = None  # None = train.train_iters
    lr_decay_style: str = "cosine"  # constant, linear, cosine, inverse-square-root, WSD
    start_weight_decay: Optional[float] = None  # None = optimizer.weight_decay
    end_weight_decay: Optional[float] = None  # None = optimizer.weight_decay
    # At resume: false keeps the checkpoint's schedule (LR, warmup, decay length and style, weight
    # decay) and warns when this config implies another; true follows this config's schedule from
    # the resumed iteration on (megatron-core's override_opt_param_scheduler).
    override_opt_param_scheduler: bool = False

    def problems(self) -> list[str]:
        p = []
        if self.lr_decay_style not in LR_DECAY_STYLES:
            p.append(f"scheduler.lr_decay_style={self.lr_decay_style!r}: use one of {LR_DECAY_STYLES}")
        if self.lr_warmup_iters < 0:
            p.append("scheduler.lr_warmup_iters must be >= 0")
        return p


@dataclass(kw_only=True)
class DatasetConfig(_Section):
    """Training data. ``data_path`` None means the built-in corpus (Python standard library sources)."""

    # Megatron indexed-dataset prefix(es), without .bin/.idx: one path, a list, or a blend with weights
    # first as in Megatron's --data-path: "0.3 /data/a 0.7 /data/b" or [0.3, /data/a, 0.7, /data/b]
    data_path: Optional[Any] = None
    split: str = "98,2,0"  # train,valid,test weights over documents
    mock: bool = False  # synthetic tokens (fast tests); no files read
    cache_dir: str = ".cache/tierstack"  # where the built-in corpus and dataset indices are cached
    num_workers: int = 0  # DataLoader workers per rank

    def problems(self) -> list[str]:
        p = []
        try:
            weights = [float(x) for x in self.split.split(",")]
            if len(weights) != 3 or any(w < 0 for w in weights) or weights[0] <= 0:
                raise ValueError
        except ValueError:
            p.append(f"dataset.split={self.split!r}: expected three non-negative weights 'train,valid,test'")
        if self.data_path is not None and not self.mock:
            try:
                parse_data_path(self.data_path)
            except (ValueError, FileNotFoundError) as exc:
                p.append(str(exc))
        return p


@dataclass(kw_only=True)
class TokenizerConfig(_Section):
    """Tokenizer: byte-level (vocab 256 + end-of-document) or a local Hugging Face tokenizer.json."""

    tokenizer_type: str = "byte"  # "byte" or "huggingface"
    tokenizer_path: Optional[str] = None  # path to tokenizer.json when tokenizer_type == "huggingface"

    def problems(self) -> list[str]:
        if self.tokenizer_type not in TOKENIZER_TYPES:
            return [f"tokenizer.tokenizer_type={self.tokenizer_type!r}: use 'byte' or 'huggingface'"]
        if self.tokenizer_type == "huggingface":
            if not self.tokenizer_path:
                return ["tokenizer.tokenizer_path: required for tokenizer_type=huggingface (path to tokenizer.json)"]
            if not tokenizer_file(self.tokenizer_path).is_file():
                return [f"tokenizer.tokenizer_path={self.tokenizer_path!r}: no tokenizer.json found there"]
        return []


def tokenizer_file(path: str | os.PathLike) -> Path:
    """The ``tokenizer.json`` that ``tokenizer.tokenizer_path`` names: the file itself, or the one in a directory."""
    file = Path(path).expanduser()
    return file / "tokenizer.json" if file.is_dir() else file


@dataclass(kw_only=True)
class DistributedConfig(_Section):
    """Parallel layout. Data-parallel size is world_size / (TP * PP)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    backend: Optional[str] = None  # None = nccl on GPU, gloo on CPU
    timeout_s: float = 600.0  # collective timeout in seconds

    def problems(self) -> list[str]:
        return _at_least("distributed", self, ("tensor_model_parallel_size", "pipeline_model_parallel_size"))


@dataclass(kw_only=True)
class CheckpointConfig(_Section):
    """Two checkpoint tiers. GLOBAL: persistent torch_dist; LOCAL: node-local per-rank (NVRx)."""

    save: Optional[str] = None  # GLOBAL checkpoint directory; None = no GLOBAL saves
    # iterations between GLOBAL saves; "auto": chosen from measurements and mtbf_s (Young/Daly, see
    # checkpointing/intervals.py), re-estimated after every save and logged
    save_interval: Optional[Union[int, str]] = None
    load: Optional[str] = None  # GLOBAL directory to resume from; None = same as save
    ckpt_step: Optional[int] = None  # load this exact step instead of the newest
    # LOCAL checkpoint root: node-local disk, or a tmpfs such as /dev/shm/<run> (README says when); None = no LOCAL tier
    local_dir: Optional[str] = None
    local_save_interval: Optional[Union[int, str]] = None  # iterations between LOCAL saves, or "auto"
    # iterations between LOCAL memory steps: staged into host memory like a LOCAL save, no file;
    # under resiliency.restart=in-process the healthy ranks resume from the newest (null = none)
    memory_save_interval: Optional[int] = None
    # memory steps' host buffers as files in this tmpfs (e.g. /dev/shm): a process that takes the rank of
    # one that died on the same node resumes its memory step too (null = in the process's own memory)
    memory_dir: Optional[str] = None
    mtbf_s: Optional[float] = None  # mean time between unplanned failures of the whole job, seconds (for "auto")
    most_recent_k: int = 2  # checkpoints kept per tier; -1 keeps all
    async_save: bool = False  # GLOBAL saves in a background writer (LOCAL saves always are)
    fully_parallel_save: bool = True  # spread GLOBAL writes over data-parallel ranks
    fully_parallel_load: bool = True
    save_optim: bool = True
    load_optim: bool = True
    save_rng: bool = True
    load_rng: bool = True
    # Fine-tuning: on a fresh start, load model weights only from this GLOBAL root or step directory;
    # counters, optimizer and LR schedule start fresh. A checkpoint of this run itself wins over it.
    pretrained_checkpoint: Optional[str] = None
    exit_on_missing_checkpoint: bool = False  # error if `load` is set but holds no checkpoint
    allow_fresh_start_on_invalid: bool = False  # start fresh when checkpoints exist but none is valid
    save_retries: int = 3  # attempts for transient I/O errors
    retry_backoff_s: float = 1.0  # first backoff in seconds (exponential)
    exit_on_save_failure: bool = False  # stop training when a save fails on any rank
    # A blocking wait for a tier's writer thread (the next save of that tier, or the end of the run)
    # gives up after this many seconds: the save fails on every rank, naming the ranks still writing.
    async_write_timeout_s: float = 1800.0
    # Seconds any one checkpoint collective (agreements, megatron's metadata exchange and barriers,
    # each poll of a writer wait) may wait for a peer: a rank that is gone or hung becomes an error
    # on every rank within this bound instead of distributed.timeout_s. A slow write is bounded by
    # async_write_timeout_s instead (its wait is many short polls). null = distributed.timeout_s.
    collective_timeout_s: Optional[float] = 120.0
    # LOCAL replicas on other nodes (nvidia-resiliency-ext clique replication): each rank's LOCAL
    # file is also kept by replication_factor - 1 ranks, replication_jump ranks apart (default:
    # the ranks per node, i.e. on the next nodes). 1 = off. A step is sealed once every replica holds it.
    replication_factor: int = 1
    replication_jump: Optional[int] = None
    # Quarantined (*.invalid-*) LOCAL files of a rank and GLOBAL directories are kept for inspection
    # up to this many bytes per directory; retention removes the oldest beyond it and logs each.
    # None: as much as the checkpoint just sealed (one checkpoint's worth).
    quarantine_budget_bytes: Optional[int] = None
    # Top-K best GLOBAL checkpoints by a validation metric (0 = off); retention never removes them.
    keep_best_k: int = 0
    best_metric: str = "val_loss"  # the metric ranking them; lower is better (val_loss: nats per token)
    save_on_best: bool = False  # save GLOBAL right after a validation that enters the top-K
    # A checkpoint boundary after non-finite loss/gradients (in an applied step) on any rank saves
    # nothing in any tier; a save whose staged state holds NaN/inf on any rank is kept in no tier
    # (found on the writer threads, applied when the save ends); then: stop (raise) or skip (train on).
    on_nonfinite: str = "stop"

    def problems(self) -> list[str]:
        p = self._best_problems()
        if self.replication_factor < 1:
            p.append("checkpoint.replication_factor must be >= 1 (1 = no replicas)")
        if self.replication_factor > 1 and self.local_dir is None:
            p.append("checkpoint.replication_factor > 1 replicates LOCAL checkpoints: set checkpoint.local_dir")
        if self.replication_jump is not None and self.replication_jump < 1:
            p.append("checkpoint.replication_jump must be >= 1 or null (= ranks per node)")
        if self.quarantine_budget_bytes is not None and self.quarantine_budget_bytes < 0:
            p.append("checkpoint.quarantine_budget_bytes must be >= 0 or null")
        for name in ("save_interval", "local_save_interval"):
            value = getattr(self, name)
            if isinstance(value, str) and value != "auto":
                p.append(f"checkpoint.{name}={value!r}: give a number of iterations, auto, or null")
            elif value == "auto" and not (self.mtbf_s or 0) > 0:
                p.append(f"checkpoint.{name}=auto needs checkpoint.mtbf_s (mean time between failures of the "
                         "job, seconds > 0)")
        if self.mtbf_s is not None and not self.mtbf_s > 0:
            p.append("checkpoint.mtbf_s must be > 0 seconds or null")
        if isinstance(self.save_interval, int) and self.save_interval < 1:
            p.append("checkpoint.save_interval must be >= 1, auto or null")
        if self.save_interval is not None and self.save is None:
            p.append("checkpoint.save_interval is set but checkpoint.save (GLOBAL directory) is not")
        if isinstance(self.local_save_interval, int) and self.local_save_interval < 1:
            p.append("checkpoint.local_save_interval must be >= 1, auto or null")
        if self.local_save_interval is not None and self.local_dir is None:
            p.append("checkpoint.local_save_interval is set but checkpoint.local_dir is not")
        p += memory_step_problems(self)
        if self.most_recent_k == 0 or self.most_recent_k < -1:
            p.append("checkpoint.most_recent_k must be >= 1, or -1 to keep all")
        if self.ckpt_step is not None and self.ckpt_step < 0:
            p.append("checkpoint.ckpt_step must be >= 0")
        if self.save_retries < 1:
            p.append("checkpoint.save_retries must be >= 1 (attempts, including the first)")
        if not self.async_write_timeout_s > 0:
            p.append("checkpoint.async_write_timeout_s must be > 0 (seconds)")
        if self.collective_timeout_s is not None and not self.collective_timeout_s > 0:
            p.append("checkpoint.collective_timeout_s must be > 0 (seconds), or null for distributed.timeout_s")
        if self.retry_backoff_s < 0:
            p.append("checkpoint.retry_backoff_s must be >= 0")
        if self.pretrained_checkpoint is not None:
            p += _pretrained_problems(self.pretrained_checkpoint)
        if self.exit_on_missing_checkpoint and self.load is None and self.save is None and self.local_dir is None:
            p.append("checkpoint.exit_on_missing_checkpoint needs checkpoint.load, save or local_dir")
        return p

    def path_problems(self) -> list[str]:
        """The checkpoint directories as this process sees them: ``save`` and ``local_dir``
        creatable and writable (and ``memory_dir``), ``load`` readable. Checked before any rank starts work, not deep
        inside a save. They can differ between nodes (a node-local disk, a mount missing on one
        node), so with several ranks every rank checks its own and the ranks agree
        (:func:`tierstack.training.setup` after the process groups exist)."""
        p = []
        for name in ("save", "local_dir", "memory_dir"):
            problem = writable_dir_problem(getattr(self, name))
            if problem:
                p.append(f"checkpoint.{name}={getattr(self, name)}: {problem}")
        if self.load is not None and Path(self.load).exists() and not os.access(self.load, os.R_OK | os.X_OK):
            p.append(f"checkpoint.load={self.load}: not readable")
        elif self.load is not None and not Path(self.load).exists() and (
                self.save is None or Path(self.load).resolve() != Path(self.save).resolve()):
            # a directory given to resume from that is not there is a typo or a missing mount, not a
            # fresh start (leaving it unset resumes from checkpoint.save, or starts fresh there)
            p.append(f"checkpoint.load={self.load}: does not exist; to start fresh, leave checkpoint.load unset "
                     "(it defaults to checkpoint.save)")
        return p

    def _best_problems(self) -> list[str]:
        p = []
        if self.keep_best_k < 0:
            p.append(f"checkpoint.keep_best_k={self.keep_best_k}: must be >= 0 (0 = off)")
        if self.best_metric not in BEST_METRICS:
            p.append(f"checkpoint.best_metric={self.best_metric!r}: unknown, use one of {sorted(BEST_METRICS)}")
        if self.keep_best_k > 0 and self.save is None:
            p.append("checkpoint.keep_best_k is set but checkpoint.save (GLOBAL directory) is not")
        if self.save_on_best and self.keep_best_k < 1:
            p.append("checkpoint.save_on_best needs checkpoint.keep_best_k >= 1")
        if self.on_nonfinite not in ON_NONFINITE:
            p.append(f"checkpoint.on_nonfinite={self.on_nonfinite!r}: use one of {list(ON_NONFINITE)}")
        return p


def _pretrained_problems(spec: str) -> list[str]:
    """``checkpoint.pretrained_checkpoint``: a path that exists, or ``<GLOBAL root>:best`` whose
    ``best`` tracker names a step directory that exists."""
    from tierstack.config.pretrained_spec import BEST_SUFFIX, TRACKER_ITERATION, resolve_pretrained

    if spec.endswith(BEST_SUFFIX):
        try:
            resolve_pretrained(spec)
        except FileNotFoundError as e:
            return [str(e)]
        return []
    path = Path(spec)
    if not path.exists():
        return [f"checkpoint.pretrained_checkpoint={spec}: not found"]
    if not (path.name.startswith("iter_") or (path / TRACKER_ITERATION).is_file() or (path / "config.json").is_file()):
        return [f"checkpoint.pretrained_checkpoint={spec}: holds no checkpoint; give a GLOBAL step directory "
                f"(iter_NNNNNNN), a GLOBAL root with {TRACKER_ITERATION}, <root>:best, or a Hugging Face "
                "directory with config.json"]
    return []


@dataclass(kw_only=True)
class RNGConfig(_Section):
    seed: int = 1234  # base seed; megatron-core offsets it per pipeline stage and TP rank


@dataclass(kw_only=True)
class StragglerConfig(_Section):
    """NVRx straggler detection (``nvidia_resiliency_ext.attribution.straggler.Detector``)."""

    report_interval: int = 20  # iterations between reports
    relative_threshold: float = 0.7  # rank flagged when its relative score is below this
    individual_threshold: float = 0.7  # rank flagged when its individual score is below this
    num_scores_to_print: int = 4  # slowest ranks listed in the log
    stop_if_detected: bool = False  # save GLOBAL and exit when a straggler is found
    profiling_interval: int = 1  # profile every n-th step

    def problems(self) -> list[str]:
        p = _at_least("straggler", self, ("report_interval", "profiling_interval"))
        # Scores are ratios in (0, 1] (nvidia-resiliency-ext): a threshold outside it cannot mean anything.
        for name in ("relative_threshold", "individual_threshold"):
            if not 0.0 < getattr(self, name) <= 1.0:
                p.append(f"straggler.{name}={getattr(self, name)}: must be in (0, 1]")
        return p


SECTION_TYPES = {
    "model": ModelConfig,
    "train": TrainConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "dataset": DatasetConfig,
    "tokenizer": TokenizerConfig,
    "distributed": DistributedConfig,
    "checkpoint": CheckpointConfig,
    "logger": LoggerConfig,
    "rng": RNGConfig,
    "straggler": StragglerConfig,
    "mlflow": MlflowConfig,
    "wandb": WandbConfig,
    "profile": ProfileConfig,
    "resiliency": ResiliencyConfig,
}
