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
