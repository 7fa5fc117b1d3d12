"""The one torchrun launcher of the functional tests: real ranks, one rendezvous each, on the
suite's device (``TIERSTACK_TEST_DEVICE=cpu|gpu``, default cpu).

Every launch uses torchrun's ``--standalone`` rendezvous: the c10d store binds port 0, so the
operating system hands each launch a free port at bind time. No test picks a port itself (a port
picked and then used can be taken by another process in between) and none uses the default 29500.

Device: ``cpu`` hides CUDA devices from the ranks (``CUDA_VISIBLE_DEVICES=""``), so they run gloo
and the local layer spec even on a GPU machine and the suite means the same thing everywhere;
``gpu`` lets the ranks see the GPUs (NCCL, transformer-engine when installed) and skips a test that
starts more ranks than there are GPUs, with the reason (one rank needs one device).

Counting: with ``TIERSTACK_TEST_LAUNCH_LOG=<file>`` set, every launch appends one line (ranks, test,
script; ``python`` for a 1-rank :func:`run_python`) to that file, so a suite run can report how many torchrun launches it made.

Timeout: torchrun runs in its own process group (session); on timeout the whole group (torchrun,
its ranks and anything they started) is killed, so no rank outlives the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import pytest

TORCHRUN = Path(sys.executable).with_name("torchrun")
REPO = Path(__file__).resolve().parents[2]
DEVICE_ENV = "TIERSTACK_TEST_DEVICE"
DEVICES = ("cpu", "gpu")
LAUNCH_LOG_ENV = "TIERSTACK_TEST_LAUNCH_LOG"


def chosen_device() -> str:
    """The suite's device (``cpu`` when unset); a wrong value is a usage error naming the variable."""
    value = os.environ.get(DEVICE_ENV, "cpu").strip().lower() or "cpu"
    if value not in DEVICES:
        raise pytest.UsageError(f"{DEVICE_ENV}={value!r}: use cpu or gpu")
    return value


def device_env(nproc: int) -> dict[str, str]:
    """Environment variables for a launch of ``nproc`` ranks on the chosen device.

    Skips the calling test (``pytest.skip``) when ``gpu`` is chosen and fewer than ``nproc`` CUDA
    devices are visible.
    """
    if chosen_device() == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    import torch

    have = torch.cuda.device_count()
    if have < nproc:
        pytest.skip(f"{DEVICE_ENV}=gpu: this test starts {nproc} ranks, one GPU each, but {have} GPU(s) are visible")
    return {}


LAUNCH_ID_ENV = "TIERSTACK_TEST_LAUNCH_ID"


def _kill_launch(launch_id: str) -> int:
    """SIGKILL every process whose environment carries ``LAUNCH_ID_ENV=launch_id``; returns how many.

    torchrun starts each rank in a session (and process group) of its own, so killing the
    launcher's group misses the ranks, and a rank whose launcher died is re-parented to init, out
    of reach of a process-tree walk. The variable is inherited by every process of the launch.
    """
    import psutil

    mine = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    killed = 0
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mine not in f.read().split(b"\0"):
                    continue
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (OSError, ProcessLookupError):  # gone, or not ours to read
            continue
    return killed


@contextlib.contextmanager
def started_launch(cmd, *, stdout, stderr, cwd=None, env=None) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` in a new session for a test that acts on it while it runs (signals a rank or
    the launcher); on leaving the block every process the launch started is SIGKILLed, as in
    :func:`run_group`. ``stdout``/``stderr``: open files.
    """
    launch_id = uuid.uuid4().hex
    env = {**(os.environ if env is None else env), LAUNCH_ID_ENV: launch_id}
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, cwd=cwd or REPO, env=env,
                            start_new_session=True)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill_launch(launch_id)
        proc.wait()


def run_group(cmd, *, timeout: float, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a new session; afterwards (on timeout first) SIGKILL every process the launch
    started, wherever it went (:func:`_kill_launch`); on timeout re-raise.

    Output goes to temporary files, not pipes: a process that left the group (torchrun starts each
    rank in a session of its own, and a rank's children stay there when the rank dies) may still
    hold them open, and a pipe would make this wait for it.

    Raises:
        subprocess.TimeoutExpired: after ``timeout`` seconds, once every process of the launch is killed.
    """
    launch_id = uuid.uuid4().hex
    env = {**(os.environ if env is None else env), LAUNCH_ID_ENV: launch_id}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=cwd, env=env, start_new_session=True)
        expired = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            expired = True
        finally:
            try:  # the launcher's group on timeout; ranks or writers that outlived a launcher that returned
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _kill_launch(launch_id)  # the ranks: sessions of their own, or re-parented to init
            proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if expired:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_torchrun(args, *, nproc: int = 2, timeout: float = 300, cwd=None, env=None, launcher: str = "torchrun",
                 launcher_args=()) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc-per-node <nproc> <args...>``; returns the completed process.

    Args:
        args: the script (or ``-m module``) and its arguments; paths are turned into strings.
        nproc: ranks on this machine.
        timeout: seconds before the launch and every process it started are killed
            (``subprocess.TimeoutExpired``).
        cwd: working directory (default: the repository root).
        env: extra environment variables (``OMP_NUM_THREADS=1`` unless given; the suite's device
            variables, see :func:`device_env`).
        launcher: ``torchrun``, or ``ft_launcher`` (nvidia-resiliency-ext fault tolerance: torchrun's
            arguments plus ``--ft-*``), from the same virtualenv.
        launcher_args: more launcher options (``--max-restarts``, ``--ft-rank-heartbeat-timeout``, ...).
    """
    full_env = dict(os.environ)
    full_env.update(device_env(nproc))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    program = TORCHRUN if launcher == "torchrun" else TORCHRUN.with_name(launcher)
    cmd = [str(program), "--standalone", "--nproc-per-node", str(nproc), *map(str, launcher_args), *map(str, args)]
    _log_launch(nproc, args, launcher=launcher)
    return run_group(cmd, timeout=timeout, cwd=cwd or REPO, env=full_env)


LAUNCH_NODES = REPO / "scripts" / "launch_nodes.sh"


def run_nodes(args, *, nodes: int = 2, nproc: int = 1, max_restarts: int = 0, timeout: float = 300,
              env=None) -> subprocess.CompletedProcess:
    """Run ``scripts/launch_nodes.sh --max-restarts R NODES NPROC <args...>``: one torchrun agent per
    simulated node, c10d rendezvous on 127.0.0.1 (the script picks the port), each node with its own
    ``checkpoint.local_dir`` under ``<logger.run_dir>/node<i>/local`` (give ``logger.run_dir=`` in ``args``).

    Same environment and timeout handling as :func:`run_torchrun` (the whole process group, every
    agent and rank, is killed on timeout).
    """
    full_env = dict(os.environ)
    full_env.update(device_env(nodes * nproc))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env["PYTHON"] = sys.executable
    if env:
        full_env.update(env)
    cmd = ["bash", str(LAUNCH_NODES), "--max-restarts", str(max_restarts), str(nodes), str(nproc), *map(str, args)]
    _log_launch(nodes * nproc, args, launcher="launch_nodes.sh")
    return run_group(cmd, timeout=timeout, cwd=REPO, env=full_env)


def run_python(args, *, timeout: float = 300, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run ``python <args...>`` as one rank (no torchrun): for scenarios that need no second rank.

    tierstack's ``initialize_distributed`` makes a plain ``python`` process a 1-rank group on a free
    local port (no ``RANK``/``WORLD_SIZE`` in the environment: they are removed here). Arguments,
    timeout (process-group kill), cwd and env as in :func:`run_torchrun`; logged as ``python``
    launches under ``$TIERSTACK_TEST_LAUNCH_LOG``.
    """
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    full_env.update(device_env(1))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    _log_launch(1, args, launcher="python")
    return run_group([sys.executable, *map(str, args)], timeout=timeout, cwd=cwd or REPO, env=full_env)


def _log_launch(nproc: int, args, launcher: str = "torchrun") -> None:
    """Append ``<nproc>\t<current test>\t<script>[\t<launcher>]`` to ``$TIERSTACK_TEST_LAUNCH_LOG`` when set."""
    log = os.environ.get(LAUNCH_LOG_ENV)
    if not log:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    script = Path(str(next(iter(args), "?"))).name
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"{nproc}\t{test}\t{script}" + ("" if launcher == "torchrun" else f"\t{launcher}") + "\n")
