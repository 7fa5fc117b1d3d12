"""Llama 3 145M, for GPUs: the Llama-3-shaped model of Megatron-Bridge's functional tests
(``Llama3ModelProvider145M``: 2 layers, hidden 768, MLP 2688, 16 query heads in 8 groups, RoPE base
500000, RMSNorm epsilon 1e-5, untied output layer, init std 0.01), sequence 8192.

With a Llama 3 tokenizer: ``tokenizer.tokenizer_type=huggingface tokenizer.tokenizer_path=.../tokenizer.json``.
"""

from tierstack.config import ConfigContainer
from tierstack.recipes.base import gpt_config


def llama3_145m_config() -> ConfigContainer:
    """bf16, DistributedOptimizer, TP=1 (DP = world size), both checkpoint tiers."""
    cfg = gpt_config(
        "llama3_145m",
        num_layers=2,
        hidden_size=768,
        num_attention_heads=16,
        seq_length=8192,
        train_iters=20000,
        micro_batch_size=1,
        global_batch_size=32,
        lr=3e-4,
        tensor_model_parallel_size=1,
    )
    m = cfg.model
    m.normalization = "RMSNorm"
    m.layernorm_epsilon = 1e-5
    m.gated_linear_unit = True
    m.activation_func = "silu"
    m.num_query_groups = 8
    m.ffn_hidden_size = 2688
    m.add_bias_linear = False
    m.position_embedding_type = "rope"
    m.rotary_base = 500000.0
    m.share_embeddings_and_output_weights = False
    m.init_method_std = 0.01
    m.make_vocab_size_divisible_by = 128
    m.bf16 = True
    cfg.optimizer.use_distributed_optimizer = True
    cfg.checkpoint.local_save_interval = 100
    cfg.checkpoint.save_interval = 1000
    return cfg
