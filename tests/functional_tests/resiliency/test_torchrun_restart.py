"""Plain ``torchrun --standalone --nproc-per-node 2 --max-restarts 2``, with no extra environment: a
rank SIGKILLed at step 12 of 30 brings the job back and it finishes with an uninterrupted run's losses.

torchrun's agent hosts the ranks' store and keeps it across restarts; before the ranks' process
groups took keys of their own start (``tierstack.runtime.attempt_store``), the restarted ranks read
the dead start's gloo addresses and never got going again unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
was set.
"""

import json
from pathlib import Path

import pytest

from launcher import run_torchrun

WORKER = Path(__file__).with_name("nodes_worker.py")
SHARE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _launch(out: Path, env: dict):
    """30 steps of the tiny GPT on 2 ranks, LOCAL every 5, under plain torchrun with 2 restarts."""
    out.mkdir()
    run = out / "run"
    proc = run_torchrun([WORKER, out, f"logger.run_dir={run}", "train.train_iters=30", "checkpoint.local_save_interval=5",
                         f"checkpoint.save={run}/global", f"checkpoint.local_dir={run}/local"],
                        launcher_args=["--max-restarts", "2"], timeout=360, env={"TIERSTACK_TEST_LAUNCH": out.name, **env})
    records = {r: [json.loads(x) for x in (out / f"losses_rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    return proc, proc.stdout + proc.stderr, records


@pytest.mark.slow
def test_a_rank_killed_under_plain_torchrun_restarts_and_ends_with_the_uninterrupted_losses(tmp_path, monkeypatch):
    monkeypatch.delenv(SHARE_OFF, raising=False)  # no extra environment: torchrun's defaults
    ref, ref_log, ref_records = _launch(tmp_path / "uninterrupted", {})
    assert ref.returncode == 0, ref_log[-6000:]
    proc, log, records = _launch(tmp_path / "killed", {"TIERSTACK_TEST_KILL_AT": "12", "TIERSTACK_TEST_KILL_RANK": "1"})
    assert proc.returncode == 0, log[-6000:]
    assert "KILLING node 0 rank 1 after step 12" in log
    assert "resumed from LOCAL checkpoint at iteration 10" in log and "FINAL step=30 resumed_from=[10]" in log
    assert json.loads((tmp_path / "killed" / "run" / "restarts.json").read_text())["restarts"] == 1
    for rank in (0, 1):
        # the case that hung: the agent's store, shared by both starts
        assert {x["agent_store"] for x in records[rank]} == {"True"}
        assert [x["step"] for x in records[rank]] == list(range(1, 13)) + list(range(11, 31))
        assert [x["restart"] for x in records[rank]] == [0] * 12 + [1] * 20
        final = {x["step"]: x["loss"] for x in records[rank]}  # the last record of each step
        assert final == {x["step"]: x["loss"] for x in ref_records[rank]}, rank
        assert [x["step"] for x in ref_records[rank]] == list(range(1, 31))
