"""Fixtures of the functional tests: real ranks under torchrun on CPU (gloo), see launcher.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import run_torchrun


@pytest.fixture
def torchrun():
    """The :func:`run_torchrun` launcher."""
    return run_torchrun


PRETRAIN_WORKER = Path(__file__).with_name("resiliency") / "pretrain_worker.py"


@pytest.fixture
def pretrain_run():
    """Run ``resiliency/pretrain_worker.py RUN_ROOT SLOW_RANK SLOWDOWN overrides...`` on 2 ranks.

    Returns the combined stdout + stderr; fails the test (with the log's tail) when a rank fails.
    """

    def run(run_root, slow_rank, slowdown, *overrides):
        proc = run_torchrun([PRETRAIN_WORKER, run_root, slow_rank, slowdown, *overrides], timeout=300)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-6000:]
        return log

    return run
