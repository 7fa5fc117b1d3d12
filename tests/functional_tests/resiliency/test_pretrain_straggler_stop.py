"""End to end through pretrain(): a slow rank is named, a GLOBAL checkpoint is saved, the rerun resumes.

Two CPU ranks, TP=1 PP=1 DP=2. Rank 1 sleeps in its forward step. On a CPU only section timing
scores ranks, and a section that spans the gradient all-reduce takes the same wall time on both
ranks; the forward step does not, which is why train() must time it
(``StragglerMonitor.wrap_forward_step``).
"""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("pretrain_worker.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run_pretrain(run_root, slow_rank, sleep_s, *overrides):
    proc = subprocess.run(
        [str(TORCHRUN), "--nproc-per-node", "2", str(WORKER), str(run_root), str(slow_rank), str(sleep_s), *overrides],
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return log


@pytest.mark.slow
def test_straggler_stop_saves_global_then_rerun_resumes(tmp_path):
    node = socket.gethostname()
    log = run_pretrain(
        tmp_path, 1, 0.3, "straggler.report_interval=4", "straggler.stop_if_detected=true", "mlflow=null"
    )
    assert f"STRAGGLERS: rank 1 on {node} -> stopping" in log
    assert re.search(r"GLOBAL checkpoint of step 4 published", log)
    # every rank exits with the same message naming the straggler
    assert f"[rank 1] WARNING tierstack.training.train: stopping at iteration 4: straggler detected on rank(s) 1 ({node})" in log
    assert "FINAL step=4" in log
    assert (tmp_path / "e2e" / "checkpoints" / "iter_0000004").is_dir()

    # the rerun (nobody slow, no stop) resumes from the GLOBAL checkpoint the stop wrote
    log = run_pretrain(tmp_path, -1, 0, "straggler.report_interval=4", "straggler.stop_if_detected=false", "mlflow=null")
    assert "resumed from GLOBAL checkpoint at iteration 4" in log
    assert "FINAL step=16 resumed_from=[4]" in log
