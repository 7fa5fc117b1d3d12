"""A run with ``logger.format=megatron``: its log lines parse with Megatron-LM's regex, carry the numbers
the run recorded, and mlflow has them under Megatron-LM's metric names."""

import json
import sys
from pathlib import Path

import pytest
from launcher import run_python

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit_tests" / "observability"))
from test_megatron_log import MEGATRON_LINE, MEGATRON_VALIDATION  # noqa: E402 - the regexes, written once

SMALL = ["distributed.tensor_model_parallel_size=1", "model.num_layers=2", "model.hidden_size=64",
         "model.num_attention_heads=4", "model.seq_length=64", "train.train_iters=6", "train.micro_batch_size=4",
         "train.global_batch_size=4", "train.eval_interval=3", "train.eval_iters=1", "logger.log_interval=2",
         "logger.progress_bar=false", "logger.loss_curve=false", "checkpoint.save=null", "checkpoint.save_interval=null",
         "checkpoint.local_dir=null", "checkpoint.local_save_interval=null", "straggler=null"]


@pytest.mark.slow
def test_megatron_lines_and_metric_names(tmp_path):
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    proc = run_python(["-m", "tierstack.cli", "pretrain", "gpt_tiny", *SMALL, f"logger.run_dir={run}",
                       f"dataset.cache_dir={tmp_path / 'cache'}", "logger.format=megatron"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [MEGATRON_LINE.search(line) for line in proc.stderr.splitlines()]
    found = [m for m in lines if m]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert [int(m["iteration"]) for m in found] == [r["step"] for r in records] == [1, 2, 3, 4, 6]
    for m, r in zip(found, records):
        assert float(m["loss"]) == float(f"{r['loss']:.6E}") and float(m["lr"]) == float(f"{r['lr']:.6E}")
        assert int(m["consumed"]) == 4 * r["step"] and int(m["gbs"]) == 4
    validations = [MEGATRON_VALIDATION.search(line) for line in proc.stderr.splitlines()]
    assert [int(m["iteration"]) for m in validations if m] == [3, 6]

    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("tierstack").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "lm loss")}
    assert history == {r["step"]: r["loss"] for r in records}
    for name in ("learning-rate", "grad-norm", "iteration-time", "batch-size", "loss-scale", "lm loss validation"):
        assert client.get_metric_history(mlrun.info.run_id, name), name
    assert not client.get_metric_history(mlrun.info.run_id, "loss")
