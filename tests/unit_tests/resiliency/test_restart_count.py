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
    assert record_start(tmp_path)["restarts"] == 0
    assert record_start(tmp_path)["restarts"] == 1  # e.g. node 1's agent restarted its ranks
    with pytest.raises(RestartLimitError, match="restarted 2 times, more than --max-restarts=1") as err:
        record_start(tmp_path)  # another node's agent would allow it: the job-wide count does not
    assert isinstance(err.value, BadInputError)
    assert json.loads((tmp_path / RESTARTS_FILE).read_text())["restarts"] == 2
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")  # a new launch starts its own count
    assert record_start(tmp_path)["restarts"] == 0
