"""fp32 <-> bf16 across a GLOBAL checkpoint, local layer spec, one CPU rank (a plain ``python``
process: the decision needs no second rank): the manifest records the model settings; a resume with optimizer state is refused naming the setting; a weights-only load works
and the run goes on in bf16."""

import json
from pathlib import Path

import pytest

from launcher import run_python

WORKER = Path(__file__).with_name("ckpt_worker.py")


def _run(out: Path, *overrides: str):
    proc = run_python([WORKER, out, f"logger.run_dir={out}/run", *overrides], timeout=300)
    return proc, proc.stdout + proc.stderr


@pytest.mark.slow
def test_fp32_checkpoint_into_bf16_run(tmp_path):
    g = tmp_path / "global"
    proc, log = _run(tmp_path / "fp32", "train.train_iters=2", f"checkpoint.save={g}",
                     "checkpoint.save_interval=2")
    assert proc.returncode == 0, log[-6000:]
    man = json.loads((g / "iter_0000002" / "manifest.json").read_text())
    assert man["transformer_impl"] == "local" and man["bf16"] is False

    proc, log = _run(tmp_path / "refused", "model.bf16=true", "train.train_iters=4", f"checkpoint.save={g}")
    assert proc.returncode != 0
    assert "CheckpointLoadError" in log and "written with model.bf16=false, this run has model.bf16=true" in log
    assert "set model.bf16=false to resume it, or checkpoint.load_optim=false" in log

    proc, log = _run(tmp_path / "bf16", "model.bf16=true", "train.train_iters=4", f"checkpoint.save={g}",
                     "checkpoint.save_interval=2", "checkpoint.load_optim=false")
    assert proc.returncode == 0, log[-6000:]
    assert "cast to this run's dtype" in log
    rec = json.loads((tmp_path / "bf16" / "rank0.json").read_text())
    assert rec["resume"]["step"] == 2 and sorted(rec["losses"], key=int) == ["3", "4"]
    assert all(float.fromhex(v) < 7.0 for v in rec["losses"].values())  # weights came along: no fresh-init jump
    man = json.loads((g / "iter_0000004" / "manifest.json").read_text())
    assert man["bf16"] is True
