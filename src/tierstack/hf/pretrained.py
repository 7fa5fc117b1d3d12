"""``checkpoint.pretrained_checkpoint`` pointing at a Hugging Face directory.

The run's model fields must be those of ``config.json`` (checked first, naming each field that
differs). Rank 0 then imports the directory, in a separate one-rank process (``tierstack convert
import``, at this run's TP/PP and vocabulary padding), into ``<logger.run_dir>/hf_import``; every
rank loads that GLOBAL checkpoint as pretrained weights. The directory must be visible to all
ranks (shared storage on several nodes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tierstack.checkpointing.errors import CheckpointLoadError
from tierstack.config import ConfigContainer
from tierstack.errors import BadInputError

IMPORT_DIR = "hf_import"


class PretrainedImportError(CheckpointLoadError, BadInputError):
    """``checkpoint.pretrained_checkpoint`` names a Hugging Face directory that this run cannot take
    (its config.json differs from the run's fields, or its import failed: a damaged or missing
    weights file). Raised alike on every rank, before any step: a refusal like a config error
    (rank 0 prints it, the launch ends with status 2), still a ``CheckpointLoadError`` for callers."""
# torchrun's variables: without them the importer is a one-rank world of its own.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def model_field_differences(cfg: ConfigContainer, fields: dict) -> list[str]:
    """Fields of ``cfg.model`` that differ from an HF ``config.json`` (``fields`` from its architecture)."""
    m = cfg.model
    skip = {"seq_length"}
    if m.position_embedding_type != "learned_absolute":
        skip.add("max_position_embeddings")  # RoPE has no position table
    out = []
    for name, value in fields.items():
        if name in skip:
            continue
        ours = getattr(m, name)
        if name == "num_query_groups":
            ours, value = ours or m.num_attention_heads, value or fields["num_attention_heads"]
        if name == "ffn_hidden_size":
            ours = ours or 4 * m.hidden_size
        if name == "vocab_size" and ours is None:
            continue  # checked against the tokenizer by the model provider
        if ours != value:
            out.append(f"model.{name}={ours!r} but config.json gives {value!r}")
    return out


def pretrained_root(cfg: ConfigContainer, path: Path) -> Path:
    """Collective: the GLOBAL checkpoint to load ``checkpoint.pretrained_checkpoint`` from.

    A Hugging Face directory is imported first (:func:`import_for_run`); any other path (a step
    directory, a GLOBAL root) is returned as it is.

    Raises:
        PretrainedImportError: as :func:`import_for_run`.
    """
    from tierstack.hf.convert import is_hf_directory

    return import_for_run(cfg, path) if is_hf_directory(path) else path


def import_for_run(cfg: ConfigContainer, hf_dir: Path) -> Path:
    """Collective: import ``hf_dir`` for this run (rank 0, in a subprocess); returns the GLOBAL root.

    Raises:
        PretrainedImportError: the run's model fields differ from config.json (each named), or the
            import failed (its error message), on every rank.
    """
    from tierstack.hf.convert import read_hf_config
    from tierstack.runtime import collectives

    root = Path(cfg.logger.run_dir) / IMPORT_DIR
    error = None
    if collectives.rank() == 0:
        try:
            _config, _arch, fields = read_hf_config(hf_dir)
            diffs = model_field_differences(cfg, fields)
            error = ("checkpoint.pretrained_checkpoint=" + str(hf_dir) + ": " + "; ".join(diffs)) if diffs else None
        except ValueError as exc:
            error = f"checkpoint.pretrained_checkpoint={hf_dir}: {exc}"
        if error is None:
            error = _run_import(cfg, hf_dir, root)
    error = collectives.broadcast_object(error)
    if error:
        raise PretrainedImportError(error)
    return root


def _run_import(cfg: ConfigContainer, hf_dir: Path, root: Path):
    shutil.rmtree(root, ignore_errors=True)  # a fresh import: never weights of an older directory
    d = cfg.distributed
    cmd = [sys.executable, "-m", "tierstack.cli", "convert", "import", "--hf-path", str(hf_dir), "--save", str(root),
           "--tp", str(d.tensor_model_parallel_size), "--pp", str(d.pipeline_model_parallel_size),
           "--make-vocab-size-divisible-by", str(cfg.model.make_vocab_size_divisible_by)]
    # TORCHELASTIC_USE_AGENT_STORE among others: kept, the child would wait for torchrun's store.
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = (proc.stderr + proc.stdout).strip().splitlines()
        ours = [ln for ln in lines if ln.startswith("tierstack convert import:")]  # the CLI's one-line error
        tail = ours or [ln for ln in lines if "Error" in ln][-2:] or lines[-3:]
        return f"checkpoint.pretrained_checkpoint={hf_dir}: import failed (exit {proc.returncode}): " + " | ".join(tail)
    return None


__all__ = ["PretrainedImportError", "import_for_run", "model_field_differences", "pretrained_root"]
