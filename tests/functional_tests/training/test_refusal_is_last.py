"""A refused launch ends with the refusal, and leaves no file that changes the next launch (issue 29
item 7: torchrun's 20-line ``FAILED / Root Cause`` report followed the refusal, and a refused launch
left ``run.json`` behind, which the next launch warned about)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import run_python

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "gpt_tiny.py"
HEADS = "model.num_attention_heads=3 is not divisible by distributed.tensor_model_parallel_size=2"
SMALL = ["dataset.mock=true", "mlflow=null", "straggler=null", "train.train_iters=1", "train.eval_interval=null"]


def _launcher(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tierstack.cli", "pretrain", "gpt_tiny", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_under_plain_torchrun_the_report_of_the_failed_ranks_ends_with_the_refusal(tmp_path, torchrun):
    """torchrun always prints its report of the failed ranks last; rank 0 makes the refusal its root
    cause (torchrun's error file), so the report ends with the refusal instead of a link."""
    proc = torchrun([RECIPE, "model.num_attention_heads=3", "model.hidden_size=264", f"logger.run_dir={tmp_path}/run"],
                    timeout=120)
    assert proc.returncode != 0
    root_cause = proc.stderr.split("Root Cause (first observed failure):")[-1]
    assert HEADS in root_cause and "To enable traceback" not in root_cause, proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.strip() and set(line.strip()) != {"="}][-1]
    assert last.strip() == f"- {HEADS}", proc.stderr[-3000:]
    assert proc.stderr.count(HEADS) == 2  # said by rank 0, and in torchrun's report
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_refusal_found_by_the_ranks_at_setup_is_the_last_line_of_our_launcher(tmp_path):
    """``tierstack pretrain --nproc-per-node 2``: setup refuses on both ranks (nothing to resume, but
    the config forbids a fresh start); the other rank's line comes first, the refusal last, and
    neither torchrun's lines nor its report follow."""
    run = tmp_path / "run"
    proc = _launcher("--nproc-per-node", 2, *SMALL, f"logger.run_dir={run}", f"checkpoint.save={run}/global",
                     f"checkpoint.local_dir={run}/local", "checkpoint.exit_on_missing_checkpoint=true")
    assert proc.returncode == 2, proc.stderr[-4000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].endswith("checkpoint.exit_on_missing_checkpoint=true but no checkpoint was found"), lines[-6:]
    assert sum("rank 1 stopped: bad input (rank 0 says which)" in line for line in lines) == 1
    assert "FAILED" not in proc.stderr and "Sending process" not in proc.stderr and "exitcode" not in proc.stderr


def test_our_launcher_checks_the_data_files_before_any_rank_starts(tmp_path):
    """A damaged .bin is refused by the launcher itself (the ranks' setup check, done once before
    spawning): the refusal alone, exit status 2, no rank started, nothing written."""
    from tierstack.data.preprocess import preprocess
    from tierstack.data.tokenizers import ByteTokenizer

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(50)))
    preprocess([docs], tmp_path / "corpus", ByteTokenizer())
    bin_path = tmp_path / "corpus.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-100])  # a copy cut short
    run = tmp_path / "run"
    proc = _launcher("--nproc-per-node", 2, "mlflow=null", "straggler=null", f"logger.run_dir={run}",
                     f"dataset.data_path={tmp_path}/corpus", timeout=120)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines()[0] == "bad training data (1 problem(s)); nothing was started:"
    assert f"{bin_path}: " in proc.stderr and "re-run `tierstack preprocess`" in proc.stderr.strip().splitlines()[-1]
    assert "optional GPU packages" not in proc.stderr  # no rank started
    assert not run.exists()


def test_a_refused_launch_leaves_no_file_that_changes_the_next_one(tmp_path):
    """A pretrained checkpoint directory that holds no checkpoint used to get past validation: the
    ranks claimed the tier roots (``run.json``), then failed with a traceback, and the next launch
    warned about the earlier run it found. It is now refused before any work, and the next launch
    starts as if it never happened."""
    run = tmp_path / "run"
    (tmp_path / "not_a_checkpoint").mkdir()
    common = ["distributed.tensor_model_parallel_size=1", *SMALL, f"logger.run_dir={run}",
              f"checkpoint.save={run}/global", f"checkpoint.local_dir={run}/local"]
    refused = run_python([RECIPE, *common, f"checkpoint.pretrained_checkpoint={tmp_path}/not_a_checkpoint"], timeout=300)
    assert refused.returncode == 2, refused.stderr[-4000:]
    assert refused.stderr.strip().splitlines()[-1].startswith(
        f"  - checkpoint.pretrained_checkpoint={tmp_path}/not_a_checkpoint: holds no checkpoint; give a GLOBAL step "
        "directory"), refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    assert not run.exists() or not [p for p in run.rglob("*") if p.is_file()]
    nxt = run_python([RECIPE, *common], timeout=300)
    assert nxt.returncode == 0, nxt.stderr[-4000:]
    assert "no checkpoint to resume from: fresh start" in nxt.stderr
    assert "never completed a checkpoint" not in nxt.stderr and "earlier run" not in nxt.stderr, nxt.stderr[-3000:]
