"""The config made visible: ``--help`` per recipe, ``--print-config`` YAML and ``--config-file``."""

import dataclasses

import pytest

from tierstack import cli
from tierstack.config import CheckpointConfig, ConfigContainer, ConfigError
from tierstack.config.describe import describe, field_docs, load_yaml, to_yaml
from tierstack.config.sections import SECTION_TYPES
from tierstack.recipes import RECIPES, gpt_tiny_config, llama_tiny_config


def test_field_docs_come_from_the_comment_beside_or_above_the_field():
    docs = field_docs(CheckpointConfig)
    assert docs["save"].startswith("GLOBAL checkpoint directory")  # on the field's line
    assert docs["local_dir"].startswith("LOCAL checkpoint root")  # the line above
    assert "Young/Daly" in docs["save_interval"]  # several lines above, joined


def test_recipe_help_lists_every_field_with_its_value(capsys):
    assert cli.main(["pretrain", "llama_tiny", "model.num_layers=6", "--help"]) == 0
    out = capsys.readouterr().out
    for name, typ in SECTION_TYPES.items():
        for f in dataclasses.fields(typ):
            assert f"  {name}.{f.name}=" in out, f"{name}.{f.name} missing from --help"
    assert "model.num_layers=6   # transformer layers" in out  # the value after the override
    assert "model.normalization=RMSNorm" in out  # the recipe's value
    assert "--print-config" in out and "--config-file" in out and "--dry-run" in out


def test_pretrain_help_lists_every_recipe(capsys):
    assert cli.main(["pretrain", "--help"]) == 0
    out = capsys.readouterr().out
    for name in RECIPES:
        assert f"  {name} " in out
    assert "RECIPE --help" in out


def test_yaml_round_trip_is_exact_from_another_recipe(tmp_path):
    cfg = llama_tiny_config().apply_overrides(["optimizer.lr=0.1", "optimizer.min_lr=0.01", "mlflow=null",
                                               "dataset.data_path=[0.3, /a, 0.7, /b]"])
    file = tmp_path / "run.yaml"
    file.write_text(to_yaml(cfg))
    back = gpt_tiny_config().apply_mapping(load_yaml(str(file)))  # a base with other values everywhere
    assert back == cfg
    assert back.optimizer.min_lr == 0.01 and back.mlflow is None


def test_config_file_problems_name_the_file_and_field(tmp_path):
    file = tmp_path / "bad.yaml"
    file.write_text("model:\n  num_layers: four\n  tensor_model_parallel_size: 2\ntrain: null\nvalidation: {eval_iters: 2}\n")
    with pytest.raises(ConfigError) as err:
        ConfigContainer().apply_mapping(load_yaml(str(file)), origin=f"--config-file {file}")
    text = str(err.value)
    assert f"--config-file {file}: model.num_layers: bad value for model.num_layers" in text
    assert "did you mean `distributed.tensor_model_parallel_size`" in text
    assert "section train cannot be off" in text
    assert "did you mean `train.eval_iters`" in text
    file.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected sections of fields"):
        load_yaml(str(file))
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(str(tmp_path / "none.yaml"))


def test_overrides_apply_on_top_of_the_config_file(tmp_path, capsys):
    file = tmp_path / "run.yaml"
    file.write_text(to_yaml(gpt_tiny_config().apply_overrides(["train.train_iters=9"])))
    assert cli.main(["pretrain", "gpt_small", "--config-file", str(file), "model.num_layers=2", "--print-config"]) == 0
    printed = ConfigContainer().apply_mapping(load_yaml_text(capsys.readouterr().out, tmp_path))
    assert printed.train.train_iters == 9 and printed.model.num_layers == 2
    assert printed.model.hidden_size == gpt_tiny_config().model.hidden_size  # the file's, not gpt_small's


def load_yaml_text(text, tmp_path):
    out = tmp_path / "printed.yaml"
    out.write_text(text)
    return load_yaml(str(out))


def test_dry_run_validates_for_the_ranks_and_builds_nothing(tmp_path, capsys, caplog):
    run_dir = tmp_path / "run"
    assert cli.main(["pretrain", "gpt_tiny", "--dry-run", "--nproc-per-node", "2", f"logger.run_dir={run_dir}"]) == 0
    assert "valid for 2 rank(s)" in capsys.readouterr().out
    assert cli.main(["pretrain", "gpt_tiny", "--dry-run", f"logger.run_dir={run_dir}"]) == 2  # TP=2 on 1 rank
    assert "world size 1 is not divisible" in caplog.text
    assert not run_dir.exists()


def test_dry_run_reports_the_launchers_restart_rule_with_every_other_problem(tmp_path, caplog):
    """A launch that cannot replace a dead process (in-process restart, no spare, no launcher
    restart) is reported together with the config's own problems, not instead of them (a new
    user fixed one and met the next); the hint names both launchers' ``--max-restarts``."""
    assert cli.main(["pretrain", "gpt_tiny", "--dry-run", "--nproc-per-node", "2", "--restart", "in-process",
                     "model.num_layers=3", "distributed.pipeline_model_parallel_size=2",
                     "distributed.tensor_model_parallel_size=1", f"logger.run_dir={tmp_path / 'run'}"]) == 2
    text = caplog.text
    assert "resiliency.spare_ranks=0 with a launcher that cannot replace a process" in text
    assert "tierstack's own launcher" in text
    assert "resiliency.heartbeat_timeout_s" in text  # in-process restart needs it: reported alongside
    assert "num_layers" in text  # 3 layers on 2 pipeline stages
