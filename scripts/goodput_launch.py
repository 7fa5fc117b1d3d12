"""One launch of the goodput worker on 2 simulated nodes (``scripts/launch_nodes.sh``), as the goodput
rows and the chaos soak run it: the overrides every launch shares, the launch with a fault injector
thread beside it, and its stop after a time limit."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("bench_goodput.py")  # the worker: it trains when torchrun runs it
MAX_RESTARTS = 50
IN_PROCESS = ["resiliency.restart=in-process", "resiliency.heartbeat_timeout_s=3"]  # the in-process rows' and soak's


def base_overrides(run: Path, iterations: int, mtbf_s: float) -> list[str]:
    """The main job's model (gpt_tiny) at TP=1, micro batch 4 (the main job's global batch of 8 on
    2 ranks), mock data (no rank preprocesses a corpus), no logging extras, no checkpoints (a row
    adds its own), ``checkpoint.mtbf_s`` (seconds) for the rows that pick their intervals."""
    return ["distributed.tensor_model_parallel_size=1", f"train.train_iters={iterations}",
            "train.eval_interval=null", "dataset.mock=true", "train.micro_batch_size=4", "logger.progress_bar=false",
            "mlflow=null", "straggler=null", f"logger.run_dir={run}", "checkpoint.local_save_interval=null",
            "checkpoint.save_interval=null", f"checkpoint.mtbf_s={mtbf_s}"]


def with_global_dir(run: Path, overrides: list[str]) -> list[str]:
    """``overrides`` plus ``checkpoint.save``: ``<run>/global`` when they save GLOBAL, else null."""
    saves = any(o.startswith("checkpoint.save_interval=") and not o.endswith("null") for o in overrides)
    return [*overrides, f"checkpoint.save={run}/global" if saves else "checkpoint.save=null"]


def launch(run: Path, overrides: list[str], local_root: Path, *, limit_s: Optional[float] = None,
           injector: Optional[Callable[[Path, threading.Event], None]] = None, env: Optional[dict] = None,
           keep_local: bool = False, nodes: int = 2, processes_per_node: int = 1) -> dict:
    """Run the worker on ``nodes`` x ``processes_per_node`` (default 2 x 1) with ``--max-restarts`` :data:`MAX_RESTARTS`, output to
    ``<run>/launch.log``; ``injector(run, stop)`` runs on a thread meanwhile (``stop`` is set when
    the launch has ended). The node-local directories go under ``local_root`` (removed at the end
    unless ``keep_local``). ``run`` is emptied first.

    A launch still running after ``limit_s`` seconds is stopped (SIGTERM to its session, SIGKILL
    60 s later) and reported with rc -9.

    Returns:
        ``{"rc", "wall"}``: the launcher's exit status and the wall time, seconds.
    """
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    shutil.rmtree(local_root, ignore_errors=True)
    cmd = ["bash", str(REPO / "scripts" / "launch_nodes.sh"), "--max-restarts", str(MAX_RESTARTS), "--local-root",
           str(local_root), str(nodes), str(processes_per_node), str(WORKER), str(run), *overrides]
    full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, **(env or {})}
    if "resiliency.restart=in-process" in overrides:  # gloo's and the store's per-poll warnings
        full_env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    stop = threading.Event()
    thread = None if injector is None else threading.Thread(target=injector, args=(run, stop), daemon=True)
    t0 = time.time()
    with open(run / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=full_env,
                                start_new_session=True)
        if thread is not None:
            thread.start()
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:  # SIGTERM first: the agents then stop their ranks (own sessions)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            rc = -9
    stop.set()
    wall = time.time() - t0
    if thread is not None:
        thread.join(timeout=10)
    if not keep_local:
        shutil.rmtree(local_root, ignore_errors=True)  # node memory when in /dev/shm
    return {"rc": rc, "wall": wall}
