"""Model settings that change what a checkpoint holds: recorded in each manifest, checked at load.

- ``transformer_impl``: transformer-engine layers name their tensors differently from the local
  spec (the layer norms live inside TE's fused linear layers) and add ``_extra_state`` entries (FP8
  metadata), so a checkpoint of one does not load into the other. tierstack does not map keys
  between them: the load is refused, naming the setting.
- ``bf16``: the optimizer state differs (with bf16 megatron-core keeps fp32 main parameters in the
  optimizer; fp32 training has none), so optimizer state does not carry across; megatron-core would
  fail deep inside with a ``KeyError``. Weights do carry: ``dist_checkpointing`` casts them to this
  run's dtype and the optimizer's fp32 main parameters are rebuilt from them. So across bf16 a
  GLOBAL load with optimizer state is refused and a weights-only one (``checkpoint.load_optim=false``,
  or ``checkpoint.pretrained_checkpoint``) is allowed, with a warning. A LOCAL checkpoint is refused
  across bf16 either way: its fully-parallel exchange (``to_state_dict(algo="fully_parallel")``)
  sizes its buffers by this run's dtype and fails with a gloo/NCCL size mismatch.

Both values are read from the built model, not the config. Manifests written before these fields
existed are not checked. (Issue 15 adds a comparison of tokenizer and model config before load; the
two are to become one check and one report.)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

TE_MODULE_PREFIX = "megatron.core.extensions.transformer_engine"


def transformer_impl_of(model: list[Any]) -> str:
    """``"transformer_engine"`` when any module of the model chunks is a megatron-core TE wrapper,
    else ``"local"`` (what ``model.transformer_impl=auto`` resolved to)."""
    for chunk in model:
        for module in chunk.modules():
            if type(module).__module__.startswith(TE_MODULE_PREFIX):
                return "transformer_engine"
    return "local"


def model_settings(model: list[Any]) -> dict:
    """``{"transformer_impl": "local" | "transformer_engine", "bf16": bool}`` of the built model
    chunks (bf16: its parameters are ``torch.bfloat16``), for the manifest."""
    bf16 = any(p.dtype == torch.bfloat16 for chunk in model for p in chunk.parameters())
    return {"transformer_impl": transformer_impl_of(model), "bf16": bf16}


def check_load(manifest: dict, now: dict, *, optim: bool, where: str, casts_weights: bool = True) -> None:
    """Refuse a load the model settings make impossible; warn about a weights-only load across bf16.

    Args:
        manifest: the checkpoint's manifest (``transformer_impl`` / ``bf16`` may be absent).
        now: :func:`model_settings` of this run.
        optim: whether optimizer state is going to be loaded.
        where: the checkpoint's path, for messages.
        casts_weights: whether the tier can load weights of another dtype (GLOBAL: yes; LOCAL: no).

    Raises:
        CheckpointLoadError: ``transformer_impl`` differs, or ``bf16`` differs and ``optim`` is set
            or the tier cannot cast weights; the message names the setting to change.
    """
    from tierstack.checkpointing.errors import CheckpointLoadError

    saved_impl = manifest.get("transformer_impl")
    if saved_impl is not None and saved_impl != now["transformer_impl"]:
        hint = " (needs transformer-engine and a GPU: pip install -e '.[gpu]')" if saved_impl == "transformer_engine" else ""
        raise CheckpointLoadError(
            f"checkpoint {where} was written by a {saved_impl} model, this run builds a {now['transformer_impl']} "
            f"one: their tensors differ; set model.transformer_impl={saved_impl}{hint} to load it"
        )
    saved_bf16 = manifest.get("bf16")
    if saved_bf16 is None or bool(saved_bf16) == now["bf16"]:
        return
    saved, this = str(bool(saved_bf16)).lower(), str(now["bf16"]).lower()
    if not casts_weights:
        raise CheckpointLoadError(
            f"LOCAL checkpoint {where} was written with model.bf16={saved}, this run has model.bf16={this}; "
            f"set model.bf16={saved} to resume it (a LOCAL checkpoint loads only into the dtype it was written "
            "in; a GLOBAL checkpoint's weights load across it with checkpoint.load_optim=false)"
        )
    if optim:
        raise CheckpointLoadError(
            f"checkpoint {where} was written with model.bf16={saved}, this run has model.bf16={this}: optimizer "
            f"state does not carry across; set model.bf16={saved} to resume it, or checkpoint.load_optim=false to "
            "load the weights only (fresh optimizer, fp32 main parameters rebuilt from the weights)"
        )
    log.warning("loading weights written with model.bf16=%s into model.bf16=%s (%s): cast to this run's dtype",
                saved, this, where)
