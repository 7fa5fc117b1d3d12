"""The job-wide restart count in the run directory (single process: rank 0's view)."""

import json

import pytest

from tierstack.errors import BadInputError
from tierstack.resiliency.restarts import RESTARTS_FILE, RestartLimitError, record_start


def test_starts_under_one_rendezvous_count_as_restarts_and_the_limit_stops_the_job(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert record_start(tmp_path) is None  # not under torchrun: nothing to count
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert record_start(tmp_path)["restarts"] == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # e.g. node 1's agent restarted its ranks
    assert record_start(tmp_path)["restarts"] == 1
    with pytest.raises(RestartLimitError, match="restarted 2 times, more than --max-restarts=1") as err:
        record_start(tmp_path)  # another node's agent would allow it: the job-wide count does not
    assert isinstance(err.value, BadInputError)
    assert json.loads((tmp_path / RESTARTS_FILE).read_text())["restarts"] == 2
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")  # another rendezvous starts its own count
    assert record_start(tmp_path)["restarts"] == 0


def test_a_new_launch_under_the_same_rendezvous_id_starts_a_new_count(tmp_path, monkeypatch):
    """``--rdzv-id $SLURM_JOB_ID`` is the same for every srun of an allocation: a new launch (every
    agent's own restart count 0) is not a restart, even right after a job that used up its restarts."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "slurm-44")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert record_start(tmp_path)["restarts"] == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert record_start(tmp_path)["restarts"] == 1
    with pytest.raises(RestartLimitError, match="restarted 2 times"):
        record_start(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # the next srun of the allocation
    record = record_start(tmp_path)
    assert record["restarts"] == 0 and len(record["starts"]) == 1
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")  # a launcher that does not say: the id decides
    assert record_start(tmp_path)["restarts"] == 1
