"""Dataset checks at setup (issue 15): damaged .idx/.bin files and tokens beyond the vocabulary.

Real files written by ``preprocess`` (megatron-core's IndexedDatasetBuilder), then damaged the way
copies and other tools damage them; a real Hugging Face tokenizer trained here (2,000 ids).
"""

import json
import logging
import os
import shutil

import pytest

from tierstack.data import checks
from tierstack.data.preprocess import preprocess
from tierstack.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer

from bpe_tokenizer import TEXT, train_bpe


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT[::-1])
    preprocess([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "data" / "c", ByteTokenizer())
    return str(tmp_path / "data" / "c")


def test_preprocess_writes_a_sidecar_and_the_check_reads_it_without_scanning(corpus, tmp_path):
    meta = json.loads(checks.sidecar_path(corpus).read_text())
    assert meta["tokenizer"]["type"] == "byte" and meta["tokenizer"]["vocab_size"] == 257
    assert meta["max_token_id"] == 256 and meta["num_documents"] == 2
    problems, line = checks.check_prefix(corpus, ByteTokenizer(), str(tmp_path / "cache"))
    assert problems == []
    assert "no scan" in line and "ids 0..256, vocabulary 257" in line
    assert not (tmp_path / "cache").exists()  # nothing scanned, nothing cached


def test_truncated_idx_names_the_file(corpus):
    idx = f"{corpus}.idx"
    data = open(idx, "rb").read()
    for cut in (len(data) - 5, 20, 0):  # cut into the arrays, into the header, empty file
        open(idx, "wb").write(data[:cut])
        problems, _ = checks.check_prefix(corpus, ByteTokenizer())
        assert len(problems) == 1 and problems[0].startswith(f"{idx}: ")
        assert "re-run `tierstack preprocess`" in problems[0]


def test_bin_shorter_or_longer_than_its_index_names_the_bin(corpus):
    bin_path = f"{corpus}.bin"
    size = os.path.getsize(bin_path)
    os.truncate(bin_path, size - 10)
    problems, _ = checks.check_prefix(corpus, ByteTokenizer())
    assert len(problems) == 1 and problems[0].startswith(f"{bin_path}: {size - 10} bytes")
    assert f"= {size} bytes (a short" in problems[0]
    with open(bin_path, "ab") as f:
        f.write(b"\0" * 20)
    assert "(a long" in checks.check_prefix(corpus, ByteTokenizer())[0][0]


def test_data_of_another_tokenizer_is_refused_with_and_without_sidecar(tmp_path, caplog):
    hf = train_bpe(tmp_path / "tokenizer.json")
    assert hf.vocab_size == 2000
    (tmp_path / "a.txt").write_text(TEXT * 5)
    prefix = str(tmp_path / "hfdata")
    stats = preprocess([tmp_path / "a.txt"], prefix, hf)
    assert stats.max_token_id >= 257  # merges beyond the byte range exist in this text
    problems, _ = checks.check_prefix(prefix, ByteTokenizer(), str(tmp_path / "cache"))
    assert any("were tokenized with the Hugging Face tokenizer" in p and "byte tokenizer (vocabulary 257)" in p
               for p in problems)
    assert any(p.startswith(f"{prefix}.bin: token ids 0..{stats.max_token_id}, outside the vocabulary 0..256")
               for p in problems)
    # The same files without a sidecar (another tool made them): scanned once, then from the cache.
    checks.sidecar_path(prefix).unlink()
    caplog.set_level(logging.INFO)
    problems, line = checks.check_prefix(prefix, ByteTokenizer(), str(tmp_path / "cache"))
    assert problems == [p for p in problems if "outside the vocabulary 0..256" in p] and len(problems) == 1
    cached = list((tmp_path / "cache" / "token_stats").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["max_token_id"] == stats.max_token_id
    problems2, line2 = checks.check_prefix(prefix, ByteTokenizer(), str(tmp_path / "cache"))
    assert problems2 == problems and "scan cache" in line2 and "scanned" in line
    # With the right tokenizer the same files pass.
    assert checks.check_prefix(prefix, hf, str(tmp_path / "cache"))[0] == []


def test_token_dtype_too_small_for_the_vocabulary(corpus, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["</s>"] = 70_000
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.save(str(tmp_path / "big.json"))
    problems, _ = checks.check_prefix(corpus, HuggingFaceTokenizer(tmp_path / "big.json"))
    assert any(p.startswith(f"{corpus}.bin: token ids are uint16, which cannot hold") for p in problems)


def test_stale_sidecar_is_ignored_and_the_tokens_scanned(corpus, tmp_path):
    shutil.copy(f"{corpus}.meta.json", tmp_path / "keep.json")
    other = tmp_path / "o.txt"
    other.write_text("short")
    preprocess([other], corpus, ByteTokenizer())  # rebuilt: a new sidecar
    shutil.copy(tmp_path / "keep.json", f"{corpus}.meta.json")  # ... and the old one put back by hand
    problems, line = checks.check_prefix(corpus, ByteTokenizer(), None)
    assert problems == [] and "scanned" in line


def test_check_datasets_raises_one_error_listing_every_file(corpus, tmp_path):
    (tmp_path / "x.txt").write_text(TEXT)
    second = str(tmp_path / "second")
    preprocess([tmp_path / "x.txt"], second, ByteTokenizer())
    os.truncate(f"{second}.bin", 3)
    open(f"{corpus}.idx", "r+b").truncate(40)
    with pytest.raises(checks.DataFileError) as err:
        checks.check_datasets([corpus, second], ByteTokenizer(), None)
    assert len(err.value.problems) == 2
    assert f"{corpus}.idx" in str(err.value) and f"{second}.bin" in str(err.value)


def test_a_bin_rewritten_in_place_after_its_sidecar_is_scanned_not_trusted(corpus, tmp_path, caplog):
    """Found by the break-it pass: the sidecar was trusted when the token count still matched, so a
    .bin rewritten in place with out-of-vocabulary ids (same size) passed the check and trained
    silently (at TP=2 as zero embeddings). The sidecar now records each file's size and mtime."""
    import numpy as np

    meta = json.loads(checks.sidecar_path(corpus).read_text())
    data = np.fromfile(f"{corpus}.bin", dtype=meta["dtype"])
    data[len(data) // 2] = 300  # beyond the byte vocabulary (257), same size, same token count
    time_before = os.stat(f"{corpus}.bin").st_mtime_ns
    data.tofile(f"{corpus}.bin")
    os.utime(f"{corpus}.bin", ns=(time_before + 10**9, time_before + 10**9))  # a later write, whatever the clock
    with caplog.at_level(logging.WARNING):
        problems, line = checks.check_prefix(corpus, ByteTokenizer(), None)
    assert "scanned" in line and "no scan" not in line
    assert any("outside the vocabulary 0..256" in p and f"{corpus}.bin" in p for p in problems), problems
    assert "changed after" in caplog.text and f"{corpus}.meta.json" in caplog.text
