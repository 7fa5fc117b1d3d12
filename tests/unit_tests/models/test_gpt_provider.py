"""Model provider facts that hold without building a model."""

import pytest

from tierstack.config import ConfigContainer
from tierstack.models.gpt import build_transformer_config, padded_vocab_size


@pytest.mark.parametrize(
    "vocab, divisor, tp, expected",
    [(257, 4, 1, 260), (257, 4, 2, 264), (256, 128, 1, 256), (50257, 128, 8, 51200)],
)
def test_vocab_is_padded_to_a_multiple_of_divisor_times_tp(vocab, divisor, tp, expected):
    assert padded_vocab_size(vocab, divisor, tp) == expected


def test_transformer_config_follows_the_model_and_distributed_sections():
    cfg = ConfigContainer().apply_overrides(
        ["model.num_layers=6", "model.hidden_size=96", "model.num_attention_heads=6", "distributed.tensor_model_parallel_size=2"]
    )
    tc = build_transformer_config(cfg)
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads) == (6, 96, 6)
    assert tc.ffn_hidden_size == 4 * 96
    assert tc.tensor_model_parallel_size == 2
