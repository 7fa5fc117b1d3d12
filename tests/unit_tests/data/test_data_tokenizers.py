"""Tokenizers: byte round trips, the Hugging Face loader, and the factory's errors."""

import json
import sys

import pytest

from tierstack.config.sections import TokenizerConfig
from tierstack.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer, build_tokenizer

TEXTS = ["", "hello world\n", "héllo wörld ✓ 🚀 日本語 — ünïcödé", "\x00\tctrl\r\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.tokenize_array(text).tolist() == ids
    assert tok.detokenize(ids) == text
    assert tok.detokenize(ids + [tok.eod]) == text  # the end id is dropped


def test_byte_properties_and_errors():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod) == (257, 256)
    json.dumps(tok.unique_identifiers)  # megatron hashes it into cache names
    assert tok.detokenize([0xFF, 0x41]) == "\ufffdA"  # invalid UTF-8 is replaced, not raised
    with pytest.raises(ValueError, match="0..256"):
        tok.detokenize([257])


def test_build_tokenizer_errors():
    assert isinstance(build_tokenizer(TokenizerConfig()), ByteTokenizer)
    with pytest.raises(ValueError, match="tokenizer.tokenizer_type"):
        build_tokenizer(TokenizerConfig(tokenizer_type="sentencepiece"))
    with pytest.raises(ValueError, match="tokenizer.tokenizer_path"):
        build_tokenizer(TokenizerConfig(tokenizer_type="huggingface"))


def _write_word_level(path, specials):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "ünï", *specials])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tok.save(str(path))
    return vocab


def test_huggingface_tokenizer(tmp_path):
    vocab = _write_word_level(tmp_path / "tokenizer.json", ["</s>"])
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="huggingface", tokenizer_path=str(tmp_path)))
    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.eod == vocab["</s>"] and tok.vocab_size == len(vocab)
    ids = tok.tokenize("hello ünï world")
    assert ids == [vocab["hello"], vocab["ünï"], vocab["world"]]
    assert tok.detokenize(ids) == "hello ünï world"
    json.dumps(tok.unique_identifiers)


def test_huggingface_without_end_token_names_the_field(tmp_path):
    from tierstack.errors import BadInputError

    _write_word_level(tmp_path / "tokenizer.json", [])
    with pytest.raises(BadInputError, match="tokenizer.tokenizer_path"):  # refused like bad input: one line, exit 2
        HuggingFaceTokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.tokenizer_path"):
        HuggingFaceTokenizer(tmp_path / "missing.json")


def test_huggingface_missing_package_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        HuggingFaceTokenizer(tmp_path)
