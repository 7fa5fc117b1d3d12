"""Fused-kernel flags: off without a GPU; on a GPU, on exactly where the kernels exist, and accepted
by megatron-core's own TransformerConfig validation."""

import sys
import types

import pytest

from tierstack.config import ConfigContainer
from tierstack.models.gpt import build_transformer_config
from tierstack.runtime import fusions


def test_no_fusion_without_gpu(monkeypatch):
    monkeypatch.setattr(fusions, "has_gpu", lambda: False)
    assert fusions.fusion_flags() == {name: False for name in fusions.FUSION_FIELDS}


def test_gpu_without_extensions_gets_the_torch_jit_fusions_only(monkeypatch):
    monkeypatch.setattr(fusions, "has_gpu", lambda: True)
    for name in ("fused_weight_gradient_mlp_cuda", "scaled_upper_triang_masked_softmax_cuda",
                 "scaled_masked_softmax_cuda", "apex.contrib.layer_norm.layer_norm"):
        monkeypatch.setitem(sys.modules, name, None)  # not installed (as on this CPU machine)
    flags = fusions.fusion_flags()
    assert flags["bias_activation_fusion"] and flags["bias_dropout_fusion"]
    assert not flags["gradient_accumulation_fusion"]
    assert not flags["masked_softmax_fusion"] and not flags["persist_layer_norm"]
    # megatron-core validates the combination for the tierstack GPT (gelu with bias).
    tcfg = build_transformer_config(ConfigContainer())
    assert tcfg.bias_activation_fusion is True and tcfg.gradient_accumulation_fusion is False


def test_gradient_accumulation_fusion_follows_the_apex_extension(monkeypatch):
    monkeypatch.setattr(fusions, "has_gpu", lambda: True)
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", types.ModuleType("fused_weight_gradient_mlp_cuda"))
    assert fusions.fusion_flags()["gradient_accumulation_fusion"] is True


def test_cpu_model_config_has_every_fusion_off():
    if fusions.has_gpu():
        pytest.skip("CPU behaviour")
    tcfg = build_transformer_config(ConfigContainer())
    assert not any(getattr(tcfg, name) for name in fusions.FUSION_FIELDS)
