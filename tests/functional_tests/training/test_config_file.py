"""``--print-config`` writes the whole run; ``--config-file`` gives back the same run, bit for bit."""

import json
import sys
from pathlib import Path

import pytest
from launcher import run_group

# A small gpt_tiny: 2 ranks (TP=2), 6 steps on the built-in corpus, a line per step, no checkpoints.
SMALL = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
    "train.train_iters=6", "train.micro_batch_size=4", "train.global_batch_size=4", "train.eval_interval=null",
    "logger.log_interval=1", "logger.progress_bar=false", "logger.loss_curve=false", "optimizer.lr=0.01",
    "checkpoint.save=null", "checkpoint.save_interval=null", "checkpoint.local_dir=null",
    "checkpoint.local_save_interval=null", "straggler=null", "mlflow=null",
]


def _pretrain(*args, timeout=300):
    return run_group([sys.executable, "-m", "tierstack.cli", "pretrain", *map(str, args)], timeout=timeout,
                     env=None)


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in lines if "loss" in r]


@pytest.mark.slow
def test_printed_config_fed_back_gives_the_same_losses_bit_for_bit(tmp_path):
    cache = f"dataset.cache_dir={tmp_path}/cache"
    printed = _pretrain("gpt_tiny", *SMALL, cache, f"logger.run_dir={tmp_path}/a", "--print-config", timeout=120)
    assert printed.returncode == 0, printed.stderr[-3000:]
    config_file = tmp_path / "run.yaml"
    config_file.write_text(printed.stdout)

    first = _pretrain("gpt_tiny", "--nproc-per-node", 2, *SMALL, cache, f"logger.run_dir={tmp_path}/a")
    assert first.returncode == 0, first.stderr[-4000:]
    # Another recipe as the base: the file alone says everything; the launcher hands it to the ranks.
    second = _pretrain("gpt_small", "--nproc-per-node", 2, "--config-file", config_file, f"logger.run_dir={tmp_path}/b")
    assert second.returncode == 0, second.stderr[-4000:]

    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(a) == 6
    assert a == b  # floats compared exactly: the same run
    # and the file of the second run resolves to the first's config except for the run directory
    again = _pretrain("gpt_small", "--config-file", config_file, f"logger.run_dir={tmp_path}/a", "--print-config",
                      timeout=120)
    assert again.stdout == printed.stdout
