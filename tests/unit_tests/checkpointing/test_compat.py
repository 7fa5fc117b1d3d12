"""A checkpoint's recorded tokenizer and config against the current run (issue 15), in one process."""

import dataclasses
import logging

import pytest

from tierstack.checkpointing import compat
from tierstack.config import ConfigContainer
from tierstack.config.sections import ModelConfig


def _record(cfg):
    return compat.manifest_fields(cfg.to_dict())  # what a tier records from its run config


def _hf(tmp_path, n_words):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(n_words)}
    vocab["</s>"] = n_words
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    path = tmp_path / f"tok{n_words}.json"
    tok.save(str(path))
    return str(path)


def test_shape_fields_and_tokenizer_are_refused_all_at_once(tmp_path):
    saved = _record(ConfigContainer())
    now = ConfigContainer().apply_overrides(
        ["model.hidden_size=192", "model.num_layers=3", "tokenizer.tokenizer_type=huggingface",
         f"tokenizer.tokenizer_path={_hf(tmp_path, 1999)}", "train.train_iters=999"])
    with pytest.raises(compat.CheckpointMismatchError) as err:
        compat.check(saved, now.to_dict(), "GLOBAL step 10 (/ckpt)")
    text = str(err.value)
    assert "model.hidden_size: 256 in the checkpoint, 192 now" in text
    assert "model.num_layers: 4 in the checkpoint, 3 now" in text
    assert "tokenizer: the byte tokenizer (vocabulary 257) in the checkpoint, the Hugging Face tokenizer" in text
    assert "(vocabulary 2000" in text
    # the values to paste, the tokenizer's fields named one by one
    assert ("put back (paste-ready): model.hidden_size=256 model.num_layers=4 tokenizer.tokenizer_path=null "
            "tokenizer.tokenizer_type=byte\n") in text
    assert "train.train_iters" not in text  # allowed changes are not part of a refusal


def test_allowed_changes_are_listed_once(caplog):
    saved = _record(ConfigContainer())
    now = ConfigContainer().apply_overrides(["train.train_iters=400", "scheduler.lr_warmup_iters=7",
                                             "model.hidden_dropout=0.1"])
    with caplog.at_level(logging.INFO):
        compat.check(saved, now.to_dict(), "LOCAL step 10")
    lines = [r.message for r in caplog.records if "changed since the checkpoint" in r.message]
    assert len(lines) == 1
    assert "train.train_iters 200 -> 400" in lines[0] and "scheduler.lr_warmup_iters 20 -> 7" in lines[0]
    assert "model.hidden_dropout 0.0 -> 0.1" in lines[0]


def test_pretrained_start_accepts_padding_but_not_another_vocabulary(tmp_path):
    saved = _record(ConfigContainer())
    padded = ConfigContainer().apply_overrides(["model.make_vocab_size_divisible_by=128",
                                                "distributed.tensor_model_parallel_size=2"])
    compat.check(saved, padded.to_dict(), "/pre/iter_0000010", pretrained=True)  # no error
    other = ConfigContainer().apply_overrides(["tokenizer.tokenizer_type=huggingface",
                                               f"tokenizer.tokenizer_path={_hf(tmp_path, 256)}"])  # 257 ids too
    with pytest.raises(compat.CheckpointMismatchError, match="the pretrained checkpoint /pre/iter_0000010"):
        compat.check(saved, other.to_dict(), "/pre/iter_0000010", pretrained=True)


def test_a_model_field_added_later_is_compared_without_being_listed(monkeypatch):
    # A new architecture field (e.g. from the Llama work) shapes tensors unless declared otherwise.
    saved = _record(ConfigContainer())
    fields = [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(ModelConfig)]
    Extended = dataclasses.make_dataclass("ModelConfig", fields + [("moe_router_topk", int, 8)], kw_only=True)
    Extended.NOT_TENSOR_SHAPING = ModelConfig.NOT_TENSOR_SHAPING
    monkeypatch.setattr(compat, "ModelConfig", Extended)
    cfg = ConfigContainer()
    cfg.model = Extended(**dataclasses.asdict(cfg.model))
    compat.check(saved, cfg.to_dict(), "old")  # the default: what the checkpoint had before the field existed
    cfg.model.moe_router_topk = 2
    with pytest.raises(compat.CheckpointMismatchError, match="model.moe_router_topk: 8 in the checkpoint, 2 now"):
        compat.check(saved, cfg.to_dict(), "old")


def test_unrecorded_checkpoint_is_not_compared(caplog):
    with caplog.at_level(logging.WARNING):
        compat.check({"step": 3}, ConfigContainer().to_dict(), "GLOBAL step 3")
    assert "records no tokenizer or config" in caplog.text
