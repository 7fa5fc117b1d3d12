"""scripts/bench_goodput.py (goodput_records.py) reads the JSON-lines records ranks append while it watches them: a last
line a rank is still writing (or was killed writing) is left out, a damaged earlier line is an error."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _bench():
    spec = importlib.util.spec_from_file_location("goodput_records", REPO / "scripts" / "goodput_records.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_torn_last_line_is_left_out_and_an_earlier_damaged_line_raises(tmp_path):
    bench = _bench()
    path = tmp_path / "steps_rank0.jsonl"
    assert bench.records(path) == []
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n" + '{"step": 3, "lo')
    assert bench.records(path) == [{"step": 1}, {"step": 2}]
    assert not bench.finished(tmp_path, last_step=3)
    path.write_text('{"st\n' + json.dumps({"step": 2}) + "\n")
    with pytest.raises(json.JSONDecodeError):
        bench.records(path)


def test_each_failure_gets_one_resume_entry_from_rank_0s_load_record(tmp_path):
    """Under in-process restart several ranks' "resumed from" lines reach the console (a row
    printed every resume twice, and a second "fresh start" line read as a start from scratch): the
    table's tiers come from rank 0's load records instead, one per failure; a restart with no load
    record between the failure and its first step started from scratch."""
    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("steps_rank0.jsonl", [{"t": 10.0 + s, "step": s, "pid": 1, "loss": 1.0} for s in range(1, 8)]
          + [{"t": 20.0 + s, "step": s, "pid": 2, "loss": 1.0} for s in range(6, 12)]
          + [{"t": 40.0 + s, "step": s, "pid": 3, "loss": 1.0} for s in range(1, 4)])
    write("starts.jsonl", [{"rank": 0, "pid": 1, "t_created": 9.0, "t_process": 9.1, "t_imported": 9.5},
                           {"rank": 1, "pid": 5, "t": 25.5, "tier": "local", "step": 5, "load_s": 0.1},
                           {"rank": 0, "pid": 2, "t": 25.6, "tier": "local", "step": 5, "load_s": 0.1}])
    (tmp_path / "launch.log").write_text("resumed from LOCAL checkpoint at iteration 5\n" * 2)
    out = _bench().analyse(tmp_path, [{"t": 17.5}, {"t": 32.5}])
    assert out["tiers"] == ["LOCAL 5", "scratch"]
    assert out["lost"] == [2, 11]


def test_a_step_the_failed_attempt_finishes_after_the_raise_is_work_lost_not_the_first_new_step(tmp_path):
    """In-process restart: rank 1 raises after step 48, rank 0 records its own step 48 a few ms
    later (same attempt), then both resume step 47 from memory in a new attempt. The failure lost
    one step and its first new step is the redone 48 of the new attempt (read from the old
    attempt's step 48, a run's table said 0 lost, 0.05 s, "scratch")."""
    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    old = [{"t": 100.0 + 0.5 * s, "step": s, "pid": 7, "loss": 1.0} for s in range(1, 49)]  # step 48 at 124.0
    new = [{"t": 126.0 + 0.5 * (s - 48), "step": s, "pid": 7, "loss": 1.0} for s in range(48, 60)]
    write("steps_rank0.jsonl", old + new)
    write("starts.jsonl", [{"rank": 0, "pid": 7, "t_attempt": 99.0}, {"rank": 1, "pid": 8, "t_attempt": 99.0},
                           {"rank": 1, "pid": 8, "t_attempt": 124.4}, {"rank": 0, "pid": 7, "t_attempt": 124.5},
                           {"rank": 0, "pid": 7, "t": 124.8, "tier": "local", "step": 47, "load_s": 0.2}])
    out = _bench().analyse(tmp_path, [{"t": 123.98}])
    assert out["lost"] == [1]
    assert out["tiers"] == ["LOCAL 47"]
    assert out["recover"] == [pytest.approx(126.0 - 123.98)]
    assert out["parts"][0]["detect"] == pytest.approx(124.5 - 123.98)
