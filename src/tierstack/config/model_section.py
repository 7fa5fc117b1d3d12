"""The ``model`` section: fields that shape the network, with megatron-core's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from tierstack.config.base import _Section, _at_least

TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATION_FUNCS = ("gelu", "gelu_tanh", "silu", "relu")
POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute")


@dataclass(kw_only=True)
class ModelConfig(_Section):
    """GPT architecture (megatron-core ``TransformerConfig`` subset)."""

    num_layers: int = 4  # transformer layers; must divide by distributed.pipeline_model_parallel_size
    hidden_size: int = 256  # model width
    num_attention_heads: int = 8  # must divide by distributed.tensor_model_parallel_size
    ffn_hidden_size: Optional[int] = None  # MLP width; None = 4 * hidden_size
    seq_length: int = 256  # tokens per sample
    make_vocab_size_divisible_by: int = 4  # vocab is padded to a multiple of this * TP (Megatron rule)
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    share_embeddings_and_output_weights: bool = True  # False = an output layer of its own (untied)
    transformer_impl: str = "auto"  # "auto" (TE when importable), "local" or "transformer_engine"
    bf16: bool = False  # bf16 parameters (GPU); CPU runs use fp32
    # Architecture, with megatron-core TransformerConfig / GPTModel names and meaning. The defaults
    # are the GPT shape tierstack always trained (LayerNorm, GeLU, biases, multi-head, RoPE).
    normalization: str = "LayerNorm"  # "LayerNorm" or "RMSNorm"
    layernorm_epsilon: float = 1e-5  # epsilon of every norm
    gated_linear_unit: bool = False  # MLP fc1 holds [gate; up], output act(gate) * up (SwiGLU with silu)
    activation_func: str = "gelu"  # "gelu" (erf), "gelu_tanh" (tanh approximation, GPT-2), "silu", "relu"
    num_query_groups: Optional[int] = None  # key/value heads (grouped-query attention); None = num_attention_heads
    add_bias_linear: bool = True  # biases in every linear layer
    add_qkv_bias: bool = False  # biases in the QKV projection only (Qwen2); implied by add_bias_linear
    qk_layernorm: bool = False  # a norm on queries and keys per head
    position_embedding_type: str = "rope"  # "rope" or "learned_absolute"
    rotary_base: float = 10000.0  # RoPE base (Hugging Face rope_theta)
    rotary_percent: float = 1.0  # fraction of each head's channels that RoPE rotates
    vocab_size: Optional[int] = None  # embedding rows before padding; None = the tokenizer's vocabulary
    max_position_embeddings: Optional[int] = None  # learned position table rows; None = seq_length

    def _architecture_problems(self) -> list[str]:
        """Problems of the architecture fields, each naming the field (empty when valid).

        The query-group rule is megatron-core's: attention heads split evenly into query groups.
        That query groups split over tensor-parallel ranks spans sections and is checked by
        ``ConfigContainer.validate``.
        """
        p: list[str] = []
        if self.normalization not in NORMALIZATIONS:
            p.append(f"model.normalization={self.normalization!r}: use one of {NORMALIZATIONS}")
        if self.activation_func not in ACTIVATION_FUNCS:
            p.append(f"model.activation_func={self.activation_func!r}: use one of {ACTIVATION_FUNCS}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            p.append(
                f"model.position_embedding_type={self.position_embedding_type!r}: use one of {POSITION_EMBEDDING_TYPES}"
            )
        if self.layernorm_epsilon <= 0:
            p.append(f"model.layernorm_epsilon={self.layernorm_epsilon}: must be > 0")
        if self.rotary_base <= 0:
            p.append(f"model.rotary_base={self.rotary_base}: must be > 0")
        if not 0.0 < self.rotary_percent <= 1.0:
            p.append(f"model.rotary_percent={self.rotary_percent}: must be in (0, 1]")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            p.append(f"model.ffn_hidden_size={self.ffn_hidden_size}: must be >= 1 or null")
        if self.vocab_size is not None and self.vocab_size < 1:
            p.append(f"model.vocab_size={self.vocab_size}: must be >= 1 or null (the tokenizer's)")
        mpe = self.max_position_embeddings
        if mpe is not None and mpe < self.seq_length and self.position_embedding_type == "learned_absolute":
            p.append(
                f"model.seq_length={self.seq_length} exceeds model.max_position_embeddings={mpe} "
                "(rows of the learned position table)"
            )
        g = self.num_query_groups
        if g is not None and (g < 1 or self.num_attention_heads % g):
            p.append(
                f"model.num_query_groups={g}: must divide model.num_attention_heads={self.num_attention_heads}"
            )
        return p

    # Fields that shape no tensor of a checkpoint. Every other field does: a resume (or a pretrained
    # start) refuses a change of it before loading (checkpointing/compat.py), so an architecture
    # field added here later is protected without being listed anywhere. Changes of these fields
    # are listed as "changed since the checkpoint" on resume. seq_length: RoPE has no parameters.
    # make_vocab_size_divisible_by: only the padding of the vocabulary.
    NOT_TENSOR_SHAPING: ClassVar[frozenset] = frozenset({
        "seq_length", "make_vocab_size_divisible_by", "init_method_std", "hidden_dropout",
        "attention_dropout", "transformer_impl", "bf16",
    })

    def problems(self) -> list[str]:
        p = _at_least("model", self, ("num_layers", "hidden_size", "num_attention_heads", "seq_length"))
        if not p and self.hidden_size % self.num_attention_heads:
            p.append(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            p.append(f"model.transformer_impl={self.transformer_impl!r}: use auto, local or transformer_engine")
        return p + self._architecture_problems()
