"""Goodput under failures: the same training on 2 simulated nodes, with ranks killed on a schedule.

Usage::

    .venv/bin/python scripts/bench_goodput.py [--iterations auto] [--fault-every-s auto] [--fault-factor 4]
        [--global-every auto] [--faults 3] [--seed 0] [--configs none,global,local_global,replicated,auto] [--timeout-factor 3]
        [--work-dir DIR] [--local-root auto]

First a calibration launch (``local_global``, two SIGKILLs, each after a sealed LOCAL save) measures
the seconds per iteration and the restart time (kill to the first new step, the mean of the two) on
this machine, now.
``--fault-every-s auto`` is ``--fault-factor`` times that restart time (a fault interval near the
restart time leaves no progress at all); ``--iterations auto`` runs long enough for about
``--faults`` failures per configuration. The expected total time is printed before the runs.

Each configuration runs the main job's model (gpt_tiny, TP=1 on 2 simulated nodes x 1 rank, micro batch 4 so the global batch of 8 is the main job's, on
mock data so that no rank preprocesses a corpus,
``scripts/launch_nodes.sh --max-restarts 50``) for ``--iterations`` iterations while a seeded fault
injector SIGKILLs a random rank every ``--fault-every-s`` seconds of the run, until the last
iteration is done; in ``replicated`` it also wipes that rank's node-local directory (a replaced node). A failure-free run of the same
iterations (no checkpoints) gives the reference time. Printed side by side, one row per
configuration: wall time, goodput (failure-free time / wall time), failures, iterations lost per
failure (last step before the kill minus the step resumed from), seconds from a failure to the
first new step, and the tier each restart resumed from. A configuration that has not finished
after ``--timeout-factor`` times the failure-free time is stopped (rc -9, goodput ``-``); ``none`` already at
``NONE_LIMIT_FACTOR`` times it: without checkpoints every failure starts the run over, so a run
whose failures come faster than it can finish never does, and longer only costs bench time.

``--global-every auto`` puts about two GLOBAL saves in each fault interval (in whole LOCAL
intervals); LOCAL saves every 5 iterations (``auto``: Young/Daly with ``checkpoint.mtbf_s`` set to
the fault interval). Failures here come every few tens of seconds instead of hours, so every
interval is scaled down alike; the ratios between configurations are what carry over.

The node-local directories (``--local-root``) are in ``/dev/shm`` by default: LOCAL checkpoints
belong in node memory or on a node-local NVMe, and this machine's only local disk is the one that
also holds the GLOBAL directory (an fsync there made a LOCAL save durable 0.55-0.7 s after its step,
more than a step of this model, so a kill in that window lost a whole extra interval).

The time from a failure to the first new step is split (columns ``detect``, ``imports``, ``setup``,
``load``: see :func:`_split`). The README's "Goodput" section shows a run of this script.

This process is also the worker (``RANK`` set by torchrun): it trains with ``pretrain`` and appends
``{"t", "step", "pid"}`` per iteration to ``<run>/steps_rank<r>.jsonl`` and its pid and node-local
directory to ``<run>/rank<r>.json`` at start, which is how the injector finds its victims.
"""

from __future__ import annotations

import time

_T_PROCESS = time.time()  # this interpreter's start (before the heavy imports): splits the restart time

import argparse
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCAL_EVERY = 5  # LOCAL interval of the fixed-interval configurations (iterations)
NAMES = ("none", "global", "local_global", "replicated", "auto")
NONE_LIMIT_FACTOR = 2.0  # ``none`` is stopped at this many failure-free times (see the module docstring)


def configs(global_every: int) -> dict:
    """Overrides of each configuration, GLOBAL every ``global_every`` iterations where it saves.
    ``none`` keeps nothing, so a restart there starts over (``allow_fresh_start_on_invalid``: the
    node-local run file of the first start is not a checkpoint to refuse a fresh start for)."""
    g = f"checkpoint.save_interval={global_every}"
    return {
        "none": ["checkpoint.allow_fresh_start_on_invalid=true"],
        "global": [g],
        "local_global": [g, f"checkpoint.local_save_interval={LOCAL_EVERY}"],
        "replicated": [g, f"checkpoint.local_save_interval={LOCAL_EVERY}", "checkpoint.replication_factor=2"],
        "auto": [g, "checkpoint.local_save_interval=auto"],
    }


class _LoadTimes(logging.Handler):
    """Appends the checkpoint manager's "resumed from ... in N s" line, as numbers, to ``starts``."""

    def __init__(self, starts: Path, rank: int):
        super().__init__(level=logging.INFO)
        self.starts, self.rank = starts, rank

    def emit(self, record: logging.LogRecord) -> None:
        m = re.match(r"resumed from (\w+) checkpoint of step (\d+) at .* in ([\d.]+)s", record.getMessage())
        if m:
            with open(self.starts, "a") as f:
                f.write(json.dumps({"rank": self.rank, "pid": os.getpid(), "t": time.time(), "tier": m.group(1),
                                    "step": int(m.group(2)), "load_s": float(m.group(3))}) + "\n")


def worker(out: Path, overrides: list[str]) -> None:
    """One rank: the main job's model, recording each iteration's end time and, per process, when
    its interpreter started, when the imports were done and how long the checkpoint load took
    (``<run>/starts.jsonl``)."""
    from tierstack import pretrain
    from tierstack.recipes import gpt_tiny_config

    t_imported = time.time()
    cfg = gpt_tiny_config().apply_overrides(overrides)
    rank = int(os.environ["RANK"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "local_dir": cfg.checkpoint.local_dir}))
    with open(out / "starts.jsonl", "a") as f:
        f.write(json.dumps({"rank": rank, "pid": os.getpid(), "t_process": _T_PROCESS, "t_imported": t_imported}) + "\n")
    logging.getLogger("tierstack.checkpointing.manager").addHandler(_LoadTimes(out / "starts.jsonl", rank))
    record = open(out / f"steps_rank{rank}.jsonl", "a")

    def on_step(ts, result):
        record.write(json.dumps({"t": time.time(), "step": ts.step, "pid": os.getpid()}) + "\n")
        record.flush()

    pretrain(cfg, on_step=on_step)


def _records(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (``steps_rank0.jsonl``, ``starts.jsonl``); none while it does not
    exist. A last line that does not parse is one a rank is still writing (or was killed writing):
    it is left out; a damaged line before the last raises ``json.JSONDecodeError``."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = [json.loads(x) for x in lines[:-1]]
    try:
        out += [json.loads(x) for x in lines[-1:]]
    except json.JSONDecodeError:
        pass
    return out


def _finished(run: Path, last_step: int) -> bool:
    """Rank 0 recorded ``last_step``: the training is done (what remains is the final save and exit)."""
    steps = _records(run / "steps_rank0.jsonl")
    return bool(steps) and steps[-1]["step"] >= last_step


def _inject(run: Path, every_s: float, rng: random.Random, wipe: bool, stop: threading.Event, kills: list,
            last_step: int) -> None:
    """Every ``every_s`` seconds, SIGKILL a random rank (and with ``wipe`` empty its node-local
    directory), until the run has recorded its last iteration: a kill after that would only hit a
    job that is done (and leave one node's agent waiting in a rendezvous the other has left)."""
    while not stop.wait(every_s):
        if _finished(run, last_step):
            return
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


def _run(name: str, extra: list[str], args, work: Path, faults: bool, injector=None) -> dict:
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
    local_root = args.local_root / name  # node<i>/local under it: node-local, apart from the GLOBAL directory
    shutil.rmtree(local_root, ignore_errors=True)
    cmd = ["bash", str(REPO / "scripts" / "launch_nodes.sh"), "--max-restarts", "50", "--local-root", str(local_root),
           "2", "1", __file__, str(run), *overrides]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    stop, kills = threading.Event(), []
    if injector is not None:  # the calibration's own kills
        injector, faults = threading.Thread(target=injector, args=(run, stop), daemon=True), True
    else:
        injector = threading.Thread(target=_inject, args=(run, args.fault_every_s, random.Random(args.seed),
                                                          name == "replicated", stop, kills, args.iterations),
                                    daemon=True)
    limit_s = args.limit_s
    if name == "none" and limit_s is not None and args.reference_s is not None:
        limit_s = min(limit_s, NONE_LIMIT_FACTOR * args.reference_s)
    t0 = time.time()
    with open(run / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        if faults:
            injector.start()
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
    shutil.rmtree(local_root, ignore_errors=True)  # node memory when in /dev/shm
    return {"name": name, "rc": rc, "wall": wall, "kills": kills, **_analyse(run, kills)}


def _analyse(run: Path, kills: list) -> dict:
    steps = _records(run / "steps_rank0.jsonl")
    text = (run / "launch.log").read_text(errors="replace")
    tiers = re.findall(r"resumed from (LOCAL|GLOBAL) checkpoint at iteration (\d+)", text)
    starts = _records(run / "starts.jsonl")
    lost, recover, parts = [], [], []
    for i, k in enumerate(kills):
        before = [s for s in steps if s["t"] < k["t"]]
        after = [s for s in steps if s["t"] > k["t"]]
        if before and after:
            lost.append(before[-1]["step"] - (after[0]["step"] - 1))
            recover.append(after[0]["t"] - k["t"])
            parts.append(_split(k["t"], after[0]["t"], starts))
    starts_from_zero = text.count("no checkpoint to resume from: fresh start") - 1
    return {"lost": lost, "recover": recover, "parts": parts,
            "tiers": [f"{t} {s}" for t, s in tiers] + ["scratch"] * max(0, starts_from_zero)}


def _split(t_kill: float, t_step: float, starts: list) -> dict:
    """Kill to the first new step, in four parts (seconds): ``detect``: the launchers notice the
    failure and start new processes (to the last rank's new interpreter); ``imports``: interpreter
    and imports (to the last rank's imports done); ``load``: the checkpoint load (rank 0's log line);
    ``setup``: the rest (distributed init, model, optimizer, data, resume selection, the first step)."""
    new = [s for s in starts if "t_process" in s and t_kill < s["t_process"] < t_step]
    if not new:
        return {}
    t_proc = max(s["t_process"] for s in new)
    t_imp = max(s["t_imported"] for s in new)
    pids = {s["pid"] for s in new}
    load = sum(s["load_s"] for s in starts if "load_s" in s and s["pid"] in pids and s["rank"] == 0)
    return {"detect": t_proc - t_kill, "imports": t_imp - t_proc, "load": load,
            "setup": t_step - t_imp - load}


CALIBRATION_KILLS = 2  # restarts measured by the calibration (their mean: one alone varied 6.0-8.4 s here)


def _calibrate(args, work: Path) -> dict:
    """One launch of ``local_global`` with a SIGKILL of rank 1 each time ``LOCAL_EVERY + 2`` more
    iterations were recorded (so after a sealed LOCAL save), ``CALIBRATION_KILLS`` times: the
    seconds per iteration (median, before the first kill) and the restart time (kill to the first
    new step: detection, process start, setup, load; the mean over the kills) on this machine, now."""
    run = work / "calibration"
    shutil.rmtree(run, ignore_errors=True)
    iters = (CALIBRATION_KILLS + 2) * LOCAL_EVERY
    cal = argparse.Namespace(**{**vars(args), "iterations": iters, "limit_s": None, "fault_every_s": 3600.0})
    kills: list = []
    killed: set = set()

    def kill_after_seals(run: Path, stop: threading.Event) -> None:
        info = run / "rank1.json"
        while len(kills) < CALIBRATION_KILLS and not stop.wait(0.2):
            done = _records(run / "steps_rank0.jsonl")
            pid = json.loads(info.read_text())["pid"] if info.exists() else None
            if len(done) >= (len(kills) + 1) * (LOCAL_EVERY + 2) and pid is not None and pid not in killed:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.add(pid)  # rank1.json names it until the restarted rank writes its own
                kills.append({"t": time.time(), "rank": 1})

    r = _run("calibration", configs(6 * LOCAL_EVERY)["local_global"], cal, work, faults=False, injector=kill_after_seals)
    steps = _records(run / "steps_rank0.jsonl")
    first = [s["t"] for s in steps if not kills or s["t"] < kills[0]["t"]]
    gaps = sorted(b - a for a, b in zip(first, first[1:]))
    step_s = gaps[len(gaps) // 2] if gaps else float("nan")
    restarts = [next((s["t"] - k["t"] for s in steps if s["t"] > k["t"]), float("nan")) for k in kills]
    restart_s = sum(restarts) / len(restarts) if restarts else float("nan")
    return {"rc": r["rc"], "step_s": step_s, "restart_s": restart_s, "restarts": restarts, "wall": r["wall"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", default="auto",
                   help="iterations per configuration; auto: enough for --faults failures at the fault interval")
    p.add_argument("--fault-every-s", default="auto",
                   help="seconds between kills; auto: --fault-factor times the restart time measured first")
    p.add_argument("--fault-factor", type=float, default=4.0)
    p.add_argument("--global-every", default="auto",
                   help="GLOBAL interval (iterations); auto: about half the fault interval, in LOCAL intervals "
                        "(GLOBAL saved twice between failures: far more often than on a real cluster)")
    p.add_argument("--faults", type=int, default=3, help="failures per configuration aimed at by --iterations auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(NAMES))
    p.add_argument("--timeout-factor", type=float, default=3.0)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--local-root", default="auto",
                   help="where the simulated nodes' node-local directories go; auto: a folder in /dev/shm "
                        "(tmpfs: node memory, where LOCAL checkpoints are meant to live) when it exists, else the work dir")
    args = p.parse_args()
    args.limit_s = args.reference_s = None
    work = Path(args.work_dir or f"/tmp/bench_goodput.{os.getpid()}")
    shm = Path("/dev/shm")
    own_local_root = args.local_root == "auto"  # made by this run: removed at the end
    args.local_root = (Path(args.local_root) if args.local_root != "auto"
                       else shm / f"tierstack_bench_goodput.{os.getpid()}" if shm.is_dir() and os.access(shm, os.W_OK)
                       else work / "node_local")
    names = [c for c in args.configs.split(",") if c]
    unknown = set(names) - set(NAMES)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; known: {', '.join(NAMES)}")
    cal = _calibrate(args, work)
    print(f"calibration: {cal['step_s']:.2f}s per iteration, restart (kill to first new step) {cal['restart_s']:.1f}s "
          f"(mean of {', '.join(f'{x:.1f}' for x in cal['restarts'])}), "
          f"launch {cal['wall']:.1f}s (rc {cal['rc']})", flush=True)
    if cal["restart_s"] != cal["restart_s"]:  # nan: the calibration run never came back
        sys.exit(f"calibration failed: no step after the kill; see {work / 'calibration' / 'launch.log'}")
    args.fault_every_s = (args.fault_factor * cal["restart_s"] if args.fault_every_s == "auto"
                          else float(args.fault_every_s))
    args.iterations = (int(args.faults * args.fault_every_s / cal["step_s"]) + 1 if args.iterations == "auto"
                       else int(args.iterations))
    global_every = (max(2, round(args.fault_every_s / cal["step_s"] / 2 / LOCAL_EVERY)) * LOCAL_EVERY
                    if args.global_every == "auto" else int(args.global_every))
    estimate = (1 + len(names)) * (cal["wall"] + args.iterations * cal["step_s"]) + len(names) * args.faults * cal["restart_s"]
    print(f"fault every {args.fault_every_s:.0f}s, {args.iterations} iterations per configuration; "
          f"expected total about {estimate / 60:.0f} min", flush=True)
    reference = _run("failure_free", [], args, work, faults=False)
    args.limit_s, args.reference_s = args.timeout_factor * reference["wall"], reference["wall"]
    print(f"== goodput: gpt_tiny TP=1 on 2 simulated nodes x 1 rank, {args.iterations} iterations, a rank killed every "
          f"{args.fault_every_s:g}s (seed {args.seed}); LOCAL every {LOCAL_EVERY}, GLOBAL every {global_every}")
    print(f"failure-free: {reference['wall']:.1f}s (rc {reference['rc']}); work dir {work}; "
          f"node-local directories under {args.local_root}")
    head = (f"{'configuration':<14}{'rc':>4}{'wall s':>9}{'goodput':>9}{'failures':>9}{'lost/fail':>10}{'fail->step s':>13}"
            f"{'detect':>8}{'imports':>8}{'setup':>7}{'load':>6}  resumed from")
    print(head + "\n" + "-" * len(head))
    for name in names:
        r = _run(name, configs(global_every)[name], args, work, faults=True)
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        part = lambda key: mean([p[key] for p in r["parts"] if key in p])  # noqa: E731
        goodput = f"{reference['wall'] / r['wall']:.2f}" if r["rc"] == 0 else "-"  # a stopped run made no goodput to speak of
        print(f"{name:<14}{r['rc']:>4}{r['wall']:>9.1f}{goodput:>9}{len(r['kills']):>9}"
              f"{mean(r['lost']):>10.1f}{mean(r['recover']):>13.1f}{part('detect'):>8.1f}{part('imports'):>8.1f}"
              f"{part('setup'):>7.1f}{part('load'):>6.2f}  {', '.join(r['tiers']) or '-'}", flush=True)
    print("fail->step s = detect (launchers notice, new interpreters start) + imports + setup (init, model, data, "
          "selection, first step) + load (checkpoint read, rank 0)")
    if own_local_root:  # (each configuration's part is gone already; never a folder the user named)
        shutil.rmtree(args.local_root, ignore_errors=True)


if __name__ == "__main__":
    if "RANK" in os.environ:
        worker(Path(sys.argv[1]), sys.argv[2:])
    else:
        main()
