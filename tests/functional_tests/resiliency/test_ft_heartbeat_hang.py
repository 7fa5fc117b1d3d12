"""nvidia-resiliency-ext fault tolerance on the CPU stack: a hung rank is detected by its rank
monitor (no heartbeat), killed, and the job restarts by itself from LOCAL."""

import json
from pathlib import Path

import pytest

from launcher import run_torchrun

WORKER = Path(__file__).with_name("nodes_worker.py")


@pytest.mark.slow
def test_a_hung_rank_is_detected_by_heartbeats_and_the_job_resumes_from_local(tmp_path):
    run = tmp_path / "run"
    proc = run_torchrun(
        [WORKER, tmp_path, f"logger.run_dir={run}", "train.train_iters=16", "checkpoint.local_save_interval=5",
         f"checkpoint.save={run}/global", f"checkpoint.local_dir={run}/local"],
        launcher="ft_launcher", timeout=300,
        launcher_args=["--max-restarts", "1", "--ft-initial-rank-heartbeat-timeout", "120",
                       "--ft-rank-heartbeat-timeout", "15", "--monitor-interval", "1"],
        env={"TIERSTACK_TEST_HANG_AT": "12", "TIERSTACK_TEST_HANG_RANK": "1", "TIERSTACK_TEST_LAUNCH": "a"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "heartbeats to the nvidia-resiliency-ext rank monitor" in log and "HANGING rank 1 after step 12" in log
    assert "resumed from LOCAL checkpoint at iteration 10" in log and "FINAL step=16 resumed_from=[10]" in log
    assert json.loads((run / "restarts.json").read_text())["restarts"] == 1
