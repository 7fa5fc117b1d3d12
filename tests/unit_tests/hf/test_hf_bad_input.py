"""Bad input to import/export: one clear error naming the field or file, before anything is written."""

import dataclasses
import json
import subprocess
import sys

import pytest

import tiny_hf
from tierstack.config import ConfigContainer, ModelConfig
from tierstack.hf import HFCheckpointError, UnsupportedModelError, export_hf, import_hf
from tierstack.hf.architectures import architecture_for_export


def test_unsupported_architecture_names_config_json(tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    GPTNeoXForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(UnsupportedModelError, match=r"config\.json: architectures=\['GPTNeoXForCausalLM'\] is not supported"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_unsupported_option_names_the_config_field(tmp_path):
    hf = tiny_hf.hf_config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(hf).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(UnsupportedModelError, match="rope_type='linear'"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")


def test_missing_weight_files_name_the_file(tmp_path):
    tiny_hf.save_model("llama", tmp_path / "one")
    (tmp_path / "one" / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match="no weight files .model.safetensors"):
        import_hf(tmp_path / "one", tmp_path / "ckpt")
    tiny_hf.save_model("llama", tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "sharded" / shard).unlink()
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors\.index\.json is missing shard file\(s\) \['model-000"):
        import_hf(tmp_path / "sharded", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_tokenizer_larger_than_the_embedding_names_both(tmp_path):
    tiny_hf.save_model("llama", tmp_path / "hf", tokenizer_ids=140)  # the model has 128 rows
    with pytest.raises(HFCheckpointError, match=r"tokenizer\.json: 140 token ids but config\.json vocab_size=128"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_export_refuses_options_hf_cannot_express_naming_the_field():
    gpt_tiny_shape = ModelConfig()  # LayerNorm, GeLU, biases, RoPE: no supported HF class has it
    with pytest.raises(UnsupportedModelError, match="model.position_embedding_type='rope'"):
        architecture_for_export(gpt_tiny_shape)
    llama = dataclasses.replace(ModelConfig(), normalization="RMSNorm", gated_linear_unit=True, activation_func="silu",
                                add_bias_linear=False, qk_layernorm=True)
    with pytest.raises(UnsupportedModelError, match="closest is LlamaForCausalLM, which needs: model.qk_layernorm=True"):
        architecture_for_export(llama)
    assert architecture_for_export(dataclasses.replace(llama, qk_layernorm=False)).name == "LlamaForCausalLM"
    assert architecture_for_export(dataclasses.replace(llama, qk_layernorm=False, add_qkv_bias=True)).name == "Qwen2ForCausalLM"


def test_export_of_a_real_checkpoint_hf_cannot_express_fails_before_writing(tmp_path):
    from tierstack.hf import checkpoint_io

    cfg = ConfigContainer().apply_overrides(["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=4",
                                             "model.seq_length=16", "mlflow=null"])
    with checkpoint_io.parallel_world(cfg):
        checkpoint_io.save_global(cfg, checkpoint_io.build_objects(cfg, 257), tmp_path / "ckpt")
    with pytest.raises(UnsupportedModelError, match="model.normalization='LayerNorm'|model.position_embedding_type"):
        export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_prints_one_line_and_exits_2(tmp_path):
    tiny_hf.save_model("llama", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    proc = subprocess.run([sys.executable, "-m", "tierstack.cli", "convert", "import", "--hf-path", str(tmp_path / "hf"),
                           "--save", str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "tierstack convert import: --hf-path" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "tierstack.cli", "convert", "export", "--load", str(tmp_path / "nope"),
                           "--hf-path", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "latest_checkpointed_iteration.txt" in proc.stderr


def test_pretrained_hf_directory_with_other_model_fields_names_each(tmp_path):
    from tierstack.hf.convert import read_hf_config, run_config_for_hf
    from tierstack.hf.pretrained import model_field_differences

    tiny_hf.save_model("llama", tmp_path / "hf")
    _c, _a, fields = read_hf_config(tmp_path / "hf")
    same = run_config_for_hf(fields, None, 1, 1)
    assert model_field_differences(same, fields) == []
    other = dataclasses.replace(same, model=dataclasses.replace(same.model, num_query_groups=4, rotary_base=10000.0))
    diffs = model_field_differences(other, fields)
    assert diffs == ["model.num_query_groups=4 but config.json gives 2",
                     "model.rotary_base=10000.0 but config.json gives 50000.0"]
