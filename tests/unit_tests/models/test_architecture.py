"""Architecture fields: validation names the field; FLOPs per iteration match a count of the real model's matmuls."""

import dataclasses

import pytest
import torch

from tierstack.config import ConfigContainer, ConfigError

def _flops(cfg: ConfigContainer, vocab_size: int) -> float:
    from tierstack.training.loop import model_flops_per_iteration

    m = cfg.model
    return model_flops_per_iteration(
        global_batch_size=cfg.train.global_batch_size, seq_length=m.seq_length, num_layers=m.num_layers,
        hidden_size=m.hidden_size, vocab_size=vocab_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
        gated_linear_unit=m.gated_linear_unit,
    )


LLAMA = ["model.normalization=RMSNorm", "model.gated_linear_unit=true", "model.activation_func=silu",
         "model.add_bias_linear=false", "model.share_embeddings_and_output_weights=false"]


@pytest.mark.parametrize("overrides, tp, message", [
    (["model.num_query_groups=3"], 1, "model.num_query_groups=3: must divide model.num_attention_heads=8"),
    (["model.num_query_groups=2"], 4, "model.num_query_groups=2 is not divisible by distributed.tensor_model_parallel_size=4"),
    (["model.normalization=rmsnorm"], 1, "model.normalization='rmsnorm': use one of ('LayerNorm', 'RMSNorm')"),
    (["model.activation_func=swiglu"], 1, "model.activation_func='swiglu'"),
    (["model.position_embedding_type=alibi"], 1, "model.position_embedding_type='alibi'"),
    (["model.rotary_percent=0"], 1, "model.rotary_percent=0.0: must be in (0, 1]"),
    (["model.position_embedding_type=learned_absolute", "model.max_position_embeddings=128"], 1,
     "model.seq_length=256 exceeds model.max_position_embeddings=128"),
])
def test_bad_architecture_fields_are_named(overrides, tp, message):
    cfg = ConfigContainer().apply_overrides(overrides + [f"distributed.tensor_model_parallel_size={tp}",
                                                         "train.global_batch_size=8"])
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=tp)
    assert message in str(err.value)


def test_model_section_checks_its_own_architecture_fields_and_leaves_tp_to_the_container():
    from tierstack.config import ModelConfig

    bad = ModelConfig(num_query_groups=3, normalization="rmsnorm")
    with pytest.raises(ConfigError) as err:
        bad.validate()
    assert sorted(p.split(":")[0] for p in err.value.problems) == ["model.normalization='rmsnorm'", "model.num_query_groups=3"]
    assert ModelConfig(num_query_groups=2).problems() == []  # 2 groups at TP=4 is a cross-section rule


def test_llama_shape_builds_megatron_modules():
    from tierstack.models.gpt import build_transformer_config

    cfg = ConfigContainer().apply_overrides(LLAMA + ["model.num_query_groups=2", "model.rotary_base=500000"])
    cfg.validate(world_size=1)
    tc = build_transformer_config(cfg)
    assert (tc.normalization, tc.gated_linear_unit, tc.num_query_groups, tc.add_bias_linear) == ("RMSNorm", True, 2, False)
    assert tc.activation_func is torch.nn.functional.silu


@pytest.mark.parametrize("shape", [[], LLAMA + ["model.num_query_groups=2", "model.ffn_hidden_size=96"]])
def test_flops_per_iteration_equal_a_count_of_the_model_matmuls(shape):
    """torch's FlopCounterMode counts every matmul of a real forward + backward of the megatron model."""
    from torch.utils.flop_counter import FlopCounterMode

    from tierstack.hf import checkpoint_io
    from tierstack.models.gpt import gpt_model_provider

    cfg = ConfigContainer().apply_overrides(shape + ["model.num_layers=2", "model.hidden_size=64",
                                                     "model.num_attention_heads=4", "model.seq_length=32",
                                                     "train.global_batch_size=2", "mlflow=null"])
    vocab = 128
    with checkpoint_io.parallel_world(cfg):
        model = gpt_model_provider(cfg, vocab)()
        tokens = torch.randint(0, vocab, (2, 32))
        pos = torch.arange(32)[None].expand(2, 32)
        with FlopCounterMode(display=False) as counter:
            model(tokens, pos, None, labels=tokens).sum().backward()
    counted = counter.get_total_flops()
    assert _flops(cfg, vocab) == pytest.approx(counted, rel=1e-9)


def test_flops_reduce_to_narayanan_eq3_for_the_gpt_shape():
    cfg = ConfigContainer()
    b, s, l, h, v = cfg.train.global_batch_size, cfg.model.seq_length, cfg.model.num_layers, cfg.model.hidden_size, 264
    eq3 = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * h * l))
    assert _flops(cfg, v) == pytest.approx(eq3, rel=1e-12)
    gqa = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_query_groups=2))
    assert _flops(gqa, v) < _flops(cfg, v)


def test_llama_recipes_validate_and_have_the_llama_shape():
    import runpy
    from pathlib import Path

    from tierstack.hf.architectures import architecture_for_export
    from tierstack.recipes import RECIPES, llama3_145m_config, llama_tiny_config

    recipes_dir = Path(__file__).resolve().parents[3] / "recipes"
    for name, fn in (("llama_tiny", llama_tiny_config), ("llama3_145m", llama3_145m_config)):
        assert RECIPES[name] is fn  # 'tierstack pretrain NAME' runs it
        assert runpy.run_path(str(recipes_dir / f"{name}.py"), run_name="not_main")[f"{name}_config"] is fn

    tiny, big = llama_tiny_config(), llama3_145m_config()
    tiny.validate(world_size=2)
    big.validate(world_size=8)
    assert tiny.distributed.tensor_model_parallel_size == 2 and tiny.dataset.data_path is None
    for m in (tiny.model, big.model):
        assert (m.normalization, m.gated_linear_unit, m.activation_func, m.position_embedding_type) == (
            "RMSNorm", True, "silu", "rope")
        assert m.num_query_groups < m.num_attention_heads and not m.share_embeddings_and_output_weights
        assert architecture_for_export(m).name == "LlamaForCausalLM"
    assert (big.model.num_layers, big.model.hidden_size, big.model.ffn_hidden_size, big.model.rotary_base) == (
        2, 768, 2688, 500000.0)
