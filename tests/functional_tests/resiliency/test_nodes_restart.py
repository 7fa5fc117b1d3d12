"""``--max-restarts`` on two simulated nodes: a rank SIGKILLed mid-run brings the job back by itself."""

import json
import time
from pathlib import Path

import pytest

from launcher import run_nodes

WORKER = Path(__file__).with_name("nodes_worker.py")


def _kill_node_1_at(tmp_path: Path, run: Path, *, step: int, train_iters: int):
    """2 nodes x 1 rank, LOCAL every 5, ``--max-restarts 2``; node 1's rank is SIGKILLed once,
    after ``step``. Returns the finished process and its stdout + stderr."""
    proc = run_nodes([WORKER, tmp_path, f"logger.run_dir={run}", f"train.train_iters={train_iters}",
                      "checkpoint.local_save_interval=5", f"checkpoint.save={run}/global"],
                     max_restarts=2, timeout=300,
                     env={"TIERSTACK_TEST_KILL_AT": str(step), "TIERSTACK_TEST_KILL_NODE": "1",
                          "TIERSTACK_TEST_LAUNCH": "a"})
    return proc, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_from_local_and_it_finishes(tmp_path):
    run = tmp_path / "run"
    proc, log = _kill_node_1_at(tmp_path, run, step=12, train_iters=30)
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
    proc, log = _kill_node_1_at(tmp_path, run, step=2, train_iters=12)
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


@pytest.mark.slow
def test_a_node_local_directory_that_is_bad_on_one_node_stops_every_rank_at_once_naming_it(tmp_path):
    """node 1's ``checkpoint.local_dir`` is a file: valid on node 0, not on node 1. Every rank stops
    with exit status 2 (each agent then exits 1, torchrun's status for a failed rank) and one message naming the field, the directory and the rank, in seconds (the
    rank that found it used to exit alone and silently, the other waiting for it in the rendezvous
    until ``distributed.timeout_s``)."""
    run = tmp_path / "run"
    (run / "node1").mkdir(parents=True)
    (run / "node1" / "local").write_text("not a directory")
    t0 = time.monotonic()
    proc = run_nodes(["gpt_tiny", f"logger.run_dir={run}", f"checkpoint.save={run}/global",
                      "distributed.tensor_model_parallel_size=1", "train.micro_batch_size=4",
                      "distributed.timeout_s=120", "mlflow=null", "straggler=null"], timeout=100)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and log.count("exitcode  : 2") == 2, log[-6000:]  # torchrun: 1; each rank: 2
    assert time.monotonic() - t0 < 60
    assert f"checkpoint.local_dir={run}/node1/local: {run}/node1/local is not a directory (rank(s) 1 on " in log, log[-6000:]
    assert "invalid configuration (1 problem(s))" in log  # node 0's directory is fine
    assert "rank 1 stopped: bad input (rank 0 says which)" in log
    assert not (run / "global" / "run.json").exists()  # nothing of a run was written
