"""``--max-restarts`` on two simulated nodes: a rank SIGKILLed mid-run brings the job back by itself."""

import json
from pathlib import Path

import pytest

from launcher import run_nodes

WORKER = Path(__file__).with_name("nodes_worker.py")


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_from_local_and_it_finishes(tmp_path):
    run = tmp_path / "run"
    proc = run_nodes([WORKER, tmp_path, f"logger.run_dir={run}", "train.train_iters=30",
                      "checkpoint.local_save_interval=5", f"checkpoint.save={run}/global"],
                     max_restarts=2, timeout=300,
                     env={"TIERSTACK_TEST_KILL_AT": "12", "TIERSTACK_TEST_KILL_NODE": "1", "TIERSTACK_TEST_LAUNCH": "a"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "KILLING node 1" in log and "FINAL step=30 resumed_from=[10]" in log
    assert "resumed from LOCAL checkpoint at iteration 10" in log
    record = json.loads((run / "restarts.json").read_text())
    assert record["restarts"] == 1 and record["max_restarts"] == 2 and len(record["starts"]) == 2
    assert "restart 1 of at most 2 (job-wide count" in log
    for rank in (0, 1):
        lines = [json.loads(x) for x in (tmp_path / f"losses_rank{rank}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == list(range(1, 13)) + list(range(11, 31))
