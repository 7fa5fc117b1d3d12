"""Which fused kernels this machine provides, as megatron-core ``TransformerConfig`` fields.

Every fusion below is a GPU kernel. Some are JIT-fused by torch itself on any CUDA device; the
others are CUDA extensions that transformer-engine or apex bring and that megatron-core imports
when the flag is on (so a flag set without its extension fails at model build or first forward).
Sources: megatron-core 0.16.1 ``tensor_parallel/layers.py`` (gradient-accumulation fusion needs
``fused_weight_gradient_mlp_cuda``, built by apex, even under the TE spec: the output layer is a
local ``ColumnParallelLinear``), ``fusions/fused_softmax.py`` (apex's ``scaled_*masked_softmax_cuda``),
``fusions/fused_layer_norm.py`` (apex ``FastLayerNormFN``), ``transformer_config.py`` (RoPE fusion
needs transformer-engine >= 1.4).
"""

from __future__ import annotations

import importlib
import logging

from tierstack.runtime.distributed import has_gpu

log = logging.getLogger(__name__)

FUSION_FIELDS = (
    "gradient_accumulation_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "apply_rope_fusion",
)


def _imports(*modules: str) -> bool:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # ImportError, or an extension built for another CUDA failing to load
            return False
    return True


def _rope_fusion_available() -> bool:
    try:
        from megatron.core.models.common.embeddings import rope_utils
    except Exception:
        return False
    return getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None


def fusion_flags() -> dict[str, bool]:
    """``TransformerConfig`` fusion fields for this machine: on where the kernel exists, off otherwise.

    Returns:
        ``{field: bool}`` for each name in :data:`FUSION_FIELDS`; all False without a GPU. On a GPU,
        the torch-JIT fusions (bias + activation, bias + dropout + add) are on, and each extension
        fusion is on when its module imports.
    """
    if not has_gpu():
        return {name: False for name in FUSION_FIELDS}
    flags = {
        "gradient_accumulation_fusion": _imports("fused_weight_gradient_mlp_cuda"),
        "bias_activation_fusion": True,
        "bias_dropout_fusion": True,
        "masked_softmax_fusion": _imports("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda"),
        "persist_layer_norm": _imports("apex.contrib.layer_norm.layer_norm"),
        "apply_rope_fusion": _rope_fusion_available(),
    }
    log.info("fused kernels: %s", ", ".join(f"{k}={'on' if v else 'off'}" for k, v in flags.items()))
    return flags
