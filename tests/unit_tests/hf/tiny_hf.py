"""Tiny random Hugging Face models built from configs (nothing downloaded), saved with a tokenizer.

Weights are redrawn with a large spread (norm weights around 1, not exactly 1) so that a wrong
layout (QKV order, [gate; up], a transposed weight, the wrong epsilon or RoPE base) changes logits
far beyond the comparison tolerance.
"""

from __future__ import annotations

from pathlib import Path

import torch

EOD = "<|endoftext|>"


def word_tokenizer(n_ids: int):
    """A ``tokenizers`` WordLevel tokenizer with ``n_ids`` ids: ``<|endoftext|>`` = 0, then ``w1`` ... ."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOD: 0, **{f"w{i}": i for i in range(1, n_ids)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def hf_config(kind: str, **over):
    """Config of a tiny ``llama`` (GQA, untied), ``qwen2`` (QKV bias, tied, odd vocabulary) or ``gpt2``."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    if kind == "llama":
        kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False,
                  max_position_embeddings=128)
        cfg = LlamaConfig(**{**kw, **over})
    elif kind == "qwen2":
        kw = dict(vocab_size=101, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                  max_position_embeddings=128)
        cfg = Qwen2Config(**{**kw, **over})
    elif kind == "gpt2":
        kw = dict(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, activation_function="gelu_new",
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg = GPT2Config(**{**kw, **over})
    else:
        raise ValueError(kind)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}[kind]]
    return cfg


def build_model(kind: str, seed: int = 0, **over):
    """A random fp32 HF causal LM of ``kind`` in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **over), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def save_model(kind: str, path: Path, seed: int = 0, tokenizer_ids: int | None = None, **save_kw) -> Path:
    """Build, then ``save_pretrained`` ``kind`` with a ``tokenizer.json`` of ``tokenizer_ids`` ids."""
    from transformers import PreTrainedTokenizerFast

    model = build_model(kind, seed)
    model.save_pretrained(str(path), **save_kw)
    n = tokenizer_ids or model.config.vocab_size
    PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(n), eos_token=EOD).save_pretrained(str(path))
    return Path(path)


def sample_tokens(vocab: int, batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
