"""A pretrained start names its model: architecture and tokenizer come from the checkpoint.

With ``checkpoint.pretrained_checkpoint`` set (a GLOBAL root or step directory, ``<root>:best``, or
a Hugging Face directory), every ``model.*`` field that shapes a tensor and every ``tokenizer.*``
field is taken from what the source records (a GLOBAL checkpoint's manifest; an HF directory's
``config.json`` and ``tokenizer.json``), unless the user set it (an override or a ``--config-file``
field). A field set to another value than the source's is refused, with the values to paste. The
fields that do not shape tensors (``model.seq_length``, dropout, padding, ...) stay the run's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from tierstack.config import ConfigContainer, ConfigError, ModelConfig
from tierstack.config.describe import override_text, value_text


def given_keys(overrides: Iterable[str], file_data: Optional[Mapping[str, Any]] = None) -> set[str]:
    """``section.field`` keys the user set: on the command line and in a ``--config-file``."""
    keys = {item.split("=", 1)[0].strip() for item in overrides if "=" in item}
    for section, values in (file_data or {}).items():
        if isinstance(values, Mapping):
            keys |= {f"{section}.{name}" for name in values}
    return keys


def _manifest_fields(step_dir: Path) -> Optional[dict[str, Any]]:
    """``{"model.x": v, "tokenizer.y": v}`` recorded in a GLOBAL step directory's manifest, or None."""
    from tierstack.checkpointing import compat, paths

    manifest = paths.read_json(step_dir / paths.MANIFEST)
    flat = manifest.get(compat.CONFIG_KEY) if isinstance(manifest, dict) else None
    if not isinstance(flat, dict):
        return None
    return {k: v for k, v in flat.items() if k.startswith("tokenizer.")
            or (k.startswith("model.") and k.split(".", 1)[1] not in ModelConfig.NOT_TENSOR_SHAPING)}


def _hf_fields(hf_dir: Path) -> dict[str, Any]:
    """The same, from an HF directory (``config.json``; its ``tokenizer.json``)."""
    from tierstack.hf.convert import read_hf_config

    _config, _arch, fields = read_hf_config(hf_dir)
    out = {f"model.{k}": v for k, v in fields.items() if k not in ModelConfig.NOT_TENSOR_SHAPING}
    if out.get("model.position_embedding_type") != "learned_absolute":
        out.pop("model.max_position_embeddings", None)  # RoPE has no position table
    return {**out, "tokenizer.tokenizer_type": "huggingface", "tokenizer.tokenizer_path": str(hf_dir)}


def source_fields(spec: str) -> Optional[dict[str, Any]]:
    """What ``checkpoint.pretrained_checkpoint=spec`` records of the architecture and tokenizer.

    Returns:
        ``{"model.field": value, "tokenizer.field": value}``; None when the source is not there or
        records nothing (validation or the load then says why).

    Raises:
        ConfigError: an HF directory whose config.json cannot be read or expressed (names the field).
    """
    from tierstack.checkpointing import paths
    from tierstack.checkpointing.best import resolve_pretrained

    try:
        path = resolve_pretrained(spec)
    except FileNotFoundError:
        return None
    if (path / "config.json").is_file() and not (path / paths.TRACKER_ITERATION).exists():
        try:
            return _hf_fields(path)
        except (ValueError, ImportError) as exc:  # HFCheckpointError, UnsupportedModelError; no hf extra
            raise ConfigError([f"checkpoint.pretrained_checkpoint={spec}: {exc}"]) from None
    if paths.parse_step_dir(path.name) is None:
        try:
            path = path / paths.step_dir_name(int((path / paths.TRACKER_ITERATION).read_text().strip()))
        except (OSError, ValueError):
            return None
    return _manifest_fields(path)


def adopt_pretrained(config: ConfigContainer, given: set[str]) -> list[str]:
    """Take the architecture and tokenizer of ``checkpoint.pretrained_checkpoint`` into ``config``.

    Args:
        config: the resolved config (recipe, file, overrides); changed in place.
        given: the keys the user set (:func:`given_keys`); those are kept, and must agree.

    Returns:
        ``section.field=value`` of each field taken that differs from the recipe's value (paste-ready;
        empty when none, or when no pretrained checkpoint is set).

    Raises:
        ConfigError: a field the user set differs from the checkpoint's: one problem per field, and
            the paste-ready values last.
    """
    spec = config.checkpoint.pretrained_checkpoint if config.checkpoint is not None else None
    fields = source_fields(spec) if spec else None
    if not fields:
        return []
    conflicts, taken = [], []
    for key, value in fields.items():
        section, name = key.split(".", 1)
        target = getattr(config, section)
        if not hasattr(target, name):
            continue  # a field this version does not have (recorded by another version)
        if key in given:
            if getattr(target, name) != value:
                conflicts.append((key, getattr(target, name), value))
        elif getattr(target, name) != value:
            setattr(target, name, value)
            taken.append(override_text(key, value))
    if conflicts:
        problems = [f"{key}={value_text(ours)} was given, but checkpoint.pretrained_checkpoint={spec} has "
                    f"{value_text(theirs)} (weights cannot change shape or vocabulary)" for key, ours, theirs in conflicts]
        problems.append("to start from it, use (or leave these fields out: they come from the checkpoint): "
                        + " ".join(override_text(k, theirs) for k, _, theirs in conflicts))
        raise ConfigError(problems)
    return taken
