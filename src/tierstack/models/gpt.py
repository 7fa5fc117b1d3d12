"""GPT model provider over megatron-core ``GPTModel``."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from tierstack.config import ConfigContainer

log = logging.getLogger(__name__)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * TP``.

    This is the Megatron-LM rule (so the embedding splits evenly over TP ranks): 257 byte tokens with
    divisor 4 and TP=2 gives 264.
    """
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def transformer_engine_available() -> bool:
    """True when transformer-engine imports (GPU extra)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a CUDA-less build failing at import
        return False
    return True


def activation_function(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The callable megatron-core's ``TransformerConfig.activation_func`` takes for ``model.activation_func``.

    ``gelu`` is the erf form (``torch.nn.functional.gelu``), ``gelu_tanh`` the tanh approximation
    GPT-2 uses (megatron-core's ``openai_gelu``; Hugging Face ``gelu_new``). With
    ``model.gated_linear_unit`` the MLP computes ``act(gate) * up`` (SwiGLU when ``silu``).

    Raises:
        ValueError: an unknown name (names the field).
    """
    import torch.nn.functional as F
    from megatron.core.transformer.utils import openai_gelu

    table = {"gelu": F.gelu, "gelu_tanh": openai_gelu, "silu": F.silu, "relu": F.relu}
    if name not in table:
        raise ValueError(f"model.activation_func={name!r}: use one of {sorted(table)}")
    return table[name]


def build_transformer_config(cfg: ConfigContainer):
    """megatron-core ``TransformerConfig`` from the model, distributed and train sections."""
    from megatron.core.transformer import TransformerConfig

    from tierstack import runtime

    m = cfg.model
    dtype = torch.bfloat16 if m.bf16 else torch.float32
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        normalization=m.normalization,
        layernorm_epsilon=m.layernorm_epsilon,
        gated_linear_unit=m.gated_linear_unit,
        activation_func=activation_function(m.activation_func),
        num_query_groups=m.num_query_groups,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        tensor_model_parallel_size=cfg.distributed.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.distributed.pipeline_model_parallel_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        bf16=m.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # Fused kernels where this machine has them (GPU, transformer-engine / apex); off on CPU.
        **runtime.fusion_flags(activation_func=m.activation_func, gated_linear_unit=m.gated_linear_unit,
                               add_bias_linear=m.add_bias_linear),
        use_cpu_initialization=False,
        sequence_parallel=False,
        deallocate_pipeline_outputs=runtime.has_gpu(),
        # megatron-core 0.16's default is "full", which it rewrites to [] with a deprecation warning
        # on every config: [] is the same setting in its current spelling.
        cuda_graph_scope=[],
    )


def _layer_spec(cfg: ConfigContainer):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    impl = cfg.model.transformer_impl
    if impl == "transformer_engine" and not transformer_engine_available():
        raise ImportError(
            "model.transformer_impl=transformer_engine but transformer-engine is not importable; "
            "install the GPU extra (`pip install 'tierstack[gpu]'`) or set model.transformer_impl=local"
        )
    from tierstack import runtime

    use_te = impl == "transformer_engine" or (
        impl == "auto" and runtime.has_gpu() and transformer_engine_available()
    )
    m = cfg.model
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=m.qk_layernorm), "transformer_engine"
    return get_gpt_layer_local_spec(qk_layernorm=m.qk_layernorm, normalization=m.normalization), "local"


def gpt_model_provider(cfg: ConfigContainer, vocab_size: int) -> Callable[..., torch.nn.Module]:
    """A megatron-style ``model_provider(pre_process, post_process)`` for this config.

    Args:
        cfg: the run config.
        vocab_size: tokenizer vocabulary (unpadded); the model pads it with :func:`padded_vocab_size`.

    Returns:
        A function building one ``GPTModel`` stage on the current device (parameters fp32 on CPU,
        bf16 when ``model.bf16``).
    """
    from megatron.core.models.gpt import GPTModel

    tcfg = build_transformer_config(cfg)
    spec, impl = _layer_spec(cfg)
    padded = padded_vocab_size(
        vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.distributed.tensor_model_parallel_size
    )

    def provider(pre_process: bool = True, post_process: bool = True, vp_stage=None) -> torch.nn.Module:
        log.debug("building GPTModel stage (impl=%s, padded vocab=%d)", impl, padded)
        return GPTModel(
            config=tcfg,
            transformer_layer_spec=spec,
            vocab_size=padded,
            max_sequence_length=cfg.model.max_position_embeddings or cfg.model.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=cfg.model.share_embeddings_and_output_weights,
            position_embedding_type=cfg.model.position_embedding_type,
            rotary_base=cfg.model.rotary_base,
            rotary_percent=cfg.model.rotary_percent,
            parallel_output=True,
        )

    provider.transformer_config = tcfg  # type: ignore[attr-defined]
    provider.padded_vocab_size = padded  # type: ignore[attr-defined]
    provider.transformer_impl = impl  # type: ignore[attr-defined]
    return provider


def model_vocab_size(cfg: ConfigContainer, tokenizer) -> int:
    """Embedding rows before padding: ``model.vocab_size`` when set, else the tokenizer's vocabulary.

    A Hugging Face model may have more embedding rows than its tokenizer has ids (Qwen2 does);
    fewer would leave token ids without an embedding.

    Raises:
        ValueError: ``model.vocab_size`` is smaller than the tokenizer's vocabulary (names both).
    """
    n = cfg.model.vocab_size
    if n is None:
        return int(tokenizer.vocab_size)
    if n < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={n} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size} ids, "
            f"tokenizer.tokenizer_path={getattr(tokenizer, 'path', None)}): ids would have no embedding row"
        )
    return int(n)
