"""GPT tiny: 4 layers, hidden 256, 8 heads, sequence 256, byte tokenizer, TP=2 on 2 ranks (the main job)."""

from tierstack.config import ConfigContainer
from tierstack.recipes.base import gpt_config


def gpt_tiny_config() -> ConfigContainer:
    """The main job's config: about 4-5 minutes on 2 CPU cores.

    The default corpus is the Python standard library's sources (preprocessed once, cached).
    """
    return gpt_config(
        "gpt_tiny",
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
