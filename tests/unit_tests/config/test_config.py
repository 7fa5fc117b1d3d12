"""ConfigContainer: overrides and validation name the field to change, all problems at once."""

from pathlib import Path

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


def test_a_new_run_dir_takes_the_recipes_checkpoint_directories_with_it_unless_they_are_given():
    from tierstack.recipes import gpt_tiny_config

    cfg = gpt_tiny_config().apply_overrides(["logger.run_dir=runs/pp2"])
    assert (cfg.checkpoint.save, cfg.checkpoint.local_dir) == ("runs/pp2/checkpoints", "runs/pp2/local")
    cfg = gpt_tiny_config().apply_overrides(["checkpoint.local_dir=/local/me", "logger.run_dir=runs/b"])
    assert (cfg.checkpoint.save, cfg.checkpoint.local_dir) == ("runs/b/checkpoints", "/local/me")
    cfg = ConfigContainer().apply_overrides(["checkpoint.save=/shared/ckpt", "logger.run_dir=runs/c"])
    assert cfg.checkpoint.save == "/shared/ckpt"  # outside the old run directory: left as it is
    cfg = gpt_tiny_config().apply_overrides(["train.train_iters=5"])  # no run_dir given: nothing moves
    assert cfg.checkpoint.save == gpt_tiny_config().checkpoint.save


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


def test_every_problem_of_every_section_is_reported_once():
    cfg = ConfigContainer().apply_overrides(["straggler.report_interval=0"])
    cfg.model.num_layers = 0
    cfg.optimizer.lr = -1.0
    cfg.checkpoint.save_retries = 0
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=1)
    assert len(err.value.problems) == 4
    assert [p.split("=")[0].split(" ")[0] for p in err.value.problems] == [
        "model.num_layers", "optimizer.lr", "checkpoint.save_retries", "straggler.report_interval"]


def test_straggler_threshold_zero_is_refused_before_setup():
    """One rule: what validate() accepts, the straggler monitor accepts (a 0 used to pass here)."""
    from tierstack.config import StragglerConfig

    cfg = ConfigContainer(straggler=StragglerConfig(relative_threshold=0.0))
    with pytest.raises(ConfigError, match=r"straggler.relative_threshold=0.0: must be in \(0, 1\]"):
        cfg.validate(world_size=1)
    assert cfg.straggler.problems() == ["straggler.relative_threshold=0.0: must be in (0, 1]"]
    ConfigContainer(straggler=StragglerConfig(relative_threshold=1.0)).validate(world_size=1)


def test_data_path_blend_has_one_parser(tmp_path):
    """An odd-length list with a leading number is refused (validate used to read [1, a, b] as a blend of a)."""
    from tierstack.config.sections import parse_data_path
    from tierstack.data import datasets

    assert datasets.parse_data_path is parse_data_path
    for name in ("a", "b"):
        for ext in (".bin", ".idx"):
            (tmp_path / f"{name}{ext}").write_bytes(b"")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = ConfigContainer()
    cfg.dataset.data_path = [1, a, b]
    with pytest.raises(ConfigError, match="dataset.data_path=.*mixes numbers and prefixes"):
        cfg.validate(world_size=1)
    cfg.dataset.data_path = [1, a, 3, b]
    cfg.validate(world_size=1)
    assert parse_data_path(cfg.dataset.data_path) == ([a, b], [1.0, 3.0])


def test_tokenizer_type_has_one_rule(tmp_path):
    """"hf" is refused by validate() and by the tokenizer builder alike (the builder used to accept it)."""
    from tierstack.data.tokenizers import build_tokenizer

    cfg = ConfigContainer()
    cfg.tokenizer.tokenizer_type = "hf"
    cfg.tokenizer.tokenizer_path = str(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="tokenizer.tokenizer_type='hf': use 'byte' or 'huggingface'") as by_config:
        cfg.validate(world_size=1)
    with pytest.raises(ConfigError) as by_builder:
        build_tokenizer(cfg.tokenizer)
    assert by_builder.value.problems == by_config.value.problems


def test_checkpoint_paths_are_checked_before_any_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    cfg = ConfigContainer()
    cfg.apply_overrides(["checkpoint.local_dir=/proc/nonexistent/sub/local", f"checkpoint.save={blocker}/global"])
    with pytest.raises(ConfigError) as info:
        cfg.validate(1)
    text = str(info.value)
    assert "checkpoint.local_dir=/proc/nonexistent/sub/local: cannot create it under /proc" in text
    assert f"checkpoint.save={blocker}/global: {blocker} is not a directory" in text
    ok = ConfigContainer()
    ok.apply_overrides([f"checkpoint.save={tmp_path}/new/global", f"checkpoint.local_dir={tmp_path}/local"])
    ok.validate(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # validation creates nothing


def test_best_and_nonfinite_fields_are_refused_naming_the_field():
    cfg = ConfigContainer()
    cfg.checkpoint.keep_best_k = -1
    cfg.checkpoint.best_metric = "val_accuracy"
    cfg.checkpoint.on_nonfinite = "ignore"
    cfg.checkpoint.save_on_best = True
    cfg.train.eval_interval = None  # save_on_best without validation
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=1)
    text = str(err.value)
    assert "checkpoint.keep_best_k=-1: must be >= 0" in text
    assert "checkpoint.best_metric='val_accuracy': unknown" in text
    assert "checkpoint.on_nonfinite='ignore'" in text
    assert "checkpoint.save_on_best needs validation: set train.eval_interval" in text
    assert "checkpoint.save_on_best needs checkpoint.keep_best_k >= 1" in text


def test_pretrained_best_needs_the_best_tracker(tmp_path):
    cfg = ConfigContainer()
    cfg.checkpoint.pretrained_checkpoint = f"{tmp_path}:best"
    with pytest.raises(ConfigError, match=r"pretrained_checkpoint=.*:best: no readable best tracker"):
        cfg.validate(world_size=1)
    (tmp_path / "best_checkpointed_iteration.txt").write_text("20\n")
    with pytest.raises(ConfigError, match=r"names step 20 but .*iter_0000020 does not exist"):
        cfg.validate(world_size=1)
    (tmp_path / "iter_0000020").mkdir()
    cfg.validate(world_size=1)


def test_a_load_directory_that_does_not_exist_is_refused_unless_it_is_the_save_directory(tmp_path):
    """``checkpoint.load`` pointing nowhere (a typo, a missing mount) used to start a fresh run
    with only "no checkpoint found"; the save directory itself may not exist yet (a first launch)."""
    cfg = ConfigContainer().apply_overrides([f"checkpoint.save={tmp_path}/run", f"checkpoint.load={tmp_path}/typo"])
    with pytest.raises(ConfigError, match=r"checkpoint.load=.*/typo: does not exist; to start fresh, leave "
                                          r"checkpoint.load unset"):
        cfg.validate(1)
    ConfigContainer().apply_overrides([f"checkpoint.save={tmp_path}/run", f"checkpoint.load={tmp_path}/run/"]).validate(1)
    (tmp_path / "elsewhere").mkdir()
    ConfigContainer().apply_overrides([f"checkpoint.save={tmp_path}/run", f"checkpoint.load={tmp_path}/elsewhere"]).validate(1)


def test_an_lr_below_the_recipes_min_lr_says_to_set_min_lr_too():
    from tierstack.recipes import gpt_tiny_config

    cfg = gpt_tiny_config().apply_overrides(["optimizer.lr=1e-4"])
    with pytest.raises(ConfigError, match=r"optimizer.min_lr=0.0003 is above optimizer.lr=0.0001 .*"
                                          r"set optimizer.min_lr too, e.g. optimizer.min_lr=1e-05"):
        cfg.validate(world_size=2)


def test_a_warmup_that_covers_the_whole_run_is_noted(capsys):
    from tierstack import cli

    cfg = ConfigContainer().apply_overrides(["train.train_iters=10", "scheduler.lr_warmup_iters=10"])
    assert cfg.notes() and "covers the whole run" in cfg.notes()[0]
    assert ConfigContainer().apply_overrides(["train.train_iters=11", "scheduler.lr_warmup_iters=10"]).notes() == []
    assert cli.main(["pretrain", "gpt_tiny", "--dry-run", "--nproc-per-node", "2", "train.train_iters=10",
                     "scheduler.lr_warmup_iters=10"]) == 0
    assert "note: scheduler.lr_warmup_iters=10 covers the whole run" in capsys.readouterr().err


def test_logger_wandb_profile_and_time_budget_fields_are_checked_and_named():
    cfg = ConfigContainer().apply_overrides([
        "train.exit_duration_in_mins=0", "wandb.mode=sometimes", "profile.enabled=true", "profile.step_start=3",
        "profile.step_end=2", "profile.ranks=[0,4]", "logger.tensorboard_dir=null"])
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=2, check_paths=False)
    text = str(err.value)
    for expected in ("train.exit_duration_in_mins=0.0: must be > 0 minutes or null",
                     "wandb.mode='sometimes': use one of ['online', 'offline', 'disabled']",
                     "profile.step_end=2 is before profile.step_start=3",
                     "profile.ranks=[0, 4]: each rank must be < the world size 2"):
        assert expected in text
    assert cfg.logger.tensorboard_path() is None  # null: TensorBoard off
    assert ConfigContainer().apply_overrides(["logger.run_dir=/r"]).logger.tensorboard_path() == Path("/r/tensorboard")
    assert ConfigContainer().apply_overrides(["wandb=null"]).wandb is None
