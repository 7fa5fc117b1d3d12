"""ConfigContainer: overrides and validation name the field to change, all problems at once."""

import pytest

from tierstack.config import ConfigContainer, ConfigError


def test_overrides_set_typed_values_and_toggle_optional_sections():
    cfg = ConfigContainer().apply_overrides(
        ["model.num_layers=6", "optimizer.lr=1e-4", "straggler.report_interval=5", "checkpoint.save=/tmp/x"]
    )
    assert cfg.model.num_layers == 6 and isinstance(cfg.model.num_layers, int)
    assert cfg.optimizer.lr == pytest.approx(1e-4)
    assert cfg.straggler is not None and cfg.straggler.report_interval == 5
    assert cfg.checkpoint.save == "/tmp/x"
    cfg.apply_overrides(["straggler=null"])
    assert cfg.straggler is None


def test_unknown_keys_and_bad_values_are_all_reported_with_their_names():
    with pytest.raises(ConfigError) as err:
        ConfigContainer().apply_overrides(["model.nm_layers=3", "train.train_iters=abc", "bogus.x=1", "noequals"])
    text = str(err.value)
    assert len(err.value.problems) == 4
    assert "model.nm_layers" in text and "num_layers" in text  # lists the known fields
    assert "train.train_iters" in text
    assert "unknown section 'bogus'" in text
    assert "noequals" in text


def test_validate_names_each_parallelism_problem():
    cfg = ConfigContainer()
    cfg.model.num_attention_heads = 6
    cfg.model.hidden_size = 252
    cfg.model.num_layers = 3
    cfg.distributed.tensor_model_parallel_size = 4
    cfg.distributed.pipeline_model_parallel_size = 2
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=8)
    text = str(err.value)
    assert "model.num_attention_heads=6 is not divisible by distributed.tensor_model_parallel_size=4" in text
    assert "model.num_layers=3 is not divisible by distributed.pipeline_model_parallel_size=2" in text


def test_validate_world_size_and_global_batch():
    cfg = ConfigContainer()
    cfg.distributed.tensor_model_parallel_size = 2
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        cfg.validate(world_size=3)
    cfg.distributed.tensor_model_parallel_size = 1
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 12
    with pytest.raises(ConfigError, match=r"train.global_batch_size=12 is not divisible by train.micro_batch_size \* data_parallel_size = 4 \* 2"):
        cfg.validate(world_size=2)
    cfg.train.global_batch_size = 16
    cfg.validate(world_size=2)


def test_missing_data_path_names_the_file(tmp_path):
    cfg = ConfigContainer()
    cfg.dataset.data_path = [str(tmp_path / "corpus")]
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=1)
    assert f"{tmp_path / 'corpus'}.bin not found" in str(err.value)
    assert "tierstack preprocess" in str(err.value)
    (tmp_path / "corpus.bin").write_bytes(b"")
    (tmp_path / "corpus.idx").write_bytes(b"")
    cfg.validate(world_size=1)


def test_checkpoint_fields_are_checked():
    cfg = ConfigContainer()
    cfg.checkpoint.save_interval = 10  # but no save dir
    cfg.checkpoint.local_save_interval = 5  # but no local dir
    cfg.checkpoint.most_recent_k = 0
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=1)
    text = str(err.value)
    assert "checkpoint.save_interval is set but checkpoint.save" in text
    assert "checkpoint.local_save_interval is set but checkpoint.local_dir" in text
    assert "checkpoint.most_recent_k" in text


def test_dict_round_trip_keeps_every_section():
    cfg = ConfigContainer().apply_overrides(["mlflow.run_name=abc", "train.train_iters=7"])
    again = ConfigContainer.from_dict(cfg.to_dict())
    assert again == cfg
    assert cfg.flat_params()["train.train_iters"] == 7
    with pytest.raises(ConfigError, match="unknown field"):
        ConfigContainer.from_dict({"train": {"iters": 3}})
