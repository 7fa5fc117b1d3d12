"""Which fused kernels this machine provides, as megatron-core ``TransformerConfig`` fields.

Every fusion below is a GPU kernel. Some are JIT-fused by torch itself on any CUDA device; the
others are CUDA extensions that transformer-engine or apex bring and that megatron-core imports
when the flag is on (so a flag set without its extension fails at model build or first forward).
Sources: megatron-core 0.16.1 ``tensor_parallel/layers.py`` (gradient-accumulation fusion needs
``fused_weight_gradient_mlp_cuda``, built by apex, even under the TE spec: the output layer is a
local ``ColumnParallelLinear``), ``fusions/fused_softmax.py`` (apex's ``scaled_*masked_softmax_cuda``),
``fusions/fused_layer_norm.py`` (apex ``FastLayerNormFN``), ``transformer_config.py`` (RoPE fusion
needs transformer-engine >= 1.4).

The bias + activation fusion depends on the model, not only on the machine
(:func:`bias_activation_fusion_supported`): megatron-core's ``TransformerConfig.__post_init__``
refuses it for any activation but ``F.gelu``, ``F.silu`` and ``quick_gelu`` (so for our
``gelu_tanh``, which is ``openai_gelu``, and ``relu``), and for ``gelu`` without a bias or gated unit;
``MLP.forward`` then raises for ``silu`` without a gated unit. Of what remains, the fused GELU
kernels (``fusions/fused_bias_gelu.py``, ``fused_bias_geglu.py``) compute the *tanh approximation*,
not the erf GELU the model is configured with: turning them on would make a GPU run compute another
function than a CPU run and than a Hugging Face checkpoint with ``gelu``. Only SwiGLU (``silu`` with
a gated unit) has a fused kernel that computes the configured function. Same rules in megatron-core
0.16.1 and 0.19.2.
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


def bias_activation_fusion_supported(activation_func: str, gated_linear_unit: bool, add_bias_linear: bool) -> bool:
    """True when megatron-core accepts ``bias_activation_fusion`` for this MLP *and* its fused kernel
    computes the configured activation (see the module docstring): SwiGLU only.

    Args:
        activation_func: ``model.activation_func`` (``gelu``, ``gelu_tanh``, ``silu``, ``relu``).
        gated_linear_unit: ``model.gated_linear_unit``.
        add_bias_linear: ``model.add_bias_linear`` (the fused SwiGLU takes a bias or none).
    """
    del add_bias_linear  # bias_swiglu_impl handles both; gelu (which needs a bias) is off anyway
    return activation_func == "silu" and gated_linear_unit


def fusion_flags(*, activation_func: str, gated_linear_unit: bool, add_bias_linear: bool) -> dict[str, bool]:
    """``TransformerConfig`` fusion fields for this machine and MLP: on where the kernel exists and
    megatron-core supports it for this model, off otherwise.

    Args:
        activation_func, gated_linear_unit, add_bias_linear: the model's MLP (the ``model.`` fields of
            the same names), which decide ``bias_activation_fusion``
            (:func:`bias_activation_fusion_supported`).

    Returns:
        ``{field: bool}`` for each name in :data:`FUSION_FIELDS`; all False without a GPU. On a GPU,
        bias + dropout + add is on, bias + activation is on for SwiGLU, and each extension fusion is
        on when its module imports.
    """
    if not has_gpu():
        return {name: False for name in FUSION_FIELDS}
    flags = {
        "gradient_accumulation_fusion": _imports("fused_weight_gradient_mlp_cuda"),
        "bias_activation_fusion": bias_activation_fusion_supported(activation_func, gated_linear_unit,
                                                                   add_bias_linear),
        "bias_dropout_fusion": True,
        "masked_softmax_fusion": _imports("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda"),
        "persist_layer_norm": _imports("apex.contrib.layer_norm.layer_norm"),
        "apply_rope_fusion": _rope_fusion_available(),
    }
    log.info("fused kernels: %s", ", ".join(f"{k}={'on' if v else 'off'}" for k, v in flags.items()))
    return flags
