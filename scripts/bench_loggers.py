"""What TensorBoard and the per-phase timers cost per iteration: the same run with both on and off.

Each run is a real ``pretrain()`` of the gpt_tiny model on mock data (1 rank, TP=1, a log line
every iteration so the loggers work every step; no checkpoints, no evaluation, no mlflow, no
straggler monitor), in a process of its own. The time of an iteration is the wall time between two
consecutive ``on_step`` calls, so the log line, the timers' gather and TensorBoard's writes are
all in it. The runs alternate (on, off, on, off, ...); the script prints the median iteration time of
each mode (the first ``--skip`` iterations of each run left out) and the ratio on / off.

Run: .venv/bin/python scripts/bench_loggers.py [--reps 2] [--iters 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "on": ["logger.timers=true"],  # logger.tensorboard_dir keeps its default: <run_dir>/tensorboard
    "off": ["logger.timers=false", "logger.tensorboard_dir=null"],
}


def _child(mode: str, iters: int, run_dir: str, out: str) -> int:
    """One run in this process; writes its iteration times (seconds) to ``out`` as JSON."""
    from tierstack.recipes import gpt_tiny_config
    from tierstack.training.pretrain import pretrain

    cfg = gpt_tiny_config().apply_overrides([
        "dataset.mock=true", f"train.train_iters={iters}", "train.eval_interval=null",
        "distributed.tensor_model_parallel_size=1", "mlflow=null", "straggler=null", "logger.log_interval=1",
        "logger.progress_bar=false", "logger.loss_curve=false", f"logger.run_dir={run_dir}",
        "checkpoint.save=null", "checkpoint.save_interval=null", "checkpoint.local_dir=null",
        "checkpoint.local_save_interval=null", *MODES[mode],
    ])
    marks: list[float] = []
    pretrain(cfg, on_step=lambda state, result: marks.append(time.perf_counter()))
    Path(out).write_text(json.dumps([b - a for a, b in zip(marks, marks[1:])]))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="runs of each mode, alternating")
    ap.add_argument("--iters", type=int, default=40, help="iterations per run")
    ap.add_argument("--skip", type=int, default=5, help="first iterations of each run left out (warm-up)")
    ap.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.child, args.iters, args.run_dir, args.out)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-loggers-") as tmp:
        for rep in range(args.reps):
            for mode in MODES:
                out = Path(tmp) / f"{mode}{rep}.json"
                cmd = [sys.executable, __file__, "--child", mode, "--iters", str(args.iters),
                       "--run-dir", str(Path(tmp) / f"{mode}{rep}"), "--out", str(out)]
                subprocess.run(cmd, check=True, env={**_env(), "CUDA_VISIBLE_DEVICES": ""},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                times[mode] += json.loads(out.read_text())[args.skip:]
    med = {m: statistics.median(t) for m, t in times.items()}
    for mode, t in times.items():
        q = statistics.quantiles(t, n=4)
        print(f"{mode:>3}: median {med[mode] * 1e3:.1f} ms/iteration (quartiles {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}, "
              f"{len(t)} iterations)")
    print(f"ratio on/off: {med['on'] / med['off']:.3f} (TensorBoard + timers, a log line every iteration)")
    return 0


def _env() -> dict:
    import os

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


if __name__ == "__main__":
    sys.exit(main())
