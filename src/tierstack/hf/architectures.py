"""Per-architecture facts: Hugging Face config <-> ``ModelConfig`` fields, and weight names and layouts.

Weights are mapped between a Hugging Face state dict and the *full* megatron-core ``GPTModel``
state dict (tensor- and pipeline-parallel size 1, global layer numbers, vocabulary not padded).
Sharding over TP/PP ranks is left to megatron-core ``dist_checkpointing``, which reshards a GLOBAL
checkpoint at load.

Two layouts differ between the two worlds (megatron-core 0.16.1 ``SelfAttention.
get_query_key_value_tensors`` and ``MLP.forward``, read from the source):

- ``linear_qkv`` rows are grouped per query group: for each of the ``g`` key/value heads, the
  ``heads/g`` query heads it serves, then its key head, then its value head
  (``[g, heads/g + 2, head_dim, hidden]``). Hugging Face keeps separate q, k, v projections (Llama,
  Qwen2) or one ``[q; k; v]`` block (GPT-2).
- A gated MLP's ``linear_fc1`` is ``[gate; up]`` and computes ``act(gate) * up``.

GPT-2's ``Conv1D`` stores ``[in, out]`` weights, the transpose of ``nn.Linear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tierstack.config.sections import ModelConfig


class UnsupportedModelError(ValueError):
    """A Hugging Face model or a checkpoint that this mapping cannot express; names the field."""


Tensors = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------- layouts
def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Separate q ``[heads*d, ...]``, k and v ``[groups*d, ...]`` -> megatron ``linear_qkv`` rows.

    Works for weights (``[rows, hidden]``) and biases (``[rows]``).
    """
    d = q.shape[0] // heads
    rest = q.shape[1:]
    q = q.reshape(groups, heads // groups, d, *rest)
    k = k.reshape(groups, 1, d, *rest)
    v = v.reshape(groups, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_qkv`: megatron ``linear_qkv`` rows -> (q, k, v)."""
    per = heads // groups
    d = qkv.shape[0] // (groups * (per + 2))
    rest = qkv.shape[1:]
    x = qkv.reshape(groups, per + 2, d, *rest)
    q, k, v = torch.split(x, [per, 1, 1], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))  # type: ignore[return-value]


def _layer(i: int) -> str:
    return f"decoder.layers.{i}."


# ----------------------------------------------------------------------------- Llama and Qwen2
def _rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(
            f"config.json rope_parameters.rope_type={rope_type!r}: only the default RoPE is supported "
            "(no rope scaling)"
        )
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("config.json: no rope_theta (rope_parameters.rope_theta)")
    return float(theta)


def _check_head_dim(hf: Any) -> None:
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is not None and head_dim * hf.num_attention_heads != hf.hidden_size:
        raise UnsupportedModelError(
            f"config.json head_dim={head_dim}: must equal hidden_size / num_attention_heads "
            f"= {hf.hidden_size // hf.num_attention_heads}"
        )


def _llama_like_fields(hf: Any, qkv_bias: bool) -> dict:
    _check_head_dim(hf)
    if hf.hidden_act != "silu":
        raise UnsupportedModelError(f"config.json hidden_act={hf.hidden_act!r}: only silu (SwiGLU) is supported")
    bias = bool(getattr(hf, "attention_bias", False))
    if bias != bool(getattr(hf, "mlp_bias", False)):
        raise UnsupportedModelError(
            f"config.json attention_bias={bias} and mlp_bias={getattr(hf, 'mlp_bias', False)} differ; "
            "megatron-core's add_bias_linear covers both"
        )
    if getattr(hf, "use_sliding_window", False):
        raise UnsupportedModelError("config.json use_sliding_window=true: sliding-window attention is not supported")
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.rms_norm_eps),
        gated_linear_unit=True,
        activation_func="silu",
        add_bias_linear=bias,
        add_qkv_bias=qkv_bias,
        qk_layernorm=False,
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf),
        rotary_percent=float(getattr(hf, "partial_rotary_factor", 1.0) or 1.0),
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
    )


def _llama_to_megatron(sd: Tensors, m: ModelConfig) -> Tensors:
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not m.share_embeddings_and_output_weights:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(m.num_layers):
        h, t = f"model.layers.{i}.", _layer(i)
        a = h + "self_attn."
        out[t + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        out[t + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        kinds = ["weight"] + (["bias"] if (m.add_bias_linear or m.add_qkv_bias) else [])
        for kind in kinds:
            out[t + f"self_attention.linear_qkv.{kind}"] = interleave_qkv(
                sd[a + f"q_proj.{kind}"], sd[a + f"k_proj.{kind}"], sd[a + f"v_proj.{kind}"], heads, groups
            )
        out[t + "self_attention.linear_proj.weight"] = sd[a + "o_proj.weight"]
        out[t + "mlp.linear_fc1.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]])
        out[t + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"]
        if m.add_bias_linear:
            out[t + "self_attention.linear_proj.bias"] = sd[a + "o_proj.bias"]
            out[t + "mlp.linear_fc1.bias"] = torch.cat([sd[h + "mlp.gate_proj.bias"], sd[h + "mlp.up_proj.bias"]])
            out[t + "mlp.linear_fc2.bias"] = sd[h + "mlp.down_proj.bias"]
    return out


def _llama_to_hf(sd: Tensors, m: ModelConfig) -> Tensors:
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = sd["embedding.word_embeddings.weight" if m.share_embeddings_and_output_weights
                               else "output_layer.weight"]
    for i in range(m.num_layers):
        h, t = f"model.layers.{i}.", _layer(i)
        a = h + "self_attn."
        out[h + "input_layernorm.weight"] = sd[t + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[t + "pre_mlp_layernorm.weight"]
        kinds = ["weight"] + (["bias"] if (m.add_bias_linear or m.add_qkv_bias) else [])
        for kind in kinds:
            q, k, v = split_qkv(sd[t + f"self_attention.linear_qkv.{kind}"], heads, groups)
            out[a + f"q_proj.{kind}"], out[a + f"k_proj.{kind}"], out[a + f"v_proj.{kind}"] = q, k, v
        out[a + "o_proj.weight"] = sd[t + "self_attention.linear_proj.weight"]
        gate, up = torch.chunk(sd[t + "mlp.linear_fc1.weight"], 2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[h + "mlp.down_proj.weight"] = sd[t + "mlp.linear_fc2.weight"]
        if m.add_bias_linear:
            out[a + "o_proj.bias"] = sd[t + "self_attention.linear_proj.bias"]
            gate_b, up_b = torch.chunk(sd[t + "mlp.linear_fc1.bias"], 2, dim=0)
            out[h + "mlp.gate_proj.bias"], out[h + "mlp.up_proj.bias"] = gate_b.contiguous(), up_b.contiguous()
            out[h + "mlp.down_proj.bias"] = sd[t + "mlp.linear_fc2.bias"]
    return out


def _llama_like_mismatches(m: ModelConfig, *, qkv_bias: bool) -> list[str]:
    want = {"normalization": "RMSNorm", "gated_linear_unit": True, "activation_func": "silu",
            "position_embedding_type": "rope", "qk_layernorm": False, "rotary_percent": 1.0}
    if qkv_bias:
        want.update(add_bias_linear=False, add_qkv_bias=True)
    elif not m.add_bias_linear:
        want["add_qkv_bias"] = False
    return [f"model.{k}={getattr(m, k)!r} (needs {v!r})" for k, v in want.items() if getattr(m, k) != v]


def _llama_like_config(m: ModelConfig, vocab_size: int, *, qwen2: bool) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads, hidden_act="silu",
        max_position_embeddings=m.max_position_embeddings or m.seq_length, rms_norm_eps=m.layernorm_epsilon,
        tie_word_embeddings=m.share_embeddings_and_output_weights,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
    )
    if qwen2:
        return Qwen2Config(**common, use_sliding_window=False)
    return LlamaConfig(**common, attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear)


# ---------------------------------------------------------------------------------------- GPT-2
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def _gpt2_fields(hf: Any) -> dict:
    act = _GPT2_ACTIVATIONS.get(hf.activation_function)
    if act is None:
        raise UnsupportedModelError(
            f"config.json activation_function={hf.activation_function!r}: use one of {sorted(_GPT2_ACTIVATIONS)}"
        )
    if not getattr(hf, "scale_attn_weights", True) or getattr(hf, "scale_attn_by_inverse_layer_idx", False):
        raise UnsupportedModelError(
            "config.json scale_attn_weights=false or scale_attn_by_inverse_layer_idx=true: megatron-core scales "
            "attention scores by 1/sqrt(head_dim) only"
        )
    return dict(
        num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head, num_query_groups=None,
        ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, normalization="LayerNorm",
        layernorm_epsilon=float(hf.layer_norm_epsilon), gated_linear_unit=False, activation_func=act,
        add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False, position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings), vocab_size=hf.vocab_size,
        max_position_embeddings=hf.n_positions,
    )


_GPT2_LAYER = {  # megatron name -> (HF name, transpose): Conv1D weights are [in, out]
    "input_layernorm.weight": ("ln_1.weight", False), "input_layernorm.bias": ("ln_1.bias", False),
    "self_attention.linear_proj.weight": ("attn.c_proj.weight", True),
    "self_attention.linear_proj.bias": ("attn.c_proj.bias", False),
    "pre_mlp_layernorm.weight": ("ln_2.weight", False), "pre_mlp_layernorm.bias": ("ln_2.bias", False),
    "mlp.linear_fc1.weight": ("mlp.c_fc.weight", True), "mlp.linear_fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.linear_fc2.weight": ("mlp.c_proj.weight", True), "mlp.linear_fc2.bias": ("mlp.c_proj.bias", False),
}
_GPT2_GLOBAL = {
    "embedding.word_embeddings.weight": "transformer.wte.weight",
    "embedding.position_embeddings.weight": "transformer.wpe.weight",
    "decoder.final_layernorm.weight": "transformer.ln_f.weight",
    "decoder.final_layernorm.bias": "transformer.ln_f.bias",
}


def _gpt2_to_megatron(sd: Tensors, m: ModelConfig) -> Tensors:
    heads = m.num_attention_heads
    out = {t: sd[h] for t, h in _GPT2_GLOBAL.items()}
    if not m.share_embeddings_and_output_weights:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(m.num_layers):
        h, t = f"transformer.h.{i}.", _layer(i)
        for name, (hf_name, transpose) in _GPT2_LAYER.items():
            out[t + name] = sd[h + hf_name].t().contiguous() if transpose else sd[h + hf_name]
        q, k, v = torch.chunk(sd[h + "attn.c_attn.weight"].t(), 3, dim=0)
        out[t + "self_attention.linear_qkv.weight"] = interleave_qkv(q, k, v, heads, heads)
        qb, kb, vb = torch.chunk(sd[h + "attn.c_attn.bias"], 3, dim=0)
        out[t + "self_attention.linear_qkv.bias"] = interleave_qkv(qb, kb, vb, heads, heads)
    return out


def _gpt2_to_hf(sd: Tensors, m: ModelConfig) -> Tensors:
    heads = m.num_attention_heads
    out = {h: sd[t] for t, h in _GPT2_GLOBAL.items()}
    out["lm_head.weight"] = sd["embedding.word_embeddings.weight" if m.share_embeddings_and_output_weights
                               else "output_layer.weight"]
    for i in range(m.num_layers):
        h, t = f"transformer.h.{i}.", _layer(i)
        for name, (hf_name, transpose) in _GPT2_LAYER.items():
            out[h + hf_name] = sd[t + name].t().contiguous() if transpose else sd[t + name]
        q, k, v = split_qkv(sd[t + "self_attention.linear_qkv.weight"], heads, heads)
        out[h + "attn.c_attn.weight"] = torch.cat([q, k, v]).t().contiguous()
        out[h + "attn.c_attn.bias"] = torch.cat(split_qkv(sd[t + "self_attention.linear_qkv.bias"], heads, heads))
    return out


def _gpt2_mismatches(m: ModelConfig) -> list[str]:
    want = {"normalization": "LayerNorm", "gated_linear_unit": False, "position_embedding_type": "learned_absolute",
            "add_bias_linear": True, "qk_layernorm": False}
    p = [f"model.{k}={getattr(m, k)!r} (needs {v!r})" for k, v in want.items() if getattr(m, k) != v]
    if m.activation_func not in ("gelu", "gelu_tanh", "relu"):
        p.append(f"model.activation_func={m.activation_func!r} (needs gelu, gelu_tanh or relu)")
    if m.num_query_groups not in (None, m.num_attention_heads):
        p.append(f"model.num_query_groups={m.num_query_groups} (needs multi-head attention)")
    return p


def _gpt2_config(m: ModelConfig, vocab_size: int) -> Any:
    from transformers import GPT2Config

    act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}[m.activation_func]
    return GPT2Config(
        vocab_size=vocab_size, n_positions=m.max_position_embeddings or m.seq_length, n_embd=m.hidden_size,
        n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size or 4 * m.hidden_size,
        activation_function=act, layer_norm_epsilon=m.layernorm_epsilon,
        tie_word_embeddings=m.share_embeddings_and_output_weights,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


# ---------------------------------------------------------------------------------------- table
@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture and how its weights map to megatron-core's.

    Attributes:
        name: the ``architectures`` entry of ``config.json`` (e.g. ``LlamaForCausalLM``).
        model_fields: HF config object -> ``ModelConfig`` field values (raises UnsupportedModelError).
        to_megatron / to_hf: full state dicts from one naming to the other (vocabulary unpadded).
        mismatches: ``ModelConfig`` -> fields this architecture cannot express (empty = exportable).
        hf_config: ``(ModelConfig, vocab_size)`` -> the HF config object for export.
    """

    name: str
    model_fields: Callable[[Any], dict]
    to_megatron: Callable[[Tensors, ModelConfig], Tensors]
    to_hf: Callable[[Tensors, ModelConfig], Tensors]
    mismatches: Callable[[ModelConfig], list]
    hf_config: Callable[[ModelConfig, int], Any]


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", lambda hf: _llama_like_fields(hf, False), _llama_to_megatron, _llama_to_hf,
                     lambda m: _llama_like_mismatches(m, qkv_bias=False),
                     lambda m, v: _llama_like_config(m, v, qwen2=False)),
        Architecture("Qwen2ForCausalLM", lambda hf: _llama_like_fields(hf, True), _llama_to_megatron, _llama_to_hf,
                     lambda m: _llama_like_mismatches(m, qkv_bias=True),
                     lambda m, v: _llama_like_config(m, v, qwen2=True)),
        Architecture("GPT2LMHeadModel", _gpt2_fields, _gpt2_to_megatron, _gpt2_to_hf, _gpt2_mismatches, _gpt2_config),
    )
}


def architecture_of_hf(hf_config: Any, source: str) -> Architecture:
    """The supported architecture named by ``config.json`` ``architectures``.

    Raises:
        UnsupportedModelError: none or an unsupported one (names the file and the supported list).
    """
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise UnsupportedModelError(
        f"{source}: architectures={names or None} is not supported; supported: {sorted(ARCHITECTURES)}"
    )


def architecture_for_export(m: ModelConfig) -> Architecture:
    """The first architecture that expresses every field of ``m``.

    Raises:
        UnsupportedModelError: none does; names the fields that stop the closest one.
    """
    found = {name: arch.mismatches(m) for name, arch in ARCHITECTURES.items()}
    if m.add_qkv_bias and not m.add_bias_linear:
        found.pop("LlamaForCausalLM")  # Llama's attention_bias also adds an o_proj bias
    else:
        found.pop("Qwen2ForCausalLM")
    for name, problems in found.items():
        if not problems:
            return ARCHITECTURES[name]
    name, problems = min(found.items(), key=lambda kv: len(kv[1]))
    raise UnsupportedModelError(
        "no supported Hugging Face architecture expresses this checkpoint; closest is " + name + ", which needs: "
        + "; ".join(problems)
    )
