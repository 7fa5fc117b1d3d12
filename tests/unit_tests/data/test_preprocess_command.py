"""``tierstack preprocess`` with Megatron-LM's flags (tools/preprocess_data.py): ``--json-keys``,
``--workers``, ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model``, ``--append-eod``; and the
commands print none of megatron-core's notices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from bpe_tokenizer import train_bpe
from tierstack.data.tokenizers import ByteTokenizer

REPO = Path(__file__).resolve().parents[3]
# what megatron-core (and torch's distributed checkpoint under it) printed in these commands before
MEGATRON_NOTICES = ("Megatron-FSDP", "DistributedDataParallel", "OptimizerConfig", "Params for bucket",
                    "decay style", "Number of buckets", "Transformer Engine", "Apex", "Could not determine rank",
                    "torch.distributed is disabled", "argument order", "Warning", "warnings.warn")


def _tierstack(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tierstack.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def _assert_quiet(proc):
    noise = [line for line in proc.stderr.splitlines() if any(n in line for n in MEGATRON_NOTICES)]
    assert not noise, proc.stderr


def _records(n):
    return [{"title": f"title {i}", "text": f"body {i} " * (i % 7 + 1), "id": i} for i in range(n)]


def test_two_json_keys_write_one_dataset_per_key_with_the_right_documents(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(r) + "\n" for r in _records(5)))
    proc = _tierstack("preprocess", "--input", docs, "--json-keys", "text", "title", "--output-prefix",
                      tmp_path / "out", "--tokenizer-type", "byte", "--append-eod", "--workers", 1)
    assert proc.returncode == 0, proc.stderr
    _assert_quiet(proc)
    tok = ByteTokenizer()
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / f"out_{key}_document"))  # Megatron-LM's names, one per key
        assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(r[key]) + [tok.eod] for r in _records(5)]
        assert (tmp_path / f"out_{key}_document.meta.json").is_file()
        assert f"wrote {tmp_path}/out_{key}_document.bin" in proc.stdout
    assert not (tmp_path / "out.bin").exists()


def test_a_record_without_one_of_the_keys_is_refused_naming_its_line_and_key(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "a", "title": "b"}) + "\n" + json.dumps({"text": "c"}) + "\n")
    proc = _tierstack("preprocess", "--input", docs, "--json-keys", "text", "title", "--output-prefix", tmp_path / "o")
    assert proc.returncode == 2
    assert f'{docs}:2: the record has no "title" string (--json-keys)' in proc.stderr
    assert not list(tmp_path.glob("o*"))


def test_one_json_key_other_than_text_writes_the_prefix_itself(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(r) + "\n" for r in _records(3)))
    proc = _tierstack("preprocess", "--input", docs, "--json-keys", "title", "--output-prefix", tmp_path / "t")
    assert proc.returncode == 0, proc.stderr
    ds = IndexedDataset(str(tmp_path / "t"))
    assert ds[2].tolist() == ByteTokenizer().tokenize("title 2") + [ByteTokenizer().eod]


@pytest.mark.parametrize("tokenizer", ["byte", "HuggingFaceTokenizer"])
def test_two_workers_write_the_same_bytes_as_one(tmp_path, tokenizer):
    """More records than a worker's chunk (64), so the two workers interleave; a Hugging Face
    tokenizer travels to the workers too (under Megatron-LM's type name and --tokenizer-model)."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(r) + "\n" for r in _records(300)))
    extra = []
    if tokenizer != "byte":
        train_bpe(tmp_path / "tokenizer.json")
        extra = ["--tokenizer-model", tmp_path / "tokenizer.json"]
    for n in (1, 2):
        proc = _tierstack("preprocess", "--input", docs, docs, "--output-prefix", tmp_path / f"w{n}",
                          "--tokenizer-type", tokenizer, *extra, "--workers", n)
        assert proc.returncode == 0, proc.stderr
        _assert_quiet(proc)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes()
    one, two = (json.loads((tmp_path / f"w{n}.meta.json").read_text()) for n in (1, 2))
    assert one["num_documents"] == two["num_documents"] == 600 and one["tokenizer"] == two["tokenizer"]


def test_megatron_tokenizer_and_flag_names_that_tierstack_lacks_are_refused_by_name(tmp_path):
    docs = tmp_path / "d.jsonl"
    docs.write_text(json.dumps({"text": "x"}) + "\n")
    proc = _tierstack("preprocess", "--input", docs, "--output-prefix", tmp_path / "o", "--tokenizer-type",
                      "GPT2BPETokenizer")
    assert proc.returncode == 2
    assert "--tokenizer-type GPT2BPETokenizer: Megatron-LM's tokenizer, which tierstack does not have; use " \
           "--tokenizer-type HuggingFaceTokenizer --tokenizer-model" in proc.stderr
    proc = _tierstack("preprocess", "--input", docs, "--output-prefix", tmp_path / "o", "--split-sentences")
    assert proc.returncode == 2
    assert "--split-sentences: a flag of Megatron-LM's preprocess_data.py that tierstack preprocess does not offer" \
        in proc.stderr
    proc = _tierstack("preprocess", "--input", docs, "--output-prefix", tmp_path / "o", "--workers", 0)
    assert proc.returncode == 2 and "--workers=0: give a number >= 1" in proc.stderr


def test_convert_and_generate_print_no_megatron_notices(tmp_path):
    """``convert import`` used to dump megatron-core's DDP and optimizer configs and its bucket
    layout; ``convert export`` and ``generate`` printed torch's one-process notices."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "tests" / "unit_tests" / "hf"))
    from tiny_hf import save_model

    save_model("llama", tmp_path / "hf")
    proc = _tierstack("convert", "import", "--hf-path", tmp_path / "hf", "--save", tmp_path / "imp")
    assert proc.returncode == 0, proc.stderr
    _assert_quiet(proc)
    assert "Loading weights" not in proc.stderr and len(proc.stderr.splitlines()) <= 4, proc.stderr
    proc = _tierstack("convert", "export", "--load", tmp_path / "imp", "--hf-path", tmp_path / "exp")
    assert proc.returncode == 0, proc.stderr
    _assert_quiet(proc)
    assert "Writing model shards" not in proc.stderr and len(proc.stderr.splitlines()) <= 3, proc.stderr
    proc = _tierstack("generate", "--load", tmp_path / "imp", "--prompt", "w1 w2", "--max-new-tokens", 2)
    assert proc.returncode == 0, proc.stderr
    _assert_quiet(proc)
    assert len(proc.stderr.splitlines()) <= 3, proc.stderr
