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
