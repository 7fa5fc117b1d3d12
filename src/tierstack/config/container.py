"""``ConfigContainer``: all sections, command-line overrides and pre-launch validation."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tierstack.config.foreign_names import hint
from tierstack.config.sections import (
    SECTION_TYPES,
    CheckpointConfig,
    ConfigError,
    DatasetConfig,
    DistributedConfig,
    LoggerConfig,
    MlflowConfig,
    ModelConfig,
    OptimizerConfig,
    ProfileConfig,
    ResiliencyConfig,
    RNGConfig,
    SchedulerConfig,
    StragglerConfig,
    TokenizerConfig,
    TrainConfig,
    WandbConfig,
)


_OPTIONAL_SECTIONS = ("straggler", "mlflow", "wandb")


@dataclass(kw_only=True)
class ConfigContainer:
    """Every section of a run. ``straggler``, ``mlflow`` and ``wandb`` are off when None."""

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
    wandb: Optional[WandbConfig] = None
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    resiliency: ResiliencyConfig = field(default_factory=ResiliencyConfig)

    # ------------------------------------------------------------------ overrides
    def apply_overrides(self, dotlist: Iterable[str]) -> "ConfigContainer":
        """Apply ``section.field=value`` overrides (omegaconf dotlist syntax) in place.

        ``straggler.report_interval=5`` on a config whose ``straggler`` is None turns the section on
        with defaults first; ``straggler=null`` turns it off. ``logger.run_dir=D`` also moves the
        checkpoint directories that lay inside the old run directory (``checkpoint.save``,
        ``checkpoint.local_dir``, as every recipe puts them) into ``D``, unless they are overridden
        too: a new run directory never resumes the old run's checkpoints by accident.

        Raises:
            ConfigError: an override is malformed, names an unknown section or field, or has a value
                of the wrong type. All problems are listed at once.
        """
        problems: list[str] = []
        given: set[str] = set()
        old_run_dir = self.logger.run_dir if self.logger is not None else None
        for item in dotlist:
            given.add(item.split("=", 1)[0].strip())
            if "=" not in item:
                problems.append(f"override {item!r}: expected section.field=value")
                continue
            key, raw = item.split("=", 1)
            parts = key.strip().split(".")
            label = f"override {item!r}"
            if not self._known_section(parts[0], key.strip(), label, problems):
                continue
            if len(parts) == 1:
                self._switch_section(parts[0], raw.strip().lower(), label, problems)
                continue
            if len(parts) != 2:
                problems.append(f"{label}: expected exactly section.field")
                continue
            self._set_field(parts[0], parts[1], lambda n, r=raw: OmegaConf.from_dotlist([f"{n}={r}"]), label, problems)
        if problems:
            raise ConfigError(problems)
        if "logger.run_dir" in given and old_run_dir is not None:
            self._move_checkpoint_dirs(old_run_dir, given)
        return self

    def apply_mapping(self, data: Mapping[str, Any], origin: str = "config file") -> "ConfigContainer":
        """Set the fields of ``{section: {field: value} | None}`` in place (a ``--config-file``).

        A section given as None turns an optional section off; a section given as a mapping sets
        those of its fields (an off optional section is turned on with defaults first). The values
        are typed YAML values, checked against each field's type as overrides are.

        Raises:
            ConfigError: an unknown section or field (with the tierstack name for a Megatron-Bridge or
                Megatron-LM one), a value of the wrong type, or a required section given as null;
                every problem at once, each prefixed with ``origin``.
        """
        problems: list[str] = []
        for section, values in data.items():
            if section not in SECTION_TYPES and isinstance(values, Mapping) and values:
                for name in values:  # each field of an unknown section may be a known foreign name
                    self._known_section(section, f"{section}.{name}", f"{origin}: {section}.{name}", problems)
                continue
            if not self._known_section(section, section, f"{origin}: section {section!r}", problems):
                continue
            if values is None:
                self._switch_section(section, "null", f"{origin}: {section}", problems)
                continue
            for name, value in values.items():
                self._set_field(section, name, lambda n, v=value: {n: v}, f"{origin}: {section}.{name}", problems)
        if problems:
            raise ConfigError(problems)
        return self

    @staticmethod
    def _known_section(section: str, key: str, label: str, problems: list[str]) -> bool:
        """True for a known section; else a problem (with a foreign-name hint when one fits)."""
        if section in SECTION_TYPES:
            return True
        tip = hint(key)  # a known name of Megatron-Bridge or Megatron-LM: the hint says more than the list
        problems.append(f"{label}: unknown section {section!r}; "
                        + (tip or f"known: {', '.join(SECTION_TYPES)}"))
        return False

    def _switch_section(self, section: str, word: str, label: str, problems: list[str]) -> None:
        """``straggler=null`` / ``straggler=on``: an optional section off or on (with defaults)."""
        if section in _OPTIONAL_SECTIONS and word in ("null", "none", "off"):
            setattr(self, section, None)
        elif section in _OPTIONAL_SECTIONS and word in ("on", "true", "{}"):
            setattr(self, section, SECTION_TYPES[section]())
        elif word in ("null", "none", "off"):
            problems.append(f"{label}: section {section} cannot be off (only {', '.join(_OPTIONAL_SECTIONS)} can)")
        else:
            problems.append(f"{label}: give a field, e.g. {section}.<field>=value")

    def _set_field(self, section: str, name: str, patch: Callable[[str], Any], label: str,
                   problems: list[str]) -> None:
        """Merge ``patch(name)`` (an omegaconf dotlist or a plain ``{name: value}``) into one field,
        type-checked by omegaconf against the section's dataclass; a problem names the field."""
        current = getattr(self, section)
        if current is None:
            current = SECTION_TYPES[section]()
        names = {f.name for f in dataclasses.fields(current)}
        if name not in names:
            tip = hint(f"{section}.{name}")
            problems.append(f"{label}: unknown field {section}.{name}; " + (tip or f"known: {', '.join(sorted(names))}"))
            return
        try:
            merged = OmegaConf.merge(OmegaConf.structured(current), patch(name))
            new = OmegaConf.to_object(merged)
        except OmegaConfBaseException as exc:
            msg = str(exc).splitlines()[0]
            problems.append(f"{label}: bad value for {section}.{name}: {msg}")
            return
        setattr(self, section, new)

    def _move_checkpoint_dirs(self, old_run_dir: str, given: set[str]) -> None:
        """Rebase ``checkpoint.save``/``local_dir`` that lay inside ``old_run_dir`` onto the new
        ``logger.run_dir`` (those given as overrides themselves stay as given)."""
        old, new = Path(old_run_dir), Path(self.logger.run_dir)
        if self.checkpoint is None or old == new:
            return
        for name in ("save", "local_dir"):
            value = getattr(self.checkpoint, name)
            if value is None or f"checkpoint.{name}" in given:
                continue
            try:
                inner = Path(value).relative_to(old)
            except ValueError:
                continue  # not inside the old run directory: the recipe put it elsewhere on purpose
            setattr(self.checkpoint, name, str(new / inner))

    # ---------------------------------------------------------------- validation
    def sections(self) -> dict[str, Any]:
        """``{name: section}`` of every enabled section (an off optional section is left out)."""
        return {name: getattr(self, name) for name in SECTION_TYPES if getattr(self, name) is not None}

    def validate(self, world_size: Optional[int] = None, ranks_per_node: Optional[int] = None,
                 check_paths: bool = True) -> None:
        """Check everything that can be checked before launch; raise every problem at once.

        Each section checks its own fields (``problems()`` of each section); this adds the rules
        that span sections (Megatron's divisibility rules, which need the world size).

        Args:
            world_size: number of ranks; defaults to ``$WORLD_SIZE`` or 1.
            ranks_per_node: ranks on each node; defaults to ``$LOCAL_WORLD_SIZE`` (torchrun's), else
                ``world_size`` (one node).
            check_paths: also check the checkpoint directories as this process sees them
                (``CheckpointConfig.path_problems``); False in a rank of several, whose setup
                checks them on every rank collectively (they can differ between nodes).

        Raises:
            ConfigError: listing each problem with the field to change.
        """
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        p: list[str] = []
        for section in self.sections().values():
            p += section.problems()
        # The parallel rules divide by sizes: they run once those sizes are known to be >= 1.
        m, t, d = self.model, self.train, self.distributed
        sizes = (m.num_attention_heads, m.num_layers, t.micro_batch_size, t.global_batch_size,
                 d.tensor_model_parallel_size, d.pipeline_model_parallel_size)
        if min(sizes) >= 1:
            p += self._validate_parallel(world_size)
        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world_size
        p += self._validate_replication(world_size, ranks_per_node)
        c = self.checkpoint
        if c is not None and check_paths:
            p += c.path_problems()
        if check_paths:
            p += self.logger.path_problems()
        if self.profile.enabled and any(r >= world_size for r in self.profile.ranks if isinstance(r, int)):
            p.append(f"profile.ranks={self.profile.ranks}: each rank must be < the world size {world_size}")
        if c is not None and c.memory_save_interval is not None and not self.resiliency.in_process:
            p.append(f"checkpoint.memory_save_interval={c.memory_save_interval} needs resiliency.restart=in-process "
                     "(a memory step lives in its process: only an in-process restart can resume from it)")
        if c is not None and c.save_on_best and not (t.eval_interval and t.eval_iters >= 1):
            p.append("checkpoint.save_on_best needs validation: set train.eval_interval (and train.eval_iters >= 1)")
        if p:
            raise ConfigError(p)

    def _validate_parallel(self, world_size: int) -> list[str]:
        """Megatron's divisibility rules: heads and query groups by TP, layers by PP, ranks by TP*PP,
        batch by micro*DP."""
        p: list[str] = []
        m, t, d = self.model, self.train, self.distributed
        tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
        if m.num_attention_heads % tp:
            p.append(
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                f"distributed.tensor_model_parallel_size={tp}"
            )
        g = m.num_query_groups
        if g is not None and g >= 1 and m.num_attention_heads % g == 0 and g % tp:
            # megatron-core splits key/value heads (query groups) over tensor-parallel ranks.
            p.append(
                f"model.num_query_groups={g} is not divisible by "
                f"distributed.tensor_model_parallel_size={tp}"
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

    def _validate_replication(self, world_size: int, ranks_per_node: int) -> list[str]:
        """LOCAL replication (NVRx clique groups: ranks n, n+J, ..., n+(F-1)J) needs F nodes and
        a world size divisible by J * F (``parse_group_sequence`` of nvidia-resiliency-ext)."""
        c = self.checkpoint
        f = c.replication_factor
        if f <= 1 or (c.replication_jump is not None and c.replication_jump < 1):
            return []
        nodes = max(1, world_size // max(1, ranks_per_node))
        jump = c.replication_jump or ranks_per_node
        p = []
        if f > nodes:
            p.append(f"checkpoint.replication_factor={f} is larger than the number of nodes ({nodes}: "
                     f"{world_size} ranks, {ranks_per_node} per node): a replica on the same node dies with it")
        if world_size % (jump * f) and not (p and c.replication_jump is None):  # the factor said it, unless a jump was set
            p.append(f"checkpoint.replication_jump={jump} does not fit: world size {world_size} must be divisible "
                     f"by replication_jump * replication_factor = {jump * f}")
        return p

    def notes(self) -> list[str]:
        """Settings that are valid but probably not meant (printed before a run starts, not refused)."""
        s, t = self.scheduler, self.train
        out = []
        if s.lr_warmup_iters >= t.train_iters:
            out.append(f"scheduler.lr_warmup_iters={s.lr_warmup_iters} covers the whole run (train.train_iters="
                       f"{t.train_iters}): the LR never reaches optimizer.lr={self.optimizer.lr} and never decays")
        return out

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

