"""Does a checkpoint fit this run? Compared before any load, every difference reported at once.

Every manifest (both tiers) records :func:`manifest_fields`: the tokenizer's identity and the run's
config (flat ``section.field`` values). Before loading, resume selection compares them with the
current config:

- **refused**: another tokenizer (type, vocabulary size, end id, tokenizer.json hash), or another
  value of a ``model.*`` field that shapes tensors. Every ``ModelConfig`` field shapes tensors
  unless ``ModelConfig.NOT_TENSOR_SHAPING`` names it, so an architecture field added later is
  compared without a change here. megatron-core would otherwise load a smaller vocabulary into a
  larger table without a word (it allows that for padding changes) or fail deep inside
  dist_checkpointing naming a tensor, not a field.
- **changed since the checkpoint**: every other difference (train length, intervals, LR schedule,
  logging, paths, parallel layout, ...). A resume goes on and lists them once.

A pretrained start (``checkpoint.pretrained_checkpoint``) refuses the same tokenizer and
architecture differences; the padding of the vocabulary (``model.make_vocab_size_divisible_by``,
tensor-parallel size) may differ, since megatron-core pads per layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from tierstack.checkpointing.errors import CheckpointLoadError
from tierstack.config.describe import override_text
from tierstack.config.sections import ModelConfig, TokenizerConfig
from tierstack.runtime import collectives as _dist
from tierstack.data.tokenizers import describe_tokenizer, identity_of_config, same_tokenizer
from tierstack.errors import BadInputError

log = logging.getLogger(__name__)

CONFIG_KEY = "config"  # manifest key: flat config of the run that wrote the checkpoint
TOKENIZER_KEY = "tokenizer"  # manifest key: tokenizer identity (see data.tokenizers.tokenizer_identity)


class CheckpointMismatchError(BadInputError, CheckpointLoadError):
    """The checkpoint's tokenizer or architecture differs from this run's; nothing was loaded."""


@dataclass
class Comparison:
    """Differences between a checkpoint's record and the current config.

    ``refused`` and ``changed`` hold ``(field, value in the checkpoint, value now)``.
    ``recorded`` is False for a checkpoint written before records existed (nothing compared).
    """

    refused: list[tuple[str, Any, Any]] = field(default_factory=list)
    changed: list[tuple[str, Any, Any]] = field(default_factory=list)
    recorded: bool = True
    saved_tokenizer_fields: dict[str, Any] = field(default_factory=dict)  # the checkpoint's tokenizer.* values


def _plain(value: Any) -> Any:
    """``value`` as it reads back from a JSON manifest (tuples become lists)."""
    return json.loads(json.dumps(value, default=str))


def _flat(run_config: Mapping[str, Any]) -> dict:
    """``{"section.field": value}`` of a nested run config (``ConfigContainer.to_dict()``), JSON-plain."""
    out: dict[str, Any] = {}
    for sec, values in run_config.items():
        if isinstance(values, Mapping):
            out.update({f"{sec}.{k}": v for k, v in values.items()})
        else:
            out[sec] = values  # a disabled optional section (None)
    return _plain(out)


def _tokenizer_identity(run_config: Mapping[str, Any]) -> dict:
    return identity_of_config(TokenizerConfig(**dict(run_config["tokenizer"])))


def manifest_fields(run_config: Mapping[str, Any]) -> dict:
    """What every manifest records about the run: ``{"config": {...}, "tokenizer": {...}}``.

    ``run_config`` is the run config as plain nested dicts (``ConfigContainer.to_dict()``); an
    empty one (a tier built without a run config, e.g. in a tool) records nothing.
    """
    if not run_config:
        return {}
    return {CONFIG_KEY: _flat(run_config), TOKENIZER_KEY: _tokenizer_identity(run_config)}


def _shapes_tensors(name: str) -> bool:
    return name not in ModelConfig.NOT_TENSOR_SHAPING


def compare(manifest: dict, run_config: Mapping[str, Any]) -> Comparison:
    """Compare a manifest's record with ``run_config`` (plain nested dicts, ``ConfigContainer.to_dict()``;
    see the module docstring for what is refused)."""
    saved, saved_tok = manifest.get(CONFIG_KEY), manifest.get(TOKENIZER_KEY)
    if not isinstance(saved, dict) or not isinstance(saved_tok, dict):
        return Comparison(recorded=False)
    out = Comparison()
    now_tok = _tokenizer_identity(run_config)
    if not same_tokenizer(saved_tok, now_tok):
        out.refused.append(("tokenizer", describe_tokenizer(saved_tok), describe_tokenizer(now_tok)))
    now = _flat(run_config)
    out.saved_tokenizer_fields = {k: v for k, v in saved.items() if k.startswith("tokenizer.")}
    defaults = {f"model.{f.name}": _plain(f.default) for f in dataclasses.fields(ModelConfig)
                if f.default is not dataclasses.MISSING}
    for key in sorted(set(saved) | set(now)):
        # A field the checkpoint predates had its default then (a field added to ModelConfig later).
        old, new = saved.get(key, defaults.get(key)), now.get(key, defaults.get(key))
        if old == new:
            continue
        section, _, name = key.partition(".")
        refused = section == "model" and _shapes_tensors(name)
        (out.refused if refused else out.changed).append((key, old, new))
    return out


def _refusal_text(where: str, result: Comparison, *, pretrained: bool) -> str:
    """The refusal: each difference, then the overrides that put the checkpoint's values back (paste-ready)."""
    refused = result.refused
    lines = [f"  - {k}: {old!r} in the checkpoint, {new!r} now" if k != "tokenizer"
             else f"  - tokenizer: {old} in the checkpoint, {new} now" for k, old, new in refused]
    put_back = [override_text(k, old) for k, old, _ in refused if k != "tokenizer"]
    if any(k == "tokenizer" for k, _, _ in refused):
        put_back += [override_text(k, v) for k, v in sorted(result.saved_tokenizer_fields.items())]
    head = ("the pretrained checkpoint" if pretrained else "the checkpoint to resume") + f" {where}"
    action = (
        f"To {'start from these weights' if pretrained else 'resume it'}, put back (paste-ready): {' '.join(put_back)}\n"
        "A model cannot continue with another vocabulary or other tensor shapes: to train one, start a new "
        "run from scratch in new checkpoint directories (checkpoint.save, checkpoint.local_dir); "
        "checkpoint.pretrained_checkpoint refuses these differences too (only vocabulary padding may differ)."
    )
    return f"{head} does not fit this run; nothing was loaded:\n" + "\n".join(lines) + "\n" + action


def check(manifest: Optional[dict], run_config: Mapping[str, Any], where: str, *, pretrained: bool = False) -> None:
    """Collective: compare on every rank, agree, then raise alike or log what changed (rank 0).

    Args:
        manifest: the chosen checkpoint's manifest on this rank (None: nothing recorded).
        run_config: this run's config as plain nested dicts (``ConfigContainer.to_dict()``).
        where: what to call the checkpoint in messages (tier, step, path).
        pretrained: a weights-only start: changes of non-architecture fields are not listed.

    Raises:
        CheckpointMismatchError: on every rank, when any rank found a refused difference.
    """
    result = compare(manifest or {}, run_config)
    texts = _dist.all_gather_object(_refusal_text(where, result, pretrained=pretrained)
                                    if result.refused else None)
    refusal = next((t for t in texts if t), None)
    if refusal:
        raise CheckpointMismatchError(refusal)
    if _dist.rank() != 0:
        return
    if not result.recorded:
        log.warning("%s records no tokenizer or config (written by an older tierstack): not compared", where)
    elif result.changed and not pretrained:
        log.info("resume: changed since the checkpoint: %s",
                 ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in result.changed))
