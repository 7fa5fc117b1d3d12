"""HF -> GLOBAL checkpoint -> HF, in this process (one rank, TP=PP=1), on tiny random models.

Logits are compared, not shapes: a wrong QKV interleaving, [gate; up] order, transposition, norm
epsilon or RoPE base loads without error and only shows in the outputs.
"""

import dataclasses

import pytest
import torch

import tiny_hf
from tierstack.config import DistributedConfig
from tierstack.hf import checkpoint_io, export_hf, import_hf


def megatron_logits(step_dir, tokens, vocab):
    cfg = checkpoint_io.read_run_config(step_dir)
    here = dataclasses.replace(cfg, distributed=DistributedConfig(), mlflow=None, straggler=None)
    with checkpoint_io.parallel_world(here):
        objs = checkpoint_io.load_model_weights(here, step_dir)
        pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        with torch.no_grad():
            out = objs.model[0](tokens, pos, None)
    return out[..., :vocab], out.shape[-1]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_import_matches_hf_logits_and_export_is_bit_identical(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    hf = tiny_hf.build_model(kind)
    tiny_hf.save_model(kind, tmp_path / "hf")
    vocab = hf.config.vocab_size
    step = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert step.name == "iter_0000000" and (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"

    tokens = tiny_hf.sample_tokens(vocab)
    ours, padded = megatron_logits(step, tokens, vocab)
    with torch.no_grad():
        ref = hf(tokens).logits
    assert padded % 4 == 0 and padded >= vocab
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)

    out = export_hf(tmp_path / "ckpt", tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert back.config.vocab_size == vocab  # padded rows dropped
    a, b = hf.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, ref)


def test_vocabulary_padding_is_added_on_import_and_dropped_on_export(tmp_path):
    """qwen2's 101-token vocabulary is padded to 104 (divisor 4) and, for TP=2, to 104 (8)."""
    tiny_hf.save_model("qwen2", tmp_path / "hf")
    step = import_hf(tmp_path / "hf", tmp_path / "ckpt", tensor_model_parallel_size=2)
    assert checkpoint_io.saved_padded_vocab_size(step) == 104
    cfg = checkpoint_io.read_run_config(step)
    assert cfg.distributed.tensor_model_parallel_size == 2 and cfg.model.vocab_size == 101
    assert cfg.model.share_embeddings_and_output_weights  # qwen2 tiny is tied
    assert cfg.model.add_qkv_bias and not cfg.model.add_bias_linear
    assert cfg.model.rotary_base == 1e6 and cfg.model.layernorm_epsilon == 1e-6


def test_sharded_in_sharded_out_and_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = tiny_hf.build_model("llama")
    tiny_hf.save_model("llama", tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    out = export_hf(tmp_path / "ckpt", tmp_path / "out", max_shard_size="40KB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert (out / "model.safetensors.index.json").is_file() and len(shards) > 1
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    out16 = export_hf(tmp_path / "ckpt", tmp_path / "out16", dtype="bf16")
    from safetensors.torch import load_file

    saved = load_file(str(out16 / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    assert torch.equal(saved["model.embed_tokens.weight"], hf.state_dict()["model.embed_tokens.weight"].bfloat16())


def test_transformers_greedy_generation_equals_tierstack_generate(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tierstack.hf.generate import SamplingConfig, generate

    tiny_hf.save_model("llama", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    out = export_hf(tmp_path / "ckpt", tmp_path / "out")
    prompt = "w5 w17 w99 w3"
    ours = generate(tmp_path / "ckpt", prompt, SamplingConfig(max_new_tokens=12, temperature=0.0))

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    assert ids[0].tolist() == ours.prompt_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.eos_token_id)
    theirs = gen[0, ids.shape[1]:].tolist()
    assert ours.new_ids == theirs
    assert len(set(theirs)) > 1  # not a degenerate repeat of one token

    # Sampling: the seed decides, the same seed gives the same tokens.
    s = SamplingConfig(max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    assert generate(tmp_path / "ckpt", prompt, s).new_ids == generate(tmp_path / "ckpt", prompt, s).new_ids
