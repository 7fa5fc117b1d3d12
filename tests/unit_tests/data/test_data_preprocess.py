"""Preprocessing to Megatron indexed datasets, and the cached standard-library corpus."""

import json
import os
import threading

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from tierstack.data import preprocess as pp
from tierstack.data.tokenizers import ByteTokenizer


class ListTokenizer:
    """A tokenizer without the array fast path and a vocabulary too big for uint16."""

    vocab_size = 70_000
    eod = 69_999
    unique_identifiers = {"class": "ListTokenizer"}
    name = "list"

    def tokenize(self, text):
        return [ord(c) % 69_000 for c in text]


def _write_inputs(tmp_path):
    docs = ["first doc\n", "", "héllo wörld ✓ 🚀 日本語", "jsonl one", "jsonl two\nwith newline"]
    (tmp_path / "a.txt").write_text(docs[0], encoding="utf-8")
    (tmp_path / "empty.txt").write_text(docs[1], encoding="utf-8")
    (tmp_path / "b.py").write_text(docs[2], encoding="utf-8")
    lines = [json.dumps({"text": docs[3], "id": 1}), "   ", json.dumps({"text": docs[4]}, ensure_ascii=False)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    files = [tmp_path / n for n in ("a.txt", "empty.txt", "b.py", "c.jsonl")]
    return files, docs


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), ListTokenizer()], ids=["byte", "list"])
def test_preprocess_round_trip(tmp_path, tokenizer):
    files, docs = _write_inputs(tmp_path)
    stats = pp.preprocess(files, tmp_path / "out" / "corpus", tokenizer)
    ds = IndexedDataset(str(tmp_path / "out" / "corpus"))
    expected = [tokenizer.tokenize(d) + [tokenizer.eod] for d in docs]
    assert len(ds) == len(docs) == stats.num_documents
    for i, exp in enumerate(expected):
        assert ds[i].tolist() == exp
    assert stats.num_tokens == sum(map(len, expected))
    assert ds.index.dtype == (np.uint16 if tokenizer.vocab_size < 65500 else np.int32)
    assert stats.dtype == np.dtype(ds.index.dtype).name
    assert list(ds.document_indices) == list(range(len(docs) + 1))


def test_preprocess_without_eod_skips_empty(tmp_path):
    files, docs = _write_inputs(tmp_path)
    stats = pp.preprocess(files, tmp_path / "noeod", ByteTokenizer(), append_eod=False)
    ds = IndexedDataset(str(tmp_path / "noeod"))
    assert stats.num_skipped_empty == 1 and len(ds) == len(docs) - 1
    assert ds[1].tolist() == list(docs[2].encode())


@pytest.mark.parametrize(
    "bad_line, message",
    [(json.dumps({"txt": "x"}), 'c.jsonl:3: the record has no "text"'),
     ("{not json", "c.jsonl:3: not a valid JSON"),
     (json.dumps({"text": 5}), 'c.jsonl:3: the record has no "text"'),
     (json.dumps(["text"]), 'c.jsonl:3: the record has no "text"')],
)
def test_bad_jsonl_line_names_line_and_leaves_nothing(tmp_path, bad_line, message):
    good = json.dumps({"text": "ok"})
    (tmp_path / "c.jsonl").write_text("\n".join([good, good, bad_line, good]) + "\n")
    (tmp_path / "a.txt").write_text("before")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        pp.preprocess([tmp_path / "a.txt", tmp_path / "c.jsonl"], out / "ds", ByteTokenizer())
    assert list(out.iterdir()) == []  # no .bin, .idx or temporary file left


def test_preprocess_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        pp.preprocess([], tmp_path / "x", ByteTokenizer())
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        pp.preprocess([tmp_path / "missing.txt"], tmp_path / "x", ByteTokenizer())


def test_stdlib_corpus_files():
    files = pp.stdlib_corpus_files()
    assert files == sorted(files) and len(files) > 100
    assert sum(f.stat().st_size for f in files) > 5_000_000
    for f in files:
        assert f.suffix == ".py"
        assert not {"site-packages", "test", "tests"}.intersection(f.parts)


def test_ensure_stdlib_corpus_builds_once(tmp_path):
    tok = ByteTokenizer()
    prefix = pp.ensure_stdlib_corpus(tmp_path, tok)
    ds = IndexedDataset(prefix)
    files = pp.stdlib_corpus_files()
    assert len(ds) == len(files)
    assert ds[0].tolist() == tok.tokenize(files[0].read_bytes().decode("utf-8", "replace")) + [tok.eod]
    mtime = os.stat(prefix + ".bin").st_mtime_ns
    assert pp.ensure_stdlib_corpus(tmp_path, tok) == prefix  # cache hit: nothing rebuilt
    assert os.stat(prefix + ".bin").st_mtime_ns == mtime


def test_ensure_stdlib_corpus_concurrent_and_stale(tmp_path, monkeypatch):
    small = pp.stdlib_corpus_files()[:20]
    monkeypatch.setattr(pp, "stdlib_corpus_files", lambda: small)
    results, errors = [], []

    def call():
        try:
            results.append(pp.ensure_stdlib_corpus(tmp_path, ByteTokenizer()))
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    prefix = results[0]
    assert len(IndexedDataset(prefix)) == 20
    assert [p.name for p in (tmp_path / "corpus").iterdir() if p.name.startswith(".")] == []
    # A damaged copy (stamp lost) is rebuilt.
    (tmp_path / "corpus").joinpath(prefix.split("/")[-2], pp.STAMP_NAME).unlink()
    assert pp.ensure_stdlib_corpus(tmp_path, ByteTokenizer()) == prefix
    assert len(IndexedDataset(prefix)) == 20
