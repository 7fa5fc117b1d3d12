"""``tierstack convert import|export``: Hugging Face checkpoints <-> published GLOBAL checkpoints.

Both directions run in one process on CPU, at tensor- and pipeline-parallel size 1; the GLOBAL
checkpoint is megatron-core ``torch_dist``, which any TP/PP/DP layout loads (and which was saved
by any layout: export reshards at load). Hugging Face files are read and written only through
``transformers`` (``AutoConfig``, ``from_pretrained``, ``save_pretrained``).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from tierstack.config import ConfigContainer, DistributedConfig, ModelConfig, TokenizerConfig
from tierstack.hf import checkpoint_io
from tierstack.hf.architectures import Architecture, UnsupportedModelError, architecture_for_export, architecture_of_hf

log = logging.getLogger(__name__)

TOKENIZER_DIR = "tokenizer"  # inside an imported GLOBAL root: the HF tokenizer files, as the run's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class HFCheckpointError(ValueError):
    """A Hugging Face directory that cannot be imported; names the file or field to fix."""


@dataclass
class HFModel:
    """A Hugging Face checkpoint read from disk: its architecture, config and state dict (fp32)."""

    path: Path
    architecture: Architecture
    config: Any
    state_dict: dict
    model_fields: dict


def _import_transformers():
    try:
        import transformers  # noqa: PLC0415 (optional dependency)
    except ImportError as err:
        raise ImportError("Hugging Face conversion needs transformers: pip install 'tierstack[hf]'") from err
    return transformers


def is_hf_directory(path: str | Path) -> bool:
    """True for a directory holding ``config.json`` (and no GLOBAL tracker)."""
    from tierstack.checkpointing import paths

    p = Path(path)
    return (p / "config.json").is_file() and not (p / paths.TRACKER_ITERATION).exists()


def read_hf_config(path: str | Path) -> tuple[Any, Architecture, dict]:
    """``(config, architecture, ModelConfig fields)`` of an HF directory, without reading weights.

    Raises:
        HFCheckpointError: no config.json, or one that is not valid JSON; UnsupportedModelError: an
            architecture or option we cannot express (names the field of config.json).
    """
    transformers = _import_transformers()
    path = Path(path)
    if not (path / "config.json").is_file():
        raise HFCheckpointError(f"--hf-path {path}: no config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except OSError as e:  # transformers' words for a damaged file ("is not a valid JSON file")
        raise HFCheckpointError(f"--hf-path {path}: config.json cannot be read: {e}") from None
    arch = architecture_of_hf(config, str(path / "config.json"))
    return config, arch, arch.model_fields(config)


def _check_weight_files(path: Path) -> None:
    """Weight files present before transformers reads them (it would random-initialise or fail late)."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return
    if not index.is_file():
        raise HFCheckpointError(f"--hf-path {path}: no weight files (model.safetensors or model.safetensors.index.json)")
    from transformers.utils.hub import get_checkpoint_shard_files

    try:
        files, _meta = get_checkpoint_shard_files(str(path), str(index))
    except OSError as err:
        raise HFCheckpointError(f"--hf-path {path}: a weight shard listed in {index.name} is missing ({err})") from err
    missing = [Path(f).name for f in files if not Path(f).is_file()]
    if missing:
        raise HFCheckpointError(f"--hf-path {path}: {index.name} is missing shard file(s) {missing}")


def read_hf_model(path: str | Path) -> HFModel:
    """Config and fp32 weights of an HF directory (``config.json`` + safetensors, sharded or not).

    Raises:
        HFCheckpointError: missing weight files, or weights missing/unexpected for the config
            (names the file and the first tensors).
        UnsupportedModelError: see :func:`read_hf_config`.
    """
    transformers = _import_transformers()
    path = Path(path)
    config, arch, fields = read_hf_config(path)
    _check_weight_files(path)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    missing = list(info.get("missing_keys", ())) + list(info.get("mismatched_keys", ()))
    if missing:
        raise HFCheckpointError(f"--hf-path {path}: weights missing or of the wrong shape: {sorted(map(str, missing))[:5]}")
    return HFModel(path, arch, config, {k: v.detach() for k, v in model.state_dict().items()}, fields)


def _tokenizer_vocab(tokenizer_json: Path) -> int:
    from tierstack.data.tokenizers import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_json).vocab_size


def check_tokenizer(src: Path, vocab_size: int) -> Path:
    """The HF directory's ``tokenizer.json``, checked to have no more ids than the embedding has rows.

    (More rows than ids is normal: Qwen2 pads its embedding.)

    Raises:
        HFCheckpointError: no tokenizer.json, or more ids than ``vocab_size`` (names both files).
    """
    tok = Path(src) / "tokenizer.json"
    if not tok.is_file():
        raise HFCheckpointError(f"--hf-path {src}: no tokenizer.json (the run's tokenizer comes from it)")
    n = _tokenizer_vocab(tok)
    if n > vocab_size:
        raise HFCheckpointError(
            f"{tok}: {n} token ids but config.json vocab_size={vocab_size} embedding rows; the tokenizer does "
            "not belong to this model"
        )
    return tok


def _copy_tokenizer(src: Path, root: Path) -> Path:
    """Copy the HF tokenizer files into ``root/tokenizer``; returns the copied tokenizer.json."""
    dst = root / TOKENIZER_DIR
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return (dst / "tokenizer.json").resolve()


def run_config_for_hf(fields: dict, tokenizer_json: Optional[Path], tp: int, pp: int,
                      base: Optional[ConfigContainer] = None) -> ConfigContainer:
    """The run config an imported checkpoint records: model fields from config.json, its tokenizer, TP/PP."""
    cfg = base or ConfigContainer()
    max_pos = fields.get("max_position_embeddings") or cfg.model.seq_length
    model = dataclasses.replace(cfg.model, **fields, seq_length=min(cfg.model.seq_length, max_pos))
    tok = cfg.tokenizer
    if tokenizer_json is not None:
        tok = TokenizerConfig(tokenizer_type="huggingface", tokenizer_path=str(tokenizer_json))
    dist = dataclasses.replace(cfg.distributed, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return dataclasses.replace(cfg, model=model, tokenizer=tok, distributed=dist)


def _norm_renames() -> dict[str, str]:
    """Local-spec name piece -> transformer-engine-spec piece of the layer norms that TE fuses into the
    next linear layer: megatron-core's own map (the local spec's ``sharded_state_dict_keys_map``,
    which is how a local model's GLOBAL checkpoint names them like a TE model's), e.g.
    ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return dict(get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map)


def _rename_layer_keys(sd: dict, renames: dict[str, str]) -> dict:
    out = {}
    for key, value in sd.items():
        head, sep, rest = key.partition(".layers.")
        if sep:
            num, dot, name = rest.partition(".")
            for old, new in renames.items():
                if name.startswith(old):
                    key = f"{head}.layers.{num}{dot}{new}{name[len(old):]}"
                    break
        out[key] = value
    return out


def to_model_names(sd: dict, model_keys) -> dict:
    """A full state dict in the local spec's names (what :mod:`architectures` maps) renamed to the
    built model's: unchanged for a local-spec model; the layer norms under their names inside the
    fused linear layers for a transformer-engine-spec model (``...linear_qkv.layer_norm_weight``)."""
    keys = set(model_keys)
    te = _rename_layer_keys(sd, _norm_renames())
    return te if sum(k in keys for k in te) > sum(k in keys for k in sd) else sd


def to_local_names(sd: dict) -> dict:
    """A full state dict of either layer spec in the local spec's names (inverse of :func:`to_model_names`)."""
    return _rename_layer_keys(sd, {new: old for old, new in _norm_renames().items()})


def megatron_state_dict(hf: HFModel, m: ModelConfig, padded_vocab: int) -> dict:
    """HF weights -> full megatron-core state dict, embedding/output rows zero-padded to ``padded_vocab``."""
    sd = hf.architecture.to_megatron(hf.state_dict, m)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in sd and sd[key].shape[0] < padded_vocab:
            t = sd[key]
            sd[key] = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
    return sd


def load_into(objs, sd: dict) -> None:
    """Copy a full megatron-core state dict (local-spec names) into a TP=PP=1 model of either layer spec
    (strict: every tensor must be there; transformer-engine's ``_extra_state`` entries are left as built)."""
    from tierstack.checkpointing.state import unwrap

    model = unwrap(objs.model[0])
    target = model.state_dict()
    sd = to_model_names(sd, target)  # the transformer-engine spec keeps its layer norms elsewhere
    missing = [k for k in target if not k.endswith("_extra_state") and k not in sd]
    extra = [k for k in sd if k not in target]
    if missing or extra:
        raise HFCheckpointError(f"weight mapping mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for k, v in sd.items():
            if target[k].shape != v.shape:
                raise HFCheckpointError(f"weight {k}: shape {tuple(v.shape)} from HF, model has {tuple(target[k].shape)}")
            target[k].copy_(v)
    for opt in getattr(objs.optimizer, "chained_optimizers", [objs.optimizer]):
        if hasattr(opt, "reload_model_params"):
            opt.reload_model_params()


def import_hf(hf_path: str | Path, save_root: str | Path, *, tensor_model_parallel_size: int = 1,
              pipeline_model_parallel_size: int = 1, make_vocab_size_divisible_by: Optional[int] = None) -> Path:
    """Import an HF checkpoint as a published GLOBAL checkpoint of step 0 under ``save_root``.

    The run config recorded with it has the model fields of ``config.json``, the HF
    ``tokenizer.json`` (copied to ``save_root/tokenizer/``) as the tokenizer, and the given TP/PP;
    the vocabulary is padded for that TP (to a multiple of ``make_vocab_size_divisible_by`` x TP;
    None = ``ModelConfig``'s default). ``checkpoint.pretrained_checkpoint=save_root`` then starts
    a run from these weights. Runs in this process at TP=PP=1 (torch_dist reshards at load).

    Returns:
        The published step directory.

    Raises:
        HFCheckpointError, UnsupportedModelError: bad input, before anything is written.
        ConfigError: the model does not fit the TP/PP asked for (names the field).
    """
    from tierstack.models.gpt import padded_vocab_size

    hf = read_hf_model(hf_path)
    save_root = Path(save_root)
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    fields = hf.model_fields
    if make_vocab_size_divisible_by is not None:
        fields = {**fields, "make_vocab_size_divisible_by": make_vocab_size_divisible_by}
    src_tok = check_tokenizer(Path(hf_path), fields["vocab_size"])
    run_config_for_hf(fields, src_tok, tp, pp).validate(world_size=tp * pp)  # before anything is written
    target = run_config_for_hf(fields, save_root.resolve() / TOKENIZER_DIR / "tokenizer.json", tp, pp)
    padded = padded_vocab_size(fields["vocab_size"], target.model.make_vocab_size_divisible_by, tp)
    here = dataclasses.replace(target, distributed=DistributedConfig(), mlflow=None, straggler=None)
    with checkpoint_io.parallel_world(here):
        objs = checkpoint_io.build_objects(here, padded)
        load_into(objs, megatron_state_dict(hf, here.model, padded))
        _copy_tokenizer(Path(hf_path), save_root)
        step_dir = checkpoint_io.save_global(target, objs, save_root)
    log.info("imported %s (%s) into %s (TP=%d PP=%d, vocab %d padded to %d)",
             hf_path, hf.architecture.name, step_dir, tp, pp, fields["vocab_size"], padded)
    return step_dir


def full_megatron_state_dict(load: str | Path) -> tuple[ConfigContainer, dict]:
    """Run config and full (TP=PP=1) megatron-core state dict of a GLOBAL checkpoint, in this process,
    in the local spec's names whichever layer spec the model was built with."""
    from tierstack.checkpointing.state import unwrap

    step_dir = checkpoint_io.resolve_step_dir(load)
    cfg = checkpoint_io.read_run_config(step_dir)
    here = dataclasses.replace(cfg, distributed=DistributedConfig(), mlflow=None, straggler=None)
    with checkpoint_io.parallel_world(here):
        objs = checkpoint_io.load_model_weights(here, step_dir)
        sd = {k: v.detach().clone() for k, v in unwrap(objs.model[0]).state_dict().items()
              if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    return cfg, to_local_names(sd)


def export_hf(load: str | Path, hf_path: str | Path, *, dtype: str = "fp32", max_shard_size: str = "5GB") -> Path:
    """Write a GLOBAL checkpoint as an HF directory loadable by ``AutoModelForCausalLM.from_pretrained``.

    Writes ``config.json``, ``model.safetensors`` (sharded with ``model.safetensors.index.json``
    above ``max_shard_size``) and the tokenizer files (the run's HF tokenizer, or a byte-level
    ``tokenizer.json`` for the byte tokenizer). Padded vocabulary rows are dropped.

    Raises:
        UnsupportedModelError: a model option no supported HF architecture expresses (names the field),
            before anything is written. CheckpointNotFoundError: ``load`` is not a published checkpoint.
        ValueError: an unknown ``dtype``.
    """
    from tierstack.data.tokenizers import build_tokenizer
    from tierstack.hf import tokenizer as hf_tokenizer
    from tierstack.models.gpt import model_vocab_size

    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(_DTYPES)}")
    cfg = checkpoint_io.read_run_config(checkpoint_io.resolve_step_dir(load))
    arch = architecture_for_export(cfg.model)
    tok = build_tokenizer(cfg.tokenizer)
    vocab = model_vocab_size(cfg, tok)
    cfg, sd = full_megatron_state_dict(load)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in sd:
            sd[key] = sd[key][:vocab].contiguous()
    hf_sd = arch.to_hf(sd, cfg.model)
    out = Path(hf_path)
    out.mkdir(parents=True, exist_ok=True)
    _save_hf_model(arch.hf_config(cfg.model, vocab), hf_sd, out, _DTYPES[dtype], max_shard_size, tok)
    hf_tokenizer.write_tokenizer_files(cfg.tokenizer, tok, out)
    log.info("exported %s as %s to %s (%s)", load, arch.name, out, dtype)
    return out


def _save_hf_model(config: Any, sd: dict, out: Path, dtype: torch.dtype, max_shard_size: str, tok) -> None:
    transformers = _import_transformers()
    config.eos_token_id = tok.eod
    config.architectures = None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if config.tie_word_embeddings:
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    result = model.load_state_dict(sd, strict=False, assign=True)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise UnsupportedModelError(f"export mapping mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.to(dtype)
    model.generation_config.eos_token_id = tok.eod
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
