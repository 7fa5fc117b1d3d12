"""Fused-kernel flags: off without a GPU; on a GPU, on exactly where the kernels exist, accepted by
megatron-core's own TransformerConfig validation for every MLP the model section can describe, and
computing the same function as the unfused MLP."""

import dataclasses
import itertools
import sys
import types

import pytest
import torch

from tierstack.config import ConfigContainer
from tierstack.models.gpt import build_transformer_config
from tierstack.runtime import fusions

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")
MLP_TABLE = list(itertools.product(ACTIVATIONS, (False, True), (False, True)))  # (activation, gated, bias)


def _model(activation: str, gated: bool, bias: bool) -> ConfigContainer:
    cfg = ConfigContainer()
    cfg.model = dataclasses.replace(cfg.model, activation_func=activation, gated_linear_unit=gated,
                                    add_bias_linear=bias)
    return cfg


def _gpu_without_extensions(monkeypatch):
    monkeypatch.setattr(fusions, "has_gpu", lambda: True)
    for name in ("fused_weight_gradient_mlp_cuda", "scaled_upper_triang_masked_softmax_cuda",
                 "scaled_masked_softmax_cuda", "apex.contrib.layer_norm.layer_norm"):
        monkeypatch.setitem(sys.modules, name, None)  # not installed (as on this CPU machine)


def test_no_fusion_without_gpu(monkeypatch):
    monkeypatch.setattr(fusions, "has_gpu", lambda: False)
    for activation, gated, bias in MLP_TABLE:
        flags = fusions.fusion_flags(activation_func=activation, gated_linear_unit=gated, add_bias_linear=bias)
        assert flags == {name: False for name in fusions.FUSION_FIELDS}


@pytest.mark.parametrize("activation,gated,bias", MLP_TABLE)
def test_every_mlp_builds_on_a_gpu_and_only_swiglu_is_bias_activation_fused(monkeypatch, activation, gated, bias):
    _gpu_without_extensions(monkeypatch)
    # megatron-core's TransformerConfig.__post_init__ validates the flags (it raised ValueError for
    # gelu_tanh, relu and bias-less gelu when the fusion was always on)
    tcfg = build_transformer_config(_model(activation, gated, bias))
    assert tcfg.bias_activation_fusion is (activation == "silu" and gated)
    assert tcfg.bias_dropout_fusion is True
    assert tcfg.gradient_accumulation_fusion is False and tcfg.masked_softmax_fusion is False


def test_gradient_accumulation_fusion_follows_the_apex_extension(monkeypatch):
    monkeypatch.setattr(fusions, "has_gpu", lambda: True)
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", types.ModuleType("fused_weight_gradient_mlp_cuda"))
    flags = fusions.fusion_flags(activation_func="gelu", gated_linear_unit=False, add_bias_linear=True)
    assert flags["gradient_accumulation_fusion"] is True


def test_cpu_model_config_has_every_fusion_off():
    if fusions.has_gpu():
        pytest.skip("CPU behaviour")
    tcfg = build_transformer_config(ConfigContainer())
    assert not any(getattr(tcfg, name) for name in fusions.FUSION_FIELDS)


def _mlp_output(tcfg, seed: int, x: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    torch.manual_seed(seed)
    mlp = MLP(tcfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    with torch.no_grad():
        for p in mlp.parameters():  # biases start at zero: give them values so the fused bias add counts
            p.normal_(0, 0.5)
    out, bias = mlp(x)
    return out if bias is None else out + bias


@pytest.mark.parametrize("bias", (False, True))
def test_the_fused_mlp_computes_what_the_unfused_one_does(bias):
    """Where the flag goes on (SwiGLU), megatron-core's fused kernel (run eagerly on CPU: the JIT
    fuser is off) gives the unfused MLP's output; the fused GELU it would use for ``gelu`` is the
    tanh approximation, which is why ``gelu`` stays unfused."""
    from megatron.core.fusions.fused_bias_gelu import bias_gelu

    from tierstack.hf import checkpoint_io

    cfg = _model("silu", True, bias)
    cfg.model = dataclasses.replace(cfg.model, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4)
    with checkpoint_io.parallel_world(cfg):
        plain = build_transformer_config(cfg)
        fused = dataclasses.replace(plain, bias_activation_fusion=True)  # re-validated by __post_init__
        x = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(_mlp_output(fused, 0, x), _mlp_output(plain, 0, x), rtol=1e-6, atol=1e-6)
    y = torch.linspace(-4, 4, 101)
    assert (bias_gelu(torch.zeros(()), y) - torch.nn.functional.gelu(y)).abs().max() > 1e-4
