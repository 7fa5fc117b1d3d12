"""Issue 26, item 15: reading a checkpoint never runs code it contains. A GLOBAL ``common.pt`` and
``.metadata`` and a LOCAL file are replaced by pickles whose unpickling creates a file, and their
manifest entries rewritten to match (a CRC is not an authentication): ``checkpoints ls`` and
``verify`` and a resume run nothing, name each file they refused, and the resume falls back to the
newest checkpoint that is sound. Real files of the committed legacy fixture, real 2-rank launches."""

import builtins
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierstack.checkpointing import listing, manifest, paths, safe_load

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "legacy_mcore016"
ARGS = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
        "train.micro_batch_size=4", "train.global_batch_size=4", "train.train_iters=8", "train.eval_interval=null",
        "optimizer.lr=3e-3", "mlflow=null", "straggler=null", "logger.log_interval=1",
        "checkpoint.save_interval=100", "checkpoint.local_save_interval=2", "checkpoint.most_recent_k=2"]


class _CreatesAFile:
    """Unpickled, it calls ``open(marker, "w")``: the stand-in for any code a pickle can run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


def _reseal(files_dir: Path, manifest_path: Path, names) -> None:
    man = json.loads(manifest_path.read_text())
    man["files"] = {**man["files"], **manifest.describe_files(files_dir, names)}
    manifest_path.write_text(json.dumps(man))


@pytest.fixture
def poisoned(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "ran-code"
    shutil.copytree(FIXTURE / "run", run)
    step_dir = run / "checkpoints" / "iter_0000006"
    torch.save({"train_state": {"step": 6}, "x": _CreatesAFile(marker)}, step_dir / "common.pt")
    _reseal(step_dir, step_dir / paths.MANIFEST, ["common.pt"])
    local = run / "local" / "0" / "iter_0000004_0_local.pt"
    torch.save(_CreatesAFile(marker), local)
    _reseal(local.parent, local.with_name("iter_0000004_0_local.manifest.json"), [local.name])
    return run, marker


def test_ls_and_verify_run_nothing_and_name_the_files(poisoned):
    run, marker = poisoned
    text, _ = listing.ls(str(run))
    assert not marker.exists(), text
    text, status = listing.verify(str(run))
    assert not marker.exists() and status == 1, text
    assert "unsafe-pickle common.pt" in text and "iter_0000006/common.pt" in text, text
    assert "unsafe-pickle iter_0000004_0_local.pt" in text, text
    assert "asks for _io.open" in text or "asks for builtins.open" in text, text


def test_a_torch_dist_metadata_that_asks_for_code_is_refused(tmp_path):
    step_dir = tmp_path / "iter_0000006"
    shutil.copytree(FIXTURE / "run" / "checkpoints" / "iter_0000006", step_dir)
    safe_load.check_torch_dist_metadata(step_dir)  # the real one passes
    marker = tmp_path / "ran-code"
    (step_dir / ".metadata").write_bytes(__import__("pickle").dumps(_CreatesAFile(marker)))
    with pytest.raises(safe_load.UnsafeCheckpointError, match=r"\.metadata: it asks for (builtins|_io)\.open"):
        safe_load.check_torch_dist_metadata(step_dir)
    assert safe_load.problem(step_dir, [".metadata"]).startswith("unsafe-pickle .metadata")
    assert not marker.exists()


@pytest.mark.slow
def test_a_resume_refuses_them_and_falls_back(poisoned, tmp_path):
    run, marker = poisoned
    subprocess.run([sys.executable, "-m", "tierstack.cli", "preprocess", "--input", str(FIXTURE / "corpus.jsonl"),
                    "--output-prefix", str(tmp_path / "data" / "corpus")], check=True, capture_output=True, timeout=120)
    proc = subprocess.run(
        [sys.executable, "-m", "tierstack.cli", "pretrain", "gpt_tiny", "--nproc-per-node", "2",
         f"dataset.data_path=[{tmp_path / 'data' / 'corpus'}]", *ARGS, f"logger.run_dir={run}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert not marker.exists()
    assert "unsafe-pickle common.pt" in log and "unsafe-pickle iter_0000004_0_local.pt" in log, log[-6000:]
    assert "resumed from LOCAL checkpoint at iteration 2" in log, log[-6000:]
