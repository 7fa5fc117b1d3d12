"""GPT datasets through megatron-core's builder, from a small preprocessed corpus."""

import json
import random

import pytest
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

from tierstack.config.sections import DatasetConfig
from tierstack.data.datasets import build_train_valid_datasets, parse_data_path
from tierstack.data.preprocess import preprocess
from tierstack.data.tokenizers import ByteTokenizer

SEQ = 32


def _corpus(directory, name="corpus", n_docs=200, seed=0):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "ünï", "✓", "def", "return", "\n"]
    lines = [json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(5, 60)))}) for _ in range(n_docs)]
    src = directory / f"{name}.jsonl"
    src.write_text("\n".join(lines) + "\n")
    preprocess([src], directory / name, ByteTokenizer())
    return str(directory / name)


def _build(cfg, seed=1234, train=100, valid=10):
    return build_train_valid_datasets(cfg, ByteTokenizer(), SEQ, train, valid, seed)


def _check_sample(sample):
    # A blend (BlendedDataset) adds which prefix the sample came from.
    assert set(sample) - {"dataset_id"} == {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["tokens"].shape == (SEQ,) and sample["tokens"].dtype == torch.int64
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])  # labels are the next tokens
    assert torch.equal(sample["position_ids"], torch.arange(SEQ))
    assert sample["loss_mask"].dtype == torch.float32 and bool((sample["loss_mask"] == 1).all())
    assert int(sample["tokens"].max()) <= 256


def test_build_from_preprocessed_corpus(tmp_path):
    cfg = DatasetConfig(data_path=[_corpus(tmp_path)], split="90,10,0", cache_dir=str(tmp_path / "cache"))
    train, valid = _build(cfg)
    assert isinstance(train, GPTDataset) and len(train) >= 100 and len(valid) >= 10
    _check_sample(train[0])
    _check_sample(valid[len(valid) - 1])
    assert any((tmp_path / "cache" / "indices").glob("*GPTDataset-train-shuffle_index.npy"))
    # Same seed, same order (second build loads the cached indices); another seed, another order.
    again, _ = _build(cfg)
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(10))
    other, _ = _build(cfg, seed=7)
    assert not all(torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(10))


@pytest.fixture
def gloo_group(tmp_path):
    """A 1-rank gloo process group (file store: no port needed), torn down afterwards."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


def test_one_rank_gloo_group(tmp_path, gloo_group):
    """Under torch.distributed the builder builds on rank 0, then barriers: must work with gloo."""
    cfg = DatasetConfig(data_path=[_corpus(tmp_path)], split="90,10,0", cache_dir=str(tmp_path / "cache"))
    train, valid = _build(cfg)
    _check_sample(train[3])
    assert len(valid) >= 10


def test_weighted_blend(tmp_path, gloo_group):
    a, b = _corpus(tmp_path, "a", seed=1), _corpus(tmp_path, "b", seed=2)
    cfg = DatasetConfig(data_path=[0.3, a, "0.7", b], split="90,10,0", cache_dir=str(tmp_path / "cache"))
    train, valid = _build(cfg)
    assert isinstance(train, BlendedDataset) and len(train) == 100
    _check_sample(train[5])


def test_blend_without_process_group_says_so(tmp_path):
    a, b = _corpus(tmp_path, "a", n_docs=3), _corpus(tmp_path, "b", n_docs=3)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        _build(DatasetConfig(data_path=[a, b], cache_dir=str(tmp_path / "cache")))


def test_mock_reads_no_files(tmp_path):
    cfg = DatasetConfig(mock=True, data_path=["/nonexistent"], cache_dir=str(tmp_path / "cache"))
    train, valid = _build(cfg)
    assert isinstance(train, MockGPTDataset) and len(train) >= 100 and len(valid) >= 10
    assert train[0]["tokens"].shape == (SEQ,)


def test_default_is_the_stdlib_corpus(tmp_path):
    train, valid = _build(DatasetConfig(cache_dir=str(tmp_path)))
    assert len(train) > 10_000 and len(valid) > 100  # ~12 MB of bytes / 32 tokens
    assert any((tmp_path / "corpus").glob("stdlib-byte-*/stdlib.bin"))
    text = ByteTokenizer().detokenize(train[0]["tokens"].tolist())
    assert text.isprintable() or "\n" in text


def test_parse_data_path(tmp_path):
    a, b = _corpus(tmp_path, "a", n_docs=3), _corpus(tmp_path, "b", n_docs=3)
    assert parse_data_path(a) == ([a], None)
    assert parse_data_path([a, b]) == ([a, b], None)
    assert parse_data_path(["1", a, 3, b]) == ([a, b], [1.0, 3.0])
    with pytest.raises(FileNotFoundError, match="dataset.data_path"):
        parse_data_path([str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="dataset.data_path"):
        parse_data_path([])
    with pytest.raises(ValueError, match="> 0"):
        parse_data_path([0, a])
    with pytest.raises(ValueError, match="mixes numbers"):
        parse_data_path([1, a, b])


def test_data_iterator_over_gpt_dataset(tmp_path):
    from tierstack.data.samplers import build_data_iterator

    cfg = DatasetConfig(data_path=[_corpus(tmp_path)], split="90,10,0", cache_dir=str(tmp_path / "cache"))
    train, _ = _build(cfg)
    batch = next(build_data_iterator(train, 8, 4, 1, 2))
    assert batch["tokens"].shape == batch["labels"].shape == (4, SEQ)
    assert torch.equal(batch["tokens"][0], train[8 + 4]["tokens"])  # rank 1's slice of step 1


def test_data_path_the_megatron_way_from_the_command_line(tmp_path, gloo_group):
    """One path or Megatron's "w1 p1 w2 p2" string, as overrides; the blend string builds a real blend."""
    from tierstack.config import ConfigContainer, ConfigError

    a, b = _corpus(tmp_path, "a", seed=1), _corpus(tmp_path, "b", seed=2)
    cfg = ConfigContainer().apply_overrides([f"dataset.data_path={a}", f"dataset.cache_dir={tmp_path / 'cache'}"])
    assert cfg.dataset.data_path == a
    cfg.dataset.validate()
    cfg.apply_overrides([f"dataset.data_path='0.3 {a} 0.7 {b}'", "dataset.split=90,10,0"])
    assert parse_data_path(cfg.dataset.data_path) == ([a, b], [0.3, 0.7])
    train, _ = _build(cfg.dataset)
    assert isinstance(train, BlendedDataset) and len(train) == 100
    cfg.apply_overrides([f"dataset.data_path=[0.3, {a}, 0.7, {b}]"])
    assert parse_data_path(cfg.dataset.data_path) == ([a, b], [0.3, 0.7])
    for wrong in ("{x: 1}", f"[[{a}]]", "true"):
        cfg = ConfigContainer().apply_overrides([f"dataset.data_path={wrong}"])
        with pytest.raises(ConfigError, match=r"dataset.data_path=.*: expected a prefix"):
            cfg.validate(world_size=1)
