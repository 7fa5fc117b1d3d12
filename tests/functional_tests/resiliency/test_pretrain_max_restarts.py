"""``tierstack pretrain --nproc-per-node 2 --max-restarts 1``: a rank SIGKILLed from outside brings the
job back by itself, from its newest LOCAL checkpoint, and the job finishes."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher import started_launch

REPO = Path(__file__).resolve().parents[3]


def _rank_process(launcher: int, local_rank: str):
    """The rank process with ``LOCAL_RANK=local_rank`` among the launcher's children, or None."""
    for child in psutil.Process(launcher).children(recursive=True):
        try:
            if "tierstack.cli" in " ".join(child.cmdline()) and child.environ().get("LOCAL_RANK") == local_rank:
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.slow
def test_a_rank_killed_from_outside_restarts_the_launch_from_local(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tierstack.cli", "pretrain", "gpt_tiny", "--nproc-per-node", "2",
           "--max-restarts", "1", "dataset.mock=true",
           "train.train_iters=30", "train.eval_interval=null", "mlflow=null", "straggler=null",
           "logger.log_interval=1", f"logger.run_dir={run}", f"checkpoint.save={run}/checkpoints",
           "checkpoint.save_interval=30", "checkpoint.local_save_interval=5", f"checkpoint.local_dir={run}/local"]
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err, started_launch(
            cmd, stdout=out, stderr=err, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}) as proc:
        deadline = time.monotonic() + 240
        while "iter 13/30" not in out_path.read_text() + err_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-4000:]
            time.sleep(0.2)
        victim = _rank_process(proc.pid, "1")
        assert victim is not None
        victim.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=240)
    log = out_path.read_text() + err_path.read_text()
    assert rc == 0, log[-6000:]
    resumed = re.findall(r"resumed from (LOCAL|GLOBAL) checkpoint (?:of step|at iteration) (\d+)", log)
    assert resumed and resumed[0][0] == "LOCAL" and int(resumed[0][1]) in (5, 10), log[-6000:]
    assert "restart 1 of at most 1 (job-wide count" in log
    record = json.loads((run / "restarts.json").read_text())
    assert record["restarts"] == 1 and record["max_restarts"] == 1
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "30"


def test_max_restarts_without_nproc_per_node_is_refused():
    proc = subprocess.run([sys.executable, "-m", "tierstack.cli", "pretrain", "gpt_tiny", "--max-restarts", "2"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert "--max-restarts=2: give a number >= 0, together with --nproc-per-node" in proc.stderr
