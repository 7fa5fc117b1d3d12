"""Bad input to the loggers and the profiler: one clear error naming the field, exit status 2,
before any work (the recipe run as a user runs it; no rank starts, no run directory appears)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "gpt_tiny.py"
# The recipe as `python recipes/gpt_tiny.py ...` runs it, in an interpreter where `import wandb` fails.
WITHOUT_WANDB = ("import runpy, sys; sys.modules['wandb'] = None; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")


def _refused(*overrides, without_wandb=False):
    prefix = [sys.executable, "-c", WITHOUT_WANDB] if without_wandb else [sys.executable]
    proc = subprocess.run([*prefix, str(RECIPE), *overrides], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_an_unwritable_tensorboard_dir_is_refused_before_work(tmp_path):
    (tmp_path / "a_file").write_text("")
    err = _refused(f"logger.run_dir={tmp_path}/run", f"logger.tensorboard_dir={tmp_path}/a_file/tb")
    assert f"logger.tensorboard_dir={tmp_path}/a_file/tb: {tmp_path}/a_file is not a directory" in err
    assert not (tmp_path / "run").exists()


def test_wandb_on_without_the_package_is_refused_before_work(tmp_path):
    err = _refused(f"logger.run_dir={tmp_path}/run", "wandb.project=p", without_wandb=True)
    assert "wandb: the section is on but the wandb package is not installed: pip install wandb" in err
    assert not (tmp_path / "run").exists()


def test_a_profile_window_that_ends_before_it_starts_is_refused_before_work(tmp_path):
    err = _refused(f"logger.run_dir={tmp_path}/run", "profile.enabled=true", "profile.step_start=7",
                   "profile.step_end=5")
    assert "profile.step_end=5 is before profile.step_start=7" in err
    assert not (tmp_path / "run").exists()
