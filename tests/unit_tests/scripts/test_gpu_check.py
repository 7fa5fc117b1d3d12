"""scripts/gpu_check.sh --dry-run prints the steps of the GPU check and runs none of them."""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_dry_run_prints_every_step_and_runs_nothing(tmp_path):
    out = tmp_path / "gpu_check"
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "GPU_CHECK_DIR": str(out), "NGPU": "4"},
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "4 GPU(s) -> 4 ranks, TP=2, DP=2" in text
    for step in ("install", "environment", "main-kill", "main-resume", "functional", "benchmark"):
        assert f"== {step} (limit " in text
        assert any(line.startswith(step) and "DRY-RUN" in line for line in text.splitlines())
    assert "pip install -q -c constraints.txt --only-binary=transformer-engine" in text and "'.[gpu,test]'" in text
    main = next(line for line in text.splitlines() if "runs:" in line and "recipes/gpt_tiny.py" in line)
    for arg in ("--nproc-per-node 4", "model.transformer_impl=transformer_engine", "model.bf16=true",
                "distributed.backend=nccl", "train.train_iters=30", "train.global_batch_size=16",
                "checkpoint.async_save=true", "checkpoint.local_save_interval=5"):
        assert arg in main
    assert "TIERSTACK_TEST_DEVICE=gpu" in text and "scripts/bench_checkpoint.py" in text
    assert "== tierstack GPU check summary" in text
    assert not out.exists()  # nothing ran, nothing was written


def test_one_gpu_runs_one_rank_and_skips_the_tp2_benchmark(tmp_path):
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--skip-install"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "GPU_CHECK_DIR": str(tmp_path / "x"), "NGPU": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "1 GPU(s) -> 1 ranks, TP=1, DP=1" in proc.stdout
    assert any(line.startswith("benchmark") and "SKIPPED" in line and "needs 2 GPUs" in line
               for line in proc.stdout.splitlines())
    assert any(line.startswith("install") and "SKIPPED" in line for line in proc.stdout.splitlines())


def test_cpu_mode_shows_the_cpu_variant_of_every_step(tmp_path):
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--device", "cpu"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "GPU_CHECK_DIR": str(tmp_path / "x")},
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "2 GPU(s) -> 2 ranks, TP=2, DP=1" in text and "--device cpu" in text
    main = next(line for line in text.splitlines() if "runs:" in line and "recipes/gpt_tiny.py" in line)
    for arg in ("model.transformer_impl=local", "model.bf16=false", "distributed.backend=gloo"):
        assert arg in main
    assert "nccl" not in main and "transformer_engine" not in main
    for step in ("environment", "gpu-items", "main-kill", "main-resume", "functional", "benchmark"):
        assert any(line.startswith(step) and "DRY-RUN" in line for line in text.splitlines()), step
    assert any(line.startswith("install") and "SKIPPED" in line for line in text.splitlines())
    assert "TIERSTACK_TEST_DEVICE=cpu" in text and "test_replication_chunks.py" in text


def test_an_unknown_device_is_refused_naming_it():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "tpu"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "--device tpu: use gpu or cpu" in proc.stderr
