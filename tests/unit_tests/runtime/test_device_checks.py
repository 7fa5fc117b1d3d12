"""Device checks at process-group init, and the functional launcher's device choice and timeout."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tierstack.runtime import distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "functional_tests"))
import launcher  # noqa: E402


def test_local_rank_beyond_the_visible_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError) as err:
        distributed.check_device_ordinal(local_rank=1, device_count=1)
    msg = str(err.value)
    assert "LOCAL_RANK=1" in msg and "shows 1" in msg and "--nproc-per-node 1" in msg
    assert "CUDA_VISIBLE_DEVICES=0" in msg
    distributed.check_device_ordinal(local_rank=0, device_count=1)  # its own device: fine


def test_nccl_process_group_is_bound_to_the_rank_device():
    assert distributed.process_group_device("nccl", 3) == {"device_id": torch.device("cuda", 3)}
    assert distributed.process_group_device("cpu:gloo,cuda:nccl", 1) == {"device_id": torch.device("cuda", 1)}
    assert distributed.process_group_device("gloo", 3) == {}


def test_suite_device_defaults_to_cpu_and_hides_gpus(monkeypatch):
    monkeypatch.delenv(launcher.DEVICE_ENV, raising=False)
    assert launcher.device_env(2) == {"CUDA_VISIBLE_DEVICES": ""}


def test_gpu_suite_skips_with_the_reason_when_gpus_are_too_few(monkeypatch):
    monkeypatch.setenv(launcher.DEVICE_ENV, "gpu")
    have = torch.cuda.device_count()
    with pytest.raises(pytest.skip.Exception, match=f"starts {have + 1} ranks, one GPU each, but {have} GPU"):
        launcher.device_env(have + 1)


def test_unknown_suite_device_names_the_variable(monkeypatch):
    monkeypatch.setenv(launcher.DEVICE_ENV, "tpu")
    with pytest.raises(pytest.UsageError, match="TIERSTACK_TEST_DEVICE='tpu': use cpu or gpu"):
        launcher.chosen_device()


def test_timeout_kills_the_whole_process_group(tmp_path):
    """A launch that times out leaves no child behind (a torchrun's ranks are its children)."""
    pid_file = tmp_path / "child.pid"
    script = f"sleep 120 & echo $! > {pid_file}; wait"
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.run_group(["bash", "-c", script], timeout=2)
    _assert_gone_within_5s(int(pid_file.read_text()), "outlived the timed-out launch")


@pytest.mark.parametrize("launcher_ends", ["by timeout", "by itself"])
def test_a_child_in_a_session_of_its_own_does_not_outlive_the_launch(tmp_path, launcher_ends):
    """torchrun starts each rank in a session of its own: killing the launcher's process group
    misses it, and once the launcher is gone it is init's child. Every process that carries the
    launch's id in its environment is killed, after a timeout and after a launch that returned."""
    pid_file = tmp_path / "child.pid"
    script = f"setsid sleep 120 & echo $! > {pid_file}; " + ("wait" if launcher_ends == "by timeout" else "exit 0")
    if launcher_ends == "by timeout":
        with pytest.raises(subprocess.TimeoutExpired):
            launcher.run_group(["bash", "-c", script], timeout=2)
    else:
        assert launcher.run_group(["bash", "-c", script], timeout=30).returncode == 0
    _assert_gone_within_5s(int(pid_file.read_text()), "(own session) outlived the launch")


def _assert_gone_within_5s(child: int, what: str) -> None:
    """Fail (after killing it) when process ``child`` is still alive 5 s from now."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, 9)
    pytest.fail(f"child {child} {what}")
