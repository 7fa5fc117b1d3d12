"""Hugging Face import and export under both megatron-core layer specs.

The transformer-engine spec keeps each pre-attention / pre-MLP layer norm inside the linear layer that
follows it (TE's ``LayerNormLinear``: ``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``
and ``_bias``), where the local spec has ``input_layernorm`` / ``pre_mlp_layernorm`` modules. The
TE-spec names are written out here as megatron-core's TE spec produces them (``TELayerNormColumnParallelLinear``
parameters, megatron-core 0.16.1 and 0.19.2 ``extensions/transformer_engine.py``): transformer-engine
does not install without CUDA, so the TE model itself is built only where it imports.
"""

import dataclasses

import pytest
import torch

import tiny_hf
from tierstack.config import DistributedConfig
from tierstack.hf import checkpoint_io, convert

TE_NAMES = {  # local-spec layer name -> the TE spec's
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


def _te_key(key: str) -> str:
    head, _, rest = key.partition("decoder.layers.")
    if not _:
        return key
    num, _, name = rest.partition(".")
    return f"decoder.layers.{num}.{TE_NAMES.get(name, name)}"


def _imported(kind: str, tmp_path, impl: str = "local"):
    """(mapped HF state dict in local names, the built model's state-dict keys) for ``kind``."""
    tiny_hf.save_model(kind, tmp_path / kind)
    hf = convert.read_hf_model(tmp_path / kind)
    cfg = convert.run_config_for_hf(hf.model_fields, None, 1, 1)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, transformer_impl=impl),
                              distributed=DistributedConfig(), mlflow=None, straggler=None)
    from tierstack.models.gpt import padded_vocab_size

    padded = padded_vocab_size(hf.model_fields["vocab_size"], cfg.model.make_vocab_size_divisible_by, 1)
    with checkpoint_io.parallel_world(cfg):
        objs = checkpoint_io.build_objects(cfg, padded)
        keys = [k for k in objs.model[0].module.state_dict() if not k.endswith("_extra_state")]
    return convert.megatron_state_dict(hf, cfg.model, padded), keys


@pytest.mark.parametrize("kind", ["gpt2", "llama"])  # LayerNorm with biases; RMSNorm without
def test_both_specs_names_map_one_to_one(tmp_path, kind):
    sd, local_keys = _imported(kind, tmp_path)
    assert set(sd) == set(local_keys)  # the local spec's own names
    te_keys = [_te_key(k) for k in local_keys] + ["decoder.layers.0.self_attention.linear_qkv._extra_state"]
    assert any("layer_norm_weight" in k for k in te_keys) and not any("input_layernorm" in k for k in te_keys)
    te_sd = convert.to_model_names(sd, te_keys)
    assert set(te_sd) == {k for k in te_keys if not k.endswith("_extra_state")}
    assert convert.to_model_names(sd, local_keys) is sd  # a local model: nothing renamed
    back = convert.to_local_names({**te_sd, "decoder.layers.0.self_attention.linear_qkv._extra_state": None})
    back.pop("decoder.layers.0.self_attention.linear_qkv._extra_state")
    assert set(back) == set(sd) and all(back[k] is sd[k] for k in sd)
    assert convert.to_local_names(sd) == sd


def test_the_renames_are_megatron_cores_own_map():
    assert convert._norm_renames() == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                       "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def test_a_transformer_engine_model_takes_the_imported_weights(tmp_path):
    from tierstack.models.gpt import transformer_engine_available

    if not (transformer_engine_available() and torch.cuda.is_available()):
        pytest.skip("needs transformer-engine and a GPU (scripts/gpu_check.sh runs it)")
    sd, te_keys = _imported("gpt2", tmp_path, impl="transformer_engine")
    assert any(k.endswith("linear_qkv.layer_norm_weight") for k in te_keys)
    assert set(convert.to_model_names(sd, te_keys)) == {k for k in te_keys if not k.endswith("_extra_state")}
