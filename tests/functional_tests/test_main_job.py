"""The README's main job: both tiers on by default, a second launch resumes, `checkpoints ls` shows it."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import device_env, run_group

from tierstack.recipes import DEFAULT_RECIPE, RECIPES, gpt_tiny_config
from tierstack.runtime import known_warnings

REPO = Path(__file__).resolve().parents[2]
TIERSTACK = Path(sys.executable).with_name("tierstack")

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
         "train.micro_batch_size=4", "train.global_batch_size=4", "train.eval_interval=4", "train.eval_iters=1",
         "checkpoint.local_save_interval=2", "checkpoint.save_interval=4", "straggler=null"]


def test_main_job_config_uses_both_tiers_local_more_often():
    cfg = gpt_tiny_config()
    c = cfg.checkpoint
    assert c.save and c.local_dir and c.async_save
    assert c.local_save_interval < c.save_interval <= cfg.train.train_iters
    assert cfg.distributed.tensor_model_parallel_size == 2
    assert cfg.dataset.data_path is None and not cfg.dataset.mock  # the stdlib corpus, real text
    cfg.validate(world_size=2)


def test_cli_default_recipe_and_the_recipe_file_are_one_function():
    """`tierstack pretrain` (no name), `tierstack pretrain gpt_tiny` and recipes/gpt_tiny.py: one config."""
    assert RECIPES[DEFAULT_RECIPE] is gpt_tiny_config
    namespace = runpy.run_path(str(REPO / "recipes" / "gpt_tiny.py"), run_name="not_main")
    assert namespace["gpt_tiny_config"] is gpt_tiny_config
    assert runpy.run_path(str(REPO / "recipes" / "gpt_small.py"), run_name="not_main")["gpt_small_config"] is RECIPES["gpt_small"]


@pytest.mark.slow
def test_second_launch_resumes_where_the_first_stopped(tmp_path, torchrun):
    recipe = REPO / "recipes" / "gpt_tiny.py"
    run_dir = tmp_path / "gpt_tiny"
    common = [*SMALL, f"logger.run_dir={run_dir}", f"checkpoint.save={run_dir}/checkpoints",
              f"checkpoint.local_dir={run_dir}/local", f"dataset.cache_dir={tmp_path}/cache"]
    # first launch as `make pretrain` does (the CLI validates, then starts the ranks); second by torchrun
    first = run_group([TIERSTACK, "pretrain", "gpt_tiny", "--nproc-per-node", "2", *common, "train.train_iters=8"],
                      timeout=300, cwd=REPO, env={**os.environ, **device_env(2), "PYTHONUNBUFFERED": "1"})
    assert first.returncode == 0, first.stderr[-4000:]
    # a quiet start: no megatron-core / torch notices, one line naming the absent GPU packages
    assert "Warning:" not in first.stderr and "warnings.warn" not in first.stderr, first.stderr[:4000]
    if known_warnings.absent_gpu_packages():
        assert first.stderr.count("optional GPU packages not installed") == 1
    assert "starting a fresh run" in first.stderr
    second = torchrun([recipe, *common, "train.train_iters=12"], timeout=300)
    assert second.returncode == 0, second.stderr[-4000:]
    # Tie at step 8 (GLOBAL and LOCAL both hold it): LOCAL wins, it loads faster.
    assert "resumed from LOCAL checkpoint at iteration 8" in second.stderr
    assert "iter 9/12" in second.stderr and "iter 1/12" not in second.stderr

    ls = subprocess.run([sys.executable, "-m", "tierstack.cli", "checkpoints", "ls", str(run_dir)],
                        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert ls.returncode == 0, ls.stdout + ls.stderr
    assert "(GLOBAL tier)" in ls.stdout and "(LOCAL tier)" in ls.stdout
    assert "tracker: latest step 12" in ls.stdout
    assert (run_dir / "loss_curve.png").stat().st_size > 10_000


def test_other_sizes_come_from_the_same_base():
    small, tiny = RECIPES["gpt_small"](), gpt_tiny_config()
    small.validate(world_size=8)
    assert (small.model.num_layers, small.model.hidden_size) == (12, 768)
    assert small.checkpoint.local_dir and small.checkpoint.save  # both tiers, as in every recipe
    assert type(small) is type(tiny)
