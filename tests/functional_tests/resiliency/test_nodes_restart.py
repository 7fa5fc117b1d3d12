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


@pytest.mark.slow
def test_a_rank_killed_before_the_first_checkpoint_restarts_the_job_fresh_as_the_same_run(tmp_path):
    """The earlier start left only its run records (no checkpoint in any tier): the restart is not
    refused as "an earlier run left files here" but starts over, under the same run id."""
    run = tmp_path / "run"
    proc = run_nodes([WORKER, tmp_path, f"logger.run_dir={run}", "train.train_iters=12",
                      "checkpoint.local_save_interval=5", f"checkpoint.save={run}/global"],
                     max_restarts=2, timeout=300,
                     env={"TIERSTACK_TEST_KILL_AT": "2", "TIERSTACK_TEST_KILL_NODE": "1", "TIERSTACK_TEST_LAUNCH": "a"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "KILLING node 1" in log and "FINAL step=12 resumed_from=[]" in log
    assert "never completed a checkpoint" in log and "earlier run left files here" not in log
    assert json.loads((run / "restarts.json").read_text())["restarts"] == 1
    run_ids = {json.loads((run / "global" / "run.json").read_text())["run_id"]}
    run_ids |= {json.loads((run / f"node{i}" / "local" / "run.json").read_text())["run_id"] for i in (0, 1)}
    assert len(run_ids) == 1, run_ids
    for rank in (0, 1):
        lines = [json.loads(x) for x in (tmp_path / f"losses_rank{rank}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2] + list(range(1, 13))
        assert [x["loss"] for x in lines[:2]] == [x["loss"] for x in lines[2:4]]  # the same start, redone
