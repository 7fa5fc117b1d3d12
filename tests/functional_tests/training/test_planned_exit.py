"""SIGTERM on one rank: every rank stops after the same step, a GLOBAL checkpoint is published, exit 0."""

import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")


@pytest.mark.slow
def test_sigterm_on_one_rank_saves_global_and_stops_all(tmp_path, torchrun):
    run = tmp_path / "tiny"
    proc = torchrun(
        [WORKER, tmp_path, "distributed.tensor_model_parallel_size=1",
         f"checkpoint.save={run}/checkpoints", "checkpoint.save_interval=100", "checkpoint.async_save=true"],
        env={"TIERSTACK_TEST_SIGTERM_AT": "5"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "received SIGTERM" in proc.stderr
    assert "stopping at iteration 5: SIGTERM received on some rank" in proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["train_state"]["step"] for r in ranks] == [5, 5]
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert (run / "checkpoints" / "iter_0000005").is_dir()
