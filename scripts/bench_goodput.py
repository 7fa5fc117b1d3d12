"""Goodput under failures: the same training on 2 simulated nodes, with ranks killed on a schedule.

Usage::

    .venv/bin/python scripts/bench_goodput.py [--iterations 100] [--fault-every-s 120] [--seed 0]
        [--configs none,global,local_global,replicated,auto] [--timeout-factor 6] [--work-dir DIR]

Each configuration runs the main job's model (gpt_tiny, TP=1 on 2 simulated nodes x 1 rank, micro batch 4 so the global batch of 8 is the main job's, on
mock data so that no rank preprocesses a corpus,
``scripts/launch_nodes.sh --max-restarts 50``) for ``--iterations`` iterations while a seeded fault
injector SIGKILLs a random rank every ``--fault-every-s`` seconds of the run; in ``replicated`` it
also wipes that rank's node-local directory (a replaced node). A failure-free run of the same
iterations (no checkpoints) gives the reference time. Printed side by side, one row per
configuration: wall time, goodput (failure-free time / wall time), failures, iterations lost per
failure (last step before the kill minus the step resumed from), seconds from a failure to the
first new step, and the tier each restart resumed from. A configuration that has not finished
after ``--timeout-factor`` times the failure-free time is stopped (rc -9; without checkpoints a run
whose failures come faster than it can finish never does).

Status (issue 9): a first version, NOT validated. Its only run so far was a smoke run on a heavily
loaded 2-core machine (load average 8-14 from other jobs): ``--iterations 20 --fault-every-s 25
--configs replicated`` took 65 s failure-free, and a restart there took longer than 25 s from kill
to setup, so every restart was killed again before its first step (no progress; the launch was
stopped). The fault interval must exceed the restart time by a wide margin; the defaults below
have not been run, and the README has no table from it yet.

This process is also the worker (``RANK`` set by torchrun): it trains with ``pretrain`` and appends
``{"t", "step", "pid"}`` per iteration to ``<run>/steps_rank<r>.jsonl`` and its pid and node-local
directory to ``<run>/rank<r>.json`` at start, which is how the injector finds its victims.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GLOBAL_EVERY = 30  # GLOBAL interval of the checkpointing configurations (iterations)
LOCAL_EVERY = 5
CONFIGS = {
    "none": [],
    "global": [f"checkpoint.save_interval={GLOBAL_EVERY}"],
    "local_global": [f"checkpoint.save_interval={GLOBAL_EVERY}", f"checkpoint.local_save_interval={LOCAL_EVERY}"],
    "replicated": [f"checkpoint.save_interval={GLOBAL_EVERY}", f"checkpoint.local_save_interval={LOCAL_EVERY}",
                   "checkpoint.replication_factor=2"],
    "auto": [f"checkpoint.save_interval={GLOBAL_EVERY}", "checkpoint.local_save_interval=auto"],
}


def worker(out: Path, overrides: list[str]) -> None:
    """One rank: the main job's model, recording each iteration's end time."""
    from tierstack import pretrain
    from tierstack.recipes import gpt_tiny_config

    cfg = gpt_tiny_config().apply_overrides(overrides)
    rank = int(os.environ["RANK"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "local_dir": cfg.checkpoint.local_dir}))
    record = open(out / f"steps_rank{rank}.jsonl", "a")

    def on_step(ts, result):
        record.write(json.dumps({"t": time.time(), "step": ts.step, "pid": os.getpid()}) + "\n")
        record.flush()

    pretrain(cfg, on_step=on_step)


def _inject(run: Path, every_s: float, rng: random.Random, wipe: bool, stop: threading.Event, kills: list) -> None:
    while not stop.wait(every_s):
        rank = rng.randrange(2)
        info = json.loads((run / f"rank{rank}.json").read_text()) if (run / f"rank{rank}.json").exists() else None
        if info is None:
            continue
        try:
            os.kill(info["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        if wipe and info["local_dir"]:
            shutil.rmtree(Path(info["local_dir"]), ignore_errors=True)
        kills.append({"t": time.time(), "rank": rank})


def _run(name: str, extra: list[str], args, work: Path, faults: bool) -> dict:
    run = work / name
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    overrides = ["distributed.tensor_model_parallel_size=1", f"train.train_iters={args.iterations}",
                 "train.eval_interval=null", "dataset.mock=true", "train.micro_batch_size=4", "logger.progress_bar=false", "mlflow=null", "straggler=null",
                 f"logger.run_dir={run}", "checkpoint.local_save_interval=null", "checkpoint.save_interval=null",
                 "checkpoint.mtbf_s=" + str(args.fault_every_s), *extra]
    if not any(o.startswith("checkpoint.save_interval=") and not o.endswith("null") for o in extra):
        overrides.append("checkpoint.save=null")
    else:
        overrides.append(f"checkpoint.save={run}/global")
    cmd = ["bash", str(REPO / "scripts" / "launch_nodes.sh"), "--max-restarts", "50", "2", "1", __file__,
           str(run), *overrides]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    stop, kills = threading.Event(), []
    injector = threading.Thread(target=_inject, args=(run, args.fault_every_s, random.Random(args.seed), name == "replicated",
                                                      stop, kills), daemon=True)
    t0 = time.time()
    with open(run / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        if faults:
            injector.start()
        try:
            rc = proc.wait(timeout=args.limit_s)
        except subprocess.TimeoutExpired:  # SIGTERM first: the agents then stop their ranks (own sessions)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            rc = -9
    stop.set()
    wall = time.time() - t0
    return {"name": name, "rc": rc, "wall": wall, "kills": kills, **_analyse(run, kills)}


def _analyse(run: Path, kills: list) -> dict:
    steps = [json.loads(x) for x in (run / "steps_rank0.jsonl").read_text().splitlines()] if (run / "steps_rank0.jsonl").exists() else []
    text = (run / "launch.log").read_text(errors="replace")
    tiers = re.findall(r"resumed from (LOCAL|GLOBAL) checkpoint at iteration (\d+)", text)
    lost, recover = [], []
    for k in kills:
        before = [s for s in steps if s["t"] < k["t"]]
        after = [s for s in steps if s["t"] > k["t"]]
        if before and after:
            lost.append(before[-1]["step"] - (after[0]["step"] - 1))
            recover.append(after[0]["t"] - k["t"])
    starts_from_zero = text.count("no checkpoint to resume from: fresh start") - 1
    return {"lost": lost, "recover": recover, "tiers": [f"{t} {s}" for t, s in tiers] + ["scratch"] * max(0, starts_from_zero)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--fault-every-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--timeout-factor", type=float, default=6.0)
    p.add_argument("--work-dir", default=None)
    args = p.parse_args()
    args.limit_s = None
    work = Path(args.work_dir or f"/tmp/bench_goodput.{os.getpid()}")
    names = [c for c in args.configs.split(",") if c]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    reference = _run("failure_free", [], args, work, faults=False)
    args.limit_s = args.timeout_factor * reference["wall"]
    print(f"== goodput: gpt_tiny TP=1 on 2 simulated nodes x 1 rank, {args.iterations} iterations, a rank killed every "
          f"{args.fault_every_s:g}s (seed {args.seed}); LOCAL every {LOCAL_EVERY}, GLOBAL every {GLOBAL_EVERY}")
    print(f"failure-free: {reference['wall']:.1f}s (rc {reference['rc']}); work dir {work}")
    head = f"{'configuration':<14}{'rc':>4}{'wall s':>9}{'goodput':>9}{'failures':>9}{'lost/fail':>10}{'fail->step s':>13}  resumed from"
    print(head + "\n" + "-" * len(head))
    for name in names:
        r = _run(name, CONFIGS[name], args, work, faults=True)
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        print(f"{name:<14}{r['rc']:>4}{r['wall']:>9.1f}{reference['wall'] / r['wall']:>9.2f}{len(r['kills']):>9}"
              f"{mean(r['lost']):>10.1f}{mean(r['recover']):>13.1f}  {', '.join(r['tiers']) or '-'}", flush=True)


if __name__ == "__main__":
    if "RANK" in os.environ:
        worker(Path(sys.argv[1]), sys.argv[2:])
    else:
        main()
