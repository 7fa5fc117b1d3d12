"""Two CPU ranks under torchrun: the rank that sleeps in its step is reported, and both agree to stop."""

import json
import socket
from pathlib import Path

import pytest
from launcher import run_torchrun

WORKER = Path(__file__).with_name("straggler_worker.py")


@pytest.mark.slow
def test_slow_rank_is_reported_by_rank_and_node_and_stop_is_agreed(tmp_path):
    proc = run_torchrun([WORKER, tmp_path, "1"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    node = socket.gethostname()
    assert f"STRAGGLERS: rank 1 on {node}" in log
    assert "[rank0] WARNING tierstack.resiliency.straggler" in log  # only rank 0 reports ...
    assert [line for line in log.splitlines() if "[rank1]" in line and "straggler report" in line] == []  # not rank 1
    assert log.count("STRAGGLERS: ") == 1, log[-4000:]

    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank_view in seen:
        (report,) = rank_view["reports"]  # the first report already stops the loop
        assert report["iteration"] == 8 and rank_view["last_iteration"] == 8
        assert report["stragglers"] == [[1, node]]
        assert report["should_stop"] is True
    metrics = seen[0]["reports"][0]["metrics"]
    # rank 1's step takes about 5x rank 0's (its sleep is in proportion): the fastest rank scores 1
    assert metrics["straggler/train_step_relative_min"] < metrics["straggler/train_step_relative_max"]
    assert metrics["straggler/train_step_relative_max"] == pytest.approx(1.0)
    assert seen[1]["reports"][0]["metrics"] == {}  # metrics live on rank 0
