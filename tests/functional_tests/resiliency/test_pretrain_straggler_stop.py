"""End to end through pretrain(): a slow rank is named, a GLOBAL checkpoint is saved, the rerun resumes.

Two CPU ranks, TP=1 PP=1 DP=2. Rank 1 sleeps in its forward step. On a CPU only section timing
scores ranks, and a section that spans the gradient all-reduce takes the same wall time on both
ranks; the forward step does not, which is why train() must time it
(``StragglerMonitor.wrap_forward_step``).
"""

import re
import socket

import pytest

@pytest.mark.slow
def test_straggler_stop_saves_global_then_rerun_resumes(tmp_path, pretrain_run):
    node = socket.gethostname()
    log = pretrain_run(
        tmp_path, 1, 9, "straggler.report_interval=4", "straggler.stop_if_detected=true", "mlflow=null"
    )
    assert f"STRAGGLERS: rank 1 on {node} -> stopping" in log
    assert re.search(r"GLOBAL checkpoint of step 4 published", log)
    # every rank exits with the same message naming the straggler
    assert f"[rank 1] WARNING tierstack.training.train: stopping at iteration 4: straggler detected on rank(s) 1 ({node})" in log
    assert "FINAL step=4" in log
    assert (tmp_path / "e2e" / "checkpoints" / "iter_0000004").is_dir()

    # the rerun (nobody slow, no stop) resumes from the GLOBAL checkpoint the stop wrote
    log = pretrain_run(tmp_path, -1, 0, "straggler.report_interval=4", "straggler.stop_if_detected=false", "mlflow=null")
    assert "resumed from GLOBAL checkpoint at iteration 4" in log
    assert "FINAL step=16 resumed_from=[4]" in log
