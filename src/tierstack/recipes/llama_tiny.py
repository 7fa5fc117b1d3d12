"""Llama tiny: gpt_tiny's size in the Llama shape (RMSNorm, SwiGLU, grouped-query attention, RoPE,
untied output layer, no biases), byte tokenizer, TP=2 on 2 ranks.

The default corpus is the Python standard library's sources (preprocessed once, cached).
Export the result with ``tierstack convert export --load runs/llama_tiny/checkpoints --hf-path OUT``.
"""

from tierstack.config import ConfigContainer
from tierstack.recipes.base import gpt_config


def llama_tiny_config() -> ConfigContainer:
    """4 layers, hidden 256, 8 query heads in 4 groups, MLP 768 (Llama's 8h/3 rounded up to 256)."""
    cfg = gpt_config(
        "llama_tiny",
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        seq_length=256,
        train_iters=200,
        micro_batch_size=8,
        global_batch_size=8,
        lr=3e-3,
        tensor_model_parallel_size=2,
    )
    m = cfg.model
    m.normalization = "RMSNorm"
    m.layernorm_epsilon = 1e-5
    m.gated_linear_unit = True
    m.activation_func = "silu"
    m.num_query_groups = 4
    m.ffn_hidden_size = 768
    m.add_bias_linear = False
    m.position_embedding_type = "rope"
    m.rotary_base = 10000.0
    m.share_embeddings_and_output_weights = False
    return cfg
