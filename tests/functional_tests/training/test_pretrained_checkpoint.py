"""Fine-tuning start: model weights from another run's GLOBAL checkpoint, counters and optimizer fresh."""

import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")


@pytest.mark.slow
def test_pretrained_weights_load_and_counters_start_at_zero(tmp_path, torchrun):
    base = tmp_path / "base"
    first = torchrun([WORKER, base, "train.train_iters=12", "distributed.tensor_model_parallel_size=1",
                      f"checkpoint.save={base}/ckpt", "checkpoint.save_interval=12"], timeout=300)
    assert first.returncode == 0, first.stderr[-4000:]
    tuned = tmp_path / "tuned"
    second = torchrun([WORKER, tuned, "train.train_iters=3", "distributed.tensor_model_parallel_size=1",
                       f"checkpoint.pretrained_checkpoint={base}/ckpt", f"checkpoint.save={tuned}/ckpt"], timeout=300)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "loaded pretrained weights of step 12" in second.stderr
    a = json.loads((base / "rank0.json").read_text())
    b = json.loads((tuned / "rank0.json").read_text())
    # The fine-tune starts from the trained weights, not from scratch (ln 257 = 5.55) ...
    assert b["losses"][0] < a["losses"][0] - 1.0
    assert abs(b["losses"][0] - a["losses"][-1]) < 0.5
    # ... with its own counters.
    assert b["train_state"]["step"] == 3 and b["train_state"]["consumed_train_samples"] == 3 * 8
