"""GPT small: 12 layers, hidden 768, 12 heads, sequence 1024 (GPT-2 small shape), for GPUs."""

from tierstack.config import ConfigContainer
from tierstack.recipes.base import gpt_config


def gpt_small_config() -> ConfigContainer:
    """GPT-2-small-sized pretraining with both checkpoint tiers (TP=2; DP = world / 2).

    Same base as gpt_tiny; only the sizes, bf16, the distributed optimizer and the intervals differ.
    """
    cfg = gpt_config(
        "gpt_small",
        num_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        seq_length=1024,
        train_iters=20000,
        micro_batch_size=8,
        global_batch_size=256,
        lr=6e-4,
        tensor_model_parallel_size=2,
    )
    cfg.model.bf16 = True
    cfg.optimizer.use_distributed_optimizer = True
    cfg.checkpoint.local_save_interval = 100
    cfg.checkpoint.save_interval = 1000
    return cfg
