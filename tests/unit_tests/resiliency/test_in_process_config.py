"""``resiliency.*``: in-process restart is refused before any work when it cannot work, with one
error naming the field; its defaults leave every run as it was."""

import os

import pytest

from tierstack.config import ConfigContainer, ConfigError
from tierstack.resiliency import in_process


def _config(*overrides):
    return ConfigContainer().apply_overrides(["train.micro_batch_size=2", "train.global_batch_size=4", *overrides])


def test_the_default_is_the_launchers_restart():
    cfg = ConfigContainer()
    assert cfg.resiliency.restart == "launcher" and not cfg.resiliency.in_process
    cfg.validate(1, check_paths=False)


def test_in_process_without_a_heartbeat_timeout_is_refused_naming_the_field():
    cfg = _config("resiliency.restart=in-process", "resiliency.spare_ranks=1")
    with pytest.raises(ConfigError) as err:
        in_process.check(cfg, 3, environ={})
    assert len(err.value.problems) == 1
    assert "resiliency.heartbeat_timeout_s is not set" in str(err.value)


def test_in_process_with_no_spare_and_no_launcher_restart_is_refused_naming_the_field():
    cfg = _config("resiliency.restart=in-process", "resiliency.heartbeat_timeout_s=3")
    with pytest.raises(ConfigError) as err:
        in_process.check(cfg, 2, environ={"TORCHELASTIC_MAX_RESTARTS": "0"})
    assert len(err.value.problems) == 1
    assert "resiliency.spare_ranks=0 with a launcher that cannot replace a process" in str(err.value)
    in_process.check(cfg, 2, environ={"TORCHELASTIC_MAX_RESTARTS": "2"})  # torchrun replaces it: allowed
    in_process.check(_config("resiliency.restart=in-process", "resiliency.heartbeat_timeout_s=3",
                             "resiliency.spare_ranks=1"), 3, environ={})  # a spare replaces it: allowed


@pytest.mark.parametrize("override,field", [
    ("resiliency.restart=sometimes", "resiliency.restart"),
    ("resiliency.heartbeat_timeout_s=0", "resiliency.heartbeat_timeout_s"),
    ("resiliency.spare_ranks=-1", "resiliency.spare_ranks"),
    ("resiliency.max_in_process_restarts=-1", "resiliency.max_in_process_restarts"),
])
def test_bad_values_name_their_field(override, field):
    with pytest.raises(ConfigError) as err:
        _config(override).validate(1, check_paths=False)
    assert field in str(err.value)


def test_spares_without_in_process_restart_or_as_many_as_the_processes_are_refused():
    with pytest.raises(ConfigError, match="resiliency.spare_ranks=1 needs resiliency.restart=in-process"):
        _config("resiliency.spare_ranks=1").validate(1, check_paths=False)
    cfg = _config("resiliency.restart=in-process", "resiliency.heartbeat_timeout_s=3", "resiliency.spare_ranks=2")
    with pytest.raises(ConfigError, match="resiliency.spare_ranks=2: must be < the 2 processes"):
        in_process.check(cfg, 2, environ={})


def test_the_refusal_comes_before_any_store_or_fork(monkeypatch):
    """``run`` raises before it touches the store (no MASTER_PORT here: reaching it would fail otherwise)."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    pid = os.getpid()
    with pytest.raises(ConfigError, match="resiliency.heartbeat_timeout_s"):
        in_process.run(_config("resiliency.restart=in-process", "resiliency.spare_ranks=1"), lambda cfg: None)
    assert os.getpid() == pid


def test_memory_steps_without_in_process_restart_or_a_local_dir_are_refused_naming_the_field(tmp_path):
    """A memory step lives in its process: only an in-process restart resumes from it, and it is a
    step of the LOCAL tier."""
    local = f"checkpoint.local_dir={tmp_path}"
    with pytest.raises(ConfigError) as err:
        _config(local, "checkpoint.memory_save_interval=1").validate(1, check_paths=False)
    assert len(err.value.problems) == 1
    assert "checkpoint.memory_save_interval=1 needs resiliency.restart=in-process" in str(err.value)
    in_process_ok = ["resiliency.restart=in-process", "resiliency.heartbeat_timeout_s=3", "resiliency.spare_ranks=1"]
    for bad, says in ((["checkpoint.memory_save_interval=1"], "=1 needs checkpoint.local_dir"),
                      ([local, "checkpoint.memory_save_interval=0"], "=0: must be >= 1 iterations"),
                      ([local, "checkpoint.local_save_interval=5", "checkpoint.memory_save_interval=10"],
                       "=10 is a multiple of checkpoint.local_save_interval=5: every memory step falls on")):
        with pytest.raises(ConfigError) as err:
            in_process.check(_config(*in_process_ok, *bad), 3, environ={})
        assert len(err.value.problems) == 1
        assert f"checkpoint.memory_save_interval{says}" in str(err.value)
    in_process.check(_config(*in_process_ok, local, "checkpoint.memory_save_interval=1"), 3, environ={})
