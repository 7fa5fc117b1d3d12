"""The one torchrun launcher of the functional tests: real ranks on CPU (gloo), one rendezvous each.

Every launch uses torchrun's ``--standalone`` rendezvous: the c10d store binds port 0, so the
operating system hands each launch a free port at bind time. No test picks a port itself (a port
picked and then used can be taken by another process in between) and none uses the default 29500.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TORCHRUN = Path(sys.executable).with_name("torchrun")
REPO = Path(__file__).resolve().parents[2]


def run_torchrun(args, *, nproc: int = 2, timeout: float = 300, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc-per-node <nproc> <args...>``; returns the completed process.

    Args:
        args: the script (or ``-m module``) and its arguments; paths are turned into strings.
        nproc: ranks on this machine.
        timeout: seconds before the launch is killed (``subprocess.TimeoutExpired``).
        cwd: working directory (default: the repository root).
        env: extra environment variables (``OMP_NUM_THREADS=1`` unless given).
    """
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO, env=full_env)
