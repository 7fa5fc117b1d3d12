"""``ConfigContainer``: all sections, command-line overrides and pre-launch validation."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tierstack.config.sections import (
    SECTION_TYPES,
    CheckpointConfig,
    DatasetConfig,
    DistributedConfig,
    LoggerConfig,
    MlflowConfig,
    ModelConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    StragglerConfig,
    TokenizerConfig,
    TrainConfig,
)


class ConfigError(ValueError):
    """Raised with every problem found in a config, each naming the field to change."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


_OPTIONAL_SECTIONS = ("straggler", "mlflow")
_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


@dataclass(kw_only=True)
class ConfigContainer:
    """Every section of a run. ``straggler`` and ``mlflow`` are off when None."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)
    straggler: Optional[StragglerConfig] = None
    mlflow: Optional[MlflowConfig] = None

    # ------------------------------------------------------------------ overrides
    def apply_overrides(self, dotlist: Iterable[str]) -> "ConfigContainer":
        """Apply ``section.field=value`` overrides (omegaconf dotlist syntax) in place.

        ``straggler.report_interval=5`` on a config whose ``straggler`` is None turns the section on
        with defaults first; ``straggler=null`` turns it off.

        Raises:
            ConfigError: an override is malformed, names an unknown section or field, or has a value
                of the wrong type. All problems are listed at once.
        """
        problems: list[str] = []
        for item in dotlist:
            if "=" not in item:
                problems.append(f"override {item!r}: expected section.field=value")
                continue
            key, raw = item.split("=", 1)
            parts = key.strip().split(".")
            section = parts[0]
            if section not in SECTION_TYPES:
                problems.append(
                    f"override {item!r}: unknown section {section!r}; known: {', '.join(SECTION_TYPES)}"
                )
                continue
            if len(parts) == 1:
                if section in _OPTIONAL_SECTIONS and raw.strip().lower() in ("null", "none", "off"):
                    setattr(self, section, None)
                elif section in _OPTIONAL_SECTIONS and raw.strip().lower() in ("on", "true", "{}"):
                    setattr(self, section, SECTION_TYPES[section]())
                else:
                    problems.append(f"override {item!r}: give a field, e.g. {section}.<field>=value")
                continue
            if len(parts) != 2:
                problems.append(f"override {item!r}: expected exactly section.field")
                continue
            name = parts[1]
            current = getattr(self, section)
            if current is None:
                current = SECTION_TYPES[section]()
            names = {f.name for f in dataclasses.fields(current)}
            if name not in names:
                problems.append(
                    f"override {item!r}: unknown field {section}.{name}; known: {', '.join(sorted(names))}"
                )
                continue
            try:
                structured = OmegaConf.structured(current)
                merged = OmegaConf.merge(structured, OmegaConf.from_dotlist([f"{name}={raw}"]))
                new = OmegaConf.to_object(merged)
            except OmegaConfBaseException as exc:
                msg = str(exc).splitlines()[0]
                problems.append(f"override {item!r}: bad value for {section}.{name}: {msg}")
                continue
            setattr(self, section, new)
        if problems:
            raise ConfigError(problems)
        return self

    # ---------------------------------------------------------------- validation
    def validate(self, world_size: Optional[int] = None) -> None:
        """Check everything that can be checked before launch.

        Args:
            world_size: number of ranks; defaults to ``$WORLD_SIZE`` or 1.

        Raises:
            ConfigError: listing each problem with the field to change.
        """
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        p: list[str] = []
        m, t, d, o = self.model, self.train, self.distributed, self.optimizer
        tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
        for name, value in (
            ("distributed.tensor_model_parallel_size", tp),
            ("distributed.pipeline_model_parallel_size", pp),
            ("model.num_layers", m.num_layers),
            ("model.hidden_size", m.hidden_size),
            ("model.num_attention_heads", m.num_attention_heads),
            ("model.seq_length", m.seq_length),
            ("train.train_iters", t.train_iters),
            ("train.micro_batch_size", t.micro_batch_size),
            ("train.global_batch_size", t.global_batch_size),
            ("logger.log_interval", self.logger.log_interval),
        ):
            if value < 1:
                p.append(f"{name}={value}: must be >= 1")
        if p:
            raise ConfigError(p)
        p += self._validate_parallel(world_size)
        if m.transformer_impl not in ("auto", "local", "transformer_engine"):
            p.append(f"model.transformer_impl={m.transformer_impl!r}: use auto, local or transformer_engine")
        if self.scheduler.lr_decay_style not in _LR_DECAY_STYLES:
            p.append(f"scheduler.lr_decay_style={self.scheduler.lr_decay_style!r}: use one of {_LR_DECAY_STYLES}")
        if self.scheduler.lr_warmup_iters < 0:
            p.append("scheduler.lr_warmup_iters must be >= 0")
        if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
            p.append(f"optimizer.lr={o.lr} / optimizer.min_lr={o.min_lr}: need 0 <= min_lr <= lr, lr > 0")
        if t.eval_interval is not None and t.eval_interval < 1:
            p.append("train.eval_interval must be >= 1 or null")
        if t.eval_iters < 0:
            p.append("train.eval_iters must be >= 0")
        p += self._validate_data()
        p += self._validate_checkpoint()
        if self.straggler is not None:
            s = self.straggler
            if s.report_interval < 1:
                p.append("straggler.report_interval must be >= 1")
            if s.profiling_interval < 1:
                p.append("straggler.profiling_interval must be >= 1")
            for n in ("relative_threshold", "individual_threshold"):
                if not 0.0 <= getattr(s, n) <= 1.0:
                    p.append(f"straggler.{n} must be in [0, 1]")
        if p:
            raise ConfigError(p)

    def _validate_parallel(self, world_size: int) -> list[str]:
        """Megatron's divisibility rules: heads by TP, layers by PP, ranks by TP*PP, batch by micro*DP."""
        p: list[str] = []
        m, t, d = self.model, self.train, self.distributed
        tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
        if m.num_attention_heads % tp:
            p.append(
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                f"distributed.tensor_model_parallel_size={tp}"
            )
        if m.hidden_size % m.num_attention_heads:
            p.append(
                f"model.hidden_size={m.hidden_size} is not divisible by "
                f"model.num_attention_heads={m.num_attention_heads}"
            )
        if m.num_layers % pp:
            p.append(
                f"model.num_layers={m.num_layers} is not divisible by "
                f"distributed.pipeline_model_parallel_size={pp}"
            )
        if world_size % (tp * pp):
            p.append(
                f"world size {world_size} is not divisible by tensor_model_parallel_size * "
                f"pipeline_model_parallel_size = {tp * pp}; change distributed.* or --nproc-per-node"
            )
        else:
            dp = world_size // (tp * pp)
            if t.global_batch_size % (t.micro_batch_size * dp):
                p.append(
                    f"train.global_batch_size={t.global_batch_size} is not divisible by "
                    f"train.micro_batch_size * data_parallel_size = {t.micro_batch_size} * {dp}"
                )
        return p

    def _validate_data(self) -> list[str]:
        p: list[str] = []
        ds, tok = self.dataset, self.tokenizer
        if tok.tokenizer_type not in ("byte", "huggingface"):
            p.append(f"tokenizer.tokenizer_type={tok.tokenizer_type!r}: use 'byte' or 'huggingface'")
        elif tok.tokenizer_type == "huggingface":
            if not tok.tokenizer_path:
                p.append("tokenizer.tokenizer_path: required for tokenizer_type=huggingface")
            elif not Path(tok.tokenizer_path).is_file():
                p.append(f"tokenizer.tokenizer_path={tok.tokenizer_path}: file not found")
        try:
            weights = [float(x) for x in ds.split.split(",")]
            if len(weights) != 3 or any(w < 0 for w in weights) or weights[0] <= 0:
                raise ValueError
        except ValueError:
            p.append(f"dataset.split={ds.split!r}: expected three non-negative weights 'train,valid,test'")
        if ds.data_path is not None and not ds.mock:
            paths = list(ds.data_path)
            prefixes = paths[1::2] if len(paths) > 1 and _is_number(paths[0]) else paths
            for prefix in prefixes:
                for ext in (".bin", ".idx"):
                    if not Path(f"{prefix}{ext}").is_file():
                        p.append(
                            f"dataset.data_path: {prefix}{ext} not found "
                            "(run `tierstack preprocess` to build it)"
                        )
        return p

    def _validate_checkpoint(self) -> list[str]:
        p: list[str] = []
        c = self.checkpoint
        if c.save_interval is not None and c.save_interval < 1:
            p.append("checkpoint.save_interval must be >= 1 or null")
        if c.save_interval is not None and c.save is None:
            p.append("checkpoint.save_interval is set but checkpoint.save (GLOBAL directory) is not")
        if c.local_save_interval is not None and c.local_save_interval < 1:
            p.append("checkpoint.local_save_interval must be >= 1 or null")
        if c.local_save_interval is not None and c.local_dir is None:
            p.append("checkpoint.local_save_interval is set but checkpoint.local_dir is not")
        if c.most_recent_k == 0 or c.most_recent_k < -1:
            p.append("checkpoint.most_recent_k must be >= 1, or -1 to keep all")
        if c.ckpt_step is not None and c.ckpt_step < 0:
            p.append("checkpoint.ckpt_step must be >= 0")
        if c.save_retries < 1:
            p.append("checkpoint.save_retries must be >= 1 (attempts, including the first)")
        if c.retry_backoff_s < 0:
            p.append("checkpoint.retry_backoff_s must be >= 0")
        if c.pretrained_checkpoint is not None and not Path(c.pretrained_checkpoint).exists():
            p.append(f"checkpoint.pretrained_checkpoint={c.pretrained_checkpoint}: not found")
        if c.exit_on_missing_checkpoint and c.load is None and c.save is None and c.local_dir is None:
            p.append("checkpoint.exit_on_missing_checkpoint needs checkpoint.load, save or local_dir")
        return p

    # ------------------------------------------------------------------ helpers
    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of the config (for run params and the run config file)."""
        return dataclasses.asdict(self)

    def flat_params(self) -> dict[str, Any]:
        """``{"section.field": value}`` for every field of every enabled section."""
        out: dict[str, Any] = {}
        for sec, values in self.to_dict().items():
            if values is None:
                out[sec] = None
                continue
            for k, v in values.items():
                out[f"{sec}.{k}"] = v
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ConfigContainer":
        """Inverse of :meth:`to_dict`. Unknown keys raise :class:`ConfigError`."""
        kwargs: dict[str, Any] = {}
        problems: list[str] = []
        for sec, values in data.items():
            if sec not in SECTION_TYPES:
                problems.append(f"unknown section {sec!r}")
                continue
            if values is None:
                kwargs[sec] = None
                continue
            typ = SECTION_TYPES[sec]
            names = {f.name for f in dataclasses.fields(typ)}
            unknown = set(values) - names
            if unknown:
                problems.append(f"unknown field(s) in {sec}: {sorted(unknown)}")
                continue
            kwargs[sec] = typ(**values)
        if problems:
            raise ConfigError(problems)
        return cls(**kwargs)


def _is_number(text: Any) -> bool:
    try:
        float(text)
        return True
    except (TypeError, ValueError):
        return False
