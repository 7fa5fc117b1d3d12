"""Bad input stops the run with one clear error before any rank does work."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "gpt_tiny.py"


def _run_recipe(*overrides, timeout=120):
    return subprocess.run(
        [sys.executable, str(RECIPE), *overrides], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_tp_that_does_not_divide_heads_is_refused_before_work(tmp_path):
    proc = _run_recipe("model.num_attention_heads=3", "model.hidden_size=264", f"logger.run_dir={tmp_path}/run")
    assert proc.returncode == 2
    assert "model.num_attention_heads=3 is not divisible by distributed.tensor_model_parallel_size=2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing started


def test_unknown_override_key_is_refused(tmp_path):
    proc = _run_recipe("train.iters=5")
    assert proc.returncode == 2
    assert "unknown field train.iters" in proc.stderr and "train_iters" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_data_path_is_refused(tmp_path):
    proc = _run_recipe(f"dataset.data_path=[{tmp_path}/nope]")
    assert proc.returncode == 2
    assert f"{tmp_path}/nope.bin not found" in proc.stderr


def test_global_batch_that_does_not_divide_is_refused():
    proc = _run_recipe("train.global_batch_size=12", "distributed.tensor_model_parallel_size=1")
    assert proc.returncode == 2
    assert "train.global_batch_size=12 is not divisible by train.micro_batch_size" in proc.stderr


def test_launcher_refuses_before_any_rank_with_status_2(tmp_path):
    """`tierstack pretrain --nproc-per-node 2` validates for 2 ranks first: the error alone, exit 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "tierstack.cli", "pretrain", "gpt_tiny", "--nproc-per-node", "2",
         "model.num_attention_heads=3", "model.hidden_size=264", f"logger.run_dir={tmp_path}/run"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "invalid configuration (1 problem(s)):",
        "  - model.num_attention_heads=3 is not divisible by distributed.tensor_model_parallel_size=2",
    ]
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_ranks_agree_on_the_refusal(tmp_path, torchrun):
    """Under a plain torchrun each rank refuses (exit 2, said once); torchrun then reports the failed
    ranks, ending with the refusal."""
    proc = torchrun(
        [RECIPE, "model.num_attention_heads=3", "model.hidden_size=264", f"logger.run_dir={tmp_path}/run"], timeout=120
    )
    assert proc.returncode != 0
    # One error, said once (by rank 0), and only this problem: the world size of 2 fits TP=2;
    # torchrun's report of the failed ranks repeats it as its root cause (test_refusal_is_last.py).
    said, report = proc.stderr.split("ChildFailedError", 1)
    assert said.count("model.num_attention_heads=3 is not divisible by distributed.tensor_model_parallel_size=2") == 1
    assert "model.num_attention_heads=3" in report.split("Root Cause")[-1]
    assert "1 problem(s)" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_jsonl_line_without_text_names_its_line(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tierstack.cli", "preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2
    assert f"{data}:2" in proc.stderr and "text" in proc.stderr
    assert not list(tmp_path.glob("out*"))


def test_no_checkpoint_to_resume_is_one_message_with_status_2(tmp_path):
    """A refusal decided by resume selection (here ``exit_on_missing_checkpoint`` with nothing saved;
    also every candidate invalid or missing on some rank, or ``ckpt_step`` naming none) is bad input
    like any other: one message naming the setting, exit status 2, no traceback."""
    proc = _run_recipe("distributed.tensor_model_parallel_size=1", "dataset.mock=true", "mlflow=null",
                       "straggler=null", "train.train_iters=1", f"logger.run_dir={tmp_path}/run",
                       f"checkpoint.save={tmp_path}/global", f"checkpoint.local_dir={tmp_path}/local",
                       "checkpoint.exit_on_missing_checkpoint=true", timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "checkpoint.exit_on_missing_checkpoint=true but no checkpoint was found" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "global").glob("iter_*"))  # no work done


@pytest.mark.slow
@pytest.mark.parametrize("override, message", [
    # refused by every rank's config check, before any process group exists
    ("model.num_attention_heads=3", "model.num_attention_heads=3 is not divisible by distributed.tensor_model_parallel_size=2"),
    # refused in setup, after the process groups exist (several ranks check paths together)
    ("dataset.data_path=[{tmp}/nope]", "{tmp}/nope.bin not found"),
])
def test_the_refusal_is_printed_when_rank_0_is_slower_than_the_others(tmp_path, torchrun, override, message):
    """A rank other than 0 that exits first makes torchrun stop rank 0: the refusal must be out by
    then (the run used to end with no message at all when rank 0 was the slow one)."""
    worker = Path(__file__).with_name("slow_rank0_report.py")
    extra = ["model.hidden_size=264"] if "heads" in override else []
    proc = torchrun([worker, override.format(tmp=tmp_path), *extra, f"logger.run_dir={tmp_path}/run"], timeout=120)
    assert proc.returncode != 0
    said, report = proc.stderr.split("ChildFailedError", 1)  # torchrun's report repeats it as the root cause
    assert said.count(message.format(tmp=tmp_path)) == 1, proc.stderr[-4000:]
    assert message.format(tmp=tmp_path) in report.split("Root Cause")[-1], proc.stderr[-4000:]
