"""Shared launcher for functional tests: real ranks under torchrun on CPU (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TORCHRUN = Path(sys.executable).with_name("torchrun")
REPO = Path(__file__).resolve().parents[2]


def run_torchrun(args, *, nproc: int = 2, timeout: float = 300, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc-per-node <nproc> <args...>`` and return the completed process.

    Each run gets its own rendezvous port (``--master-port 0`` is not supported by the static
    rendezvous, so a standalone rendezvous is used).
    """
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO, env=full_env)


@pytest.fixture
def torchrun():
    """The :func:`run_torchrun` launcher."""
    return run_torchrun


PRETRAIN_WORKER = Path(__file__).with_name("resiliency") / "pretrain_worker.py"


@pytest.fixture
def pretrain_run():
    """Run ``resiliency/pretrain_worker.py RUN_ROOT SLOW_RANK SLEEP_S overrides...`` on 2 ranks.

    Returns the combined stdout + stderr; fails the test (with the log's tail) when a rank fails.
    """

    def run(run_root, slow_rank, sleep_s, *overrides):
        proc = run_torchrun([PRETRAIN_WORKER, run_root, slow_rank, sleep_s, *overrides], timeout=300)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-6000:]
        return log

    return run
