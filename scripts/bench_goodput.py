"""Goodput under failures: the same training on 2 simulated nodes, with ranks killed on a schedule.

Usage::

    .venv/bin/python scripts/bench_goodput.py [--iterations auto] [--fault-every-s auto] [--fault-factor 4]
        [--global-every auto] [--faults 3] [--seed 0] [--configs none,global,local_global,replicated,auto] [--timeout-factor 3]
        [--work-dir DIR] [--local-root auto] [--inprocess-local-every 5] [--inprocess-memory-every 1]
    .venv/bin/python scripts/bench_goodput.py --chaos MINUTES [--seed N] [--chaos-restart in-process|launcher]
        [--chaos-spares 2]   (the chaos soak: scripts/chaos.py)

First a calibration launch (``local_global``, two SIGKILLs, each after a sealed LOCAL save) measures
the seconds per iteration and the restart time (kill to the first new step, the mean of the two) on
this machine, now.
``--fault-every-s auto`` is ``--fault-factor`` times that restart time (a fault interval near the
restart time leaves no progress at all). The fault interval is fixed then, once, and every row
runs with that same number of seconds (the output says so): a row whose restart is cheaper shows
it as goodput, not as a shorter fault interval. ``--iterations auto`` runs long enough for about
``--faults`` failures per configuration. The expected total time is printed before the runs.

Each configuration runs the main job's model (gpt_tiny, TP=1 on 2 simulated nodes x 1 rank, micro batch 4 so the global batch of 8 is the main job's, on
mock data so that no rank preprocesses a corpus,
``scripts/launch_nodes.sh --max-restarts 50``) for ``--iterations`` iterations while a seeded fault
injector SIGKILLs a random rank every ``--fault-every-s`` seconds of the run, until the last
iteration is done; in ``replicated`` it also wipes that rank's node-local directory (a replaced node). A failure-free run of the same
iterations (no checkpoints) gives the reference time. The rows are the entries of :func:`configs`
(overrides, and whether a failure also replaces the node); a new kind of restart is one more entry. Printed side by side, one row per
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

The time from a failure to the first new step is split (columns ``detect``, ``process`` (start),
``imports``, ``setup``, ``load``: see :func:`goodput_records.split`). The README's "Goodput" section shows a run of this script.

This process is also the worker (``RANK`` set by torchrun): it trains with ``pretrain``, records
each iteration and its start as :mod:`goodput_records` says, and writes its pid and node-local
directory to ``<run>/rank<r>.json`` at start, which is how the injectors find their victims.
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
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).parent))  # the sibling modules, also when loaded by path (tests)
import goodput_launch  # noqa: E402
from goodput_records import PARTS, analyse, finished, records  # noqa: E402

LOCAL_EVERY = 5  # LOCAL interval of the fixed-interval configurations (iterations)
NONE_LIMIT_FACTOR = 2.0  # ``none`` is stopped at this many failure-free times (see the module docstring)


@dataclass(frozen=True)
class Row:
    """One configuration of the table: its overrides, what a failure is, and how the ranks are laid out."""

    overrides: list[str] = field(default_factory=list)
    wipe_node: bool = False  # the killed rank's node-local directory (and node memory) is emptied too (a replaced node)
    fault: str = "kill"  # "kill": SIGKILL of the rank's process; "raise": the rank raises after its step
    nodes: int = 2  # simulated nodes (one torchrun agent each)
    spares: int = 0  # warm spare processes per node (resiliency.spare_ranks is nodes x this)

    def processes_per_node(self) -> int:
        return 2 // self.nodes + self.spares  # 2 training ranks in every row


IN_PROCESS = goodput_launch.IN_PROCESS


def configs(global_every: int, faults: int = 3, inprocess_local_every: int = LOCAL_EVERY,
            inprocess_memory_every: int = 1) -> dict[str, Row]:
    """The rows, GLOBAL every ``global_every`` iterations where they save. ``none`` keeps nothing,
    so a restart there starts over (``allow_fresh_start_on_invalid``: the node-local run file of the
    first start is not a checkpoint to refuse a fresh start for). A new way of restarting is one
    more entry here.

    In-process restart (``resiliency.restart=in-process``) has three rows, on the 2 nodes and
    replication of ``replicated``. ``inprocess``: a rank raises (its process lives on), every rank
    restarts in its own process. ``inprocess_spare``: a rank's process is SIGKILLed and a warm spare
    of its node takes its rank (``spares_per_node`` each: a row sees a fault every fixed interval
    until its last iteration, so a slow row sees more than ``faults``, and the faults hit random
    ranks; a node with none left falls back to the launchers' restart, as designed, but that is not
    what the row is there to measure). ``inprocess_node``: the same with a node replacement, as in
    ``replicated``: the killed rank's node-local directory and node memory are wiped too, so its
    spare resumes from the replica its peer node holds.
    ``inprocess_local_every`` is their LOCAL interval (``--inprocess-local-every``; the other rows'
    by default, so that the rows differ in the restart only): at 1 every failure loses at most the
    step in flight, and every step pays a LOCAL save (README, "In-process restart").
    ``inprocess_memory_every``: their memory-step interval (``checkpoint.memory_save_interval``,
    ``--inprocess-memory-every``; 0: none): a step staged into host memory with no file, which a
    rank that raised resumes with its healthy peers (at most the step in flight lost). Their buffers
    are in node memory (``checkpoint.memory_dir`` under ``--local-root``, a tmpfs by default), so
    the spare that replaces a killed rank adopts the dead process's memory step: a kill loses at
    most the step in flight too. (A lost node would take that memory with it: its ranks resume
    the last file step.)
    """
    g = f"checkpoint.save_interval={global_every}"
    local = [g, f"checkpoint.local_save_interval={LOCAL_EVERY}"]
    replicated = [*local, "checkpoint.replication_factor=2"]
    inproc = [g, f"checkpoint.local_save_interval={inprocess_local_every}"]
    if inprocess_memory_every:
        inproc.append(f"checkpoint.memory_save_interval={inprocess_memory_every}")
    spares_per_node = (faults + 3) // 2
    spared = [*inproc, *IN_PROCESS, f"resiliency.spare_ranks={2 * spares_per_node}"]
    return {
        "none": Row(["checkpoint.allow_fresh_start_on_invalid=true"]),
        "global": Row([g]),
        "local_global": Row(local),
        "replicated": Row(replicated, wipe_node=True),
        "auto": Row([g, "checkpoint.local_save_interval=auto"]),
        "inprocess": Row([*inproc, "checkpoint.replication_factor=2", *IN_PROCESS], fault="raise"),
        "inprocess_spare": Row([*spared, "checkpoint.replication_factor=2"], spares=spares_per_node),
        "inprocess_node": Row([*spared, "checkpoint.replication_factor=2"], spares=spares_per_node, wipe_node=True),
    }


NAMES = tuple(configs(LOCAL_EVERY))


class _LoadTimes(logging.Handler):
    """Appends the checkpoint manager's "resumed from ... in N s" line, as numbers, to ``starts``."""

    def __init__(self, starts: Path):
        super().__init__(level=logging.INFO)
        self.starts = starts

    def emit(self, record: logging.LogRecord) -> None:
        m = re.match(r"resumed from (\w+) checkpoint of step (\d+) at .* in ([\d.]+)s", record.getMessage())
        if m:
            with open(self.starts, "a") as f:
                f.write(json.dumps({"rank": int(os.environ["RANK"]), "pid": os.getpid(), "t": time.time(), "tier": m.group(1),
                                    "step": int(m.group(2)), "load_s": float(m.group(3))}) + "\n")


def worker(out: Path, overrides: list[str]) -> None:
    """One rank: the main job's model, recording each iteration (end time, loss) and, per process,
    when it was created, when its interpreter started, when the imports were done and how long the
    checkpoint load took (:mod:`goodput_records`)."""
    import psutil

    from tierstack import pretrain
    from tierstack.recipes import gpt_tiny_config

    t_imported = time.time()
    cfg = gpt_tiny_config().apply_overrides(overrides)
    rank = int(os.environ["RANK"])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "starts.jsonl", "a") as f:
        f.write(json.dumps({"rank": rank, "pid": os.getpid(), "t_created": psutil.Process().create_time(),
                            "t_process": _T_PROCESS, "t_imported": t_imported}) + "\n")
    # (the line comes from checkpointing.resuming; on the package's logger, wherever it moves to next)
    logging.getLogger("tierstack.checkpointing").addHandler(_LoadTimes(out / "starts.jsonl"))

    def on_step(ts, result):
        rank = int(os.environ["RANK"])  # under in-process restart, this attempt's rank
        with open(out / f"steps_rank{rank}.jsonl", "a") as record:
            record.write(json.dumps({"t": time.time(), "step": ts.step, "pid": os.getpid(), "loss": result.loss}) + "\n")
        raise_file = out / f"raise.rank{rank}"
        if raise_file.exists():  # the injector of a "raise" row asks this rank to fail
            raise_file.unlink()
            with open(out / "raised.jsonl", "a") as f:  # the failure's time (the injector's is a step earlier)
                f.write(json.dumps({"t": time.time(), "rank": rank, "step": ts.step}) + "\n")
            raise RuntimeError(f"injected failure on rank {rank} after step {ts.step}")

    def train(config):
        rank = int(os.environ["RANK"])  # each attempt writes who holds the rank now (the injector's victim)
        (out / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "local_dir": config.checkpoint.local_dir}))
        if config.resiliency.in_process:
            with open(out / "starts.jsonl", "a") as f:
                f.write(json.dumps({"rank": rank, "pid": os.getpid(), "t_attempt": time.time()}) + "\n")
        return pretrain(config, on_step=on_step)

    if cfg.resiliency.in_process:
        from tierstack.resiliency import in_process

        sys.exit(in_process.run(cfg, train, rehearse=pretrain))
    train(cfg)


def _inject(run: Path, every_s: float, rng: random.Random, row: Row, stop: threading.Event, kills: list,
            last_step: int, memory_dir: Optional[Path] = None) -> None:
    """Every ``every_s`` seconds, fail a random rank as ``row.fault`` says (SIGKILL, or ask it to
    raise after its next step; with ``row.wipe_node`` also empty its node-local directory), until
    the run has recorded its last iteration: a fault after that would only hit a job that is done
    (and leave one node's agent waiting in a rendezvous the other has left)."""
    while not stop.wait(every_s):
        if finished(run, last_step):
            return
        rank = rng.randrange(2)
        info = json.loads((run / f"rank{rank}.json").read_text()) if (run / f"rank{rank}.json").exists() else None
        if info is None:
            continue
        try:
            if row.fault == "raise":
                (run / f"raise.rank{rank}").touch()
            else:
                os.kill(info["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        if row.wipe_node and info["local_dir"]:
            shutil.rmtree(Path(info["local_dir"]), ignore_errors=True)
            if memory_dir is not None:  # and the node's memory: the memory steps its processes left there
                from tierstack.checkpointing import node_memory

                shutil.rmtree(node_memory.rank_dir(str(memory_dir), Path(info["local_dir"]), rank).parent,
                              ignore_errors=True)
        kills.append({"t": time.time(), "rank": rank})


def _run(name: str, row: Row, args, work: Path, faults: bool, injector=None) -> dict:
    """One launch of ``row``; with ``faults`` the seeded injector kills a rank every ``args.fault_every_s``
    seconds (the one fixed interval of every row), or ``injector(run, stop)`` does its own kills."""
    run = work / name
    kills: list = []
    overrides = goodput_launch.with_global_dir(
        run, [*goodput_launch.base_overrides(run, args.iterations, args.fault_every_s), *row.overrides])
    memory_dir = None
    if any(o.startswith("checkpoint.memory_save_interval=") for o in row.overrides):  # in node memory (a tmpfs by
        memory_dir = args.local_root / name / "node_memory"  # default): spares adopt them
        overrides.append(f"checkpoint.memory_dir={memory_dir}")
    if injector is None and faults:
        rng = random.Random(args.seed)
        injector = lambda run, stop: _inject(run, args.fault_every_s, rng, row, stop, kills,  # noqa: E731
                                             args.iterations, memory_dir)
    limit_s = args.limit_s
    if name == "none" and limit_s is not None and args.reference_s is not None:
        limit_s = min(limit_s, NONE_LIMIT_FACTOR * args.reference_s)
    r = goodput_launch.launch(run, overrides, args.local_root / name, limit_s=limit_s, injector=injector,
                              nodes=row.nodes, processes_per_node=row.processes_per_node())
    if row.fault == "raise":  # a failure is the raise itself, after the step the injector's request met
        kills = [{"t": x["t"], "rank": x["rank"]} for x in records(run / "raised.jsonl")]
    return {"name": name, **r, "kills": kills, **analyse(run, kills)}


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
            done = records(run / "steps_rank0.jsonl")
            pid = json.loads(info.read_text())["pid"] if info.exists() else None
            if len(done) >= (len(kills) + 1) * (LOCAL_EVERY + 2) and pid is not None and pid not in killed:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.add(pid)  # rank1.json names it until the restarted rank writes its own
                kills.append({"t": time.time(), "rank": 1})

    r = _run("calibration", configs(6 * LOCAL_EVERY)["local_global"], cal, work, faults=False, injector=kill_after_seals)
    steps = records(run / "steps_rank0.jsonl")
    first = [s["t"] for s in steps if not kills or s["t"] < kills[0]["t"]]
    gaps = sorted(b - a for a, b in zip(first, first[1:]))
    step_s = gaps[len(gaps) // 2] if gaps else float("nan")
    restarts = [next((s["t"] - k["t"] for s in steps if s["t"] > k["t"]), float("nan")) for k in kills]
    restart_s = sum(restarts) / len(restarts) if restarts else float("nan")
    return {"rc": r["rc"], "step_s": step_s, "restart_s": restart_s, "restarts": restarts, "wall": r["wall"]}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", default="auto",
                   help="iterations per configuration; auto: enough for --faults failures at the fault interval")
    p.add_argument("--fault-every-s", default="auto",
                   help="seconds between kills, the same for every row; auto: --fault-factor times the process "
                        "restart time measured once by the calibration")
    p.add_argument("--fault-factor", type=float, default=4.0)
    p.add_argument("--global-every", default="auto",
                   help="GLOBAL interval (iterations); auto: about half the fault interval, in LOCAL intervals "
                        "(GLOBAL saved twice between failures: far more often than on a real cluster)")
    p.add_argument("--faults", type=int, default=3, help="failures per configuration aimed at by --iterations auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inprocess-local-every", type=int, default=LOCAL_EVERY,
                   help="LOCAL interval (iterations) of the in-process rows (default: the other rows')")
    p.add_argument("--inprocess-memory-every", type=int, default=1,
                   help="memory-step interval (iterations, checkpoint.memory_save_interval) of the in-process "
                        "rows; 0: none")
    p.add_argument("--configs", default=",".join(NAMES))
    p.add_argument("--timeout-factor", type=float, default=3.0)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--local-root", default="auto",
                   help="where the simulated nodes' node-local directories go; auto: a folder in /dev/shm "
                        "(tmpfs: node memory, where LOCAL checkpoints are meant to live) when it exists, else the work dir")
    p.add_argument("--chaos", type=float, default=None, metavar="MINUTES",
                   help="run the chaos soak instead (scripts/chaos.py): a seeded mixed stream of faults for about "
                        "MINUTES minutes, then checks and totals")
    p.add_argument("--chaos-restart", choices=("in-process", "launcher"), default="in-process",
                   help="how the soak's ranks come back: in-process restart with warm spares on each node, memory "
                        "steps in node memory (default), or the launcher's restart (new processes)")
    p.add_argument("--chaos-spares", type=int, default=2,
                   help="warm spares per simulated node under --chaos-restart in-process (a node with none left "
                        "falls back to the launcher's restart, which starts new ones)")
    return p


def _local_root(args, work: Path) -> tuple[Path, bool]:
    """Where the node-local directories go, and whether this run made that folder (removed at the end)."""
    shm = Path("/dev/shm")
    if args.local_root != "auto":
        return Path(args.local_root), False
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"tierstack_bench_goodput.{os.getpid()}", True
    return work / "node_local", True


def _print_row(name: str, r: dict, reference_wall: float) -> None:
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    parts = "".join(f"{mean([p[k] for p in r['parts'] if k in p]):>{max(7, len(k) + 1)}.{2 if k == 'load' else 1}f}"
                    for k in PARTS)
    goodput = f"{reference_wall / r['wall']:.2f}" if r["rc"] == 0 else "-"  # a stopped run made no goodput to speak of
    print(f"{name:<14}{r['rc']:>4}{r['wall']:>9.1f}{goodput:>9}{len(r['kills']):>9}"
          f"{mean(r['lost']):>10.1f}{mean(r['recover']):>13.1f}{parts}  {', '.join(r['tiers']) or '-'}", flush=True)


def main() -> None:
    """The goodput table (or, with ``--chaos``, the chaos soak); see the module docstring."""
    p = _parser()
    args = p.parse_args()
    args.limit_s = args.reference_s = None
    work = Path(args.work_dir or f"/tmp/bench_goodput.{os.getpid()}")
    args.local_root, own_local_root = _local_root(args, work)
    if args.chaos is not None:
        import chaos

        status = chaos.main(args, work)
        if own_local_root:
            shutil.rmtree(args.local_root, ignore_errors=True)
        sys.exit(status)
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
    auto = args.fault_every_s == "auto"
    args.fault_every_s = args.fault_factor * cal["restart_s"] if auto else float(args.fault_every_s)
    args.iterations = (int(args.faults * args.fault_every_s / cal["step_s"]) + 1 if args.iterations == "auto"
                       else int(args.iterations))
    global_every = (max(2, round(args.fault_every_s / cal["step_s"] / 2 / LOCAL_EVERY)) * LOCAL_EVERY
                    if args.global_every == "auto" else int(args.global_every))
    estimate = (1 + len(names)) * (cal["wall"] + args.iterations * cal["step_s"]) + len(names) * args.faults * cal["restart_s"]
    how = (f"{args.fault_factor:g} x the process restart's {cal['restart_s']:.1f}s measured by the calibration"
           if auto else "--fault-every-s")
    print(f"fault interval: {args.fault_every_s:.1f}s, fixed for every row ({how}); {args.iterations} iterations per "
          f"configuration; expected total about {estimate / 60:.0f} min", flush=True)
    reference = _run("failure_free", Row(), args, work, faults=False)
    args.limit_s, args.reference_s = args.timeout_factor * reference["wall"], reference["wall"]
    print(f"== goodput: gpt_tiny TP=1 on 2 simulated nodes x 1 rank, {args.iterations} iterations, a rank killed every "
          f"{args.fault_every_s:.1f}s in every row (seed {args.seed}); LOCAL every {LOCAL_EVERY}, GLOBAL every {global_every}")
    print(f"failure-free: {reference['wall']:.1f}s (rc {reference['rc']}); work dir {work}; "
          f"node-local directories under {args.local_root}")
    head = (f"{'configuration':<14}{'rc':>4}{'wall s':>9}{'goodput':>9}{'failures':>9}{'lost/fail':>10}{'fail->step s':>13}"
            + "".join(f"{k:>{max(7, len(k) + 1)}}" for k in PARTS) + "  resumed from")
    print(head + "\n" + "-" * len(head))
    rows = configs(global_every, args.faults, args.inprocess_local_every, args.inprocess_memory_every)
    for name in names:
        _print_row(name, _run(name, rows[name], args, work, faults=True), reference["wall"])
    print("fail->step s = detect (launchers notice, stop the other ranks, meet again) + process (new interpreter "
          "start) + imports + setup (init, model, data, selection, first step) + load (checkpoint read, rank 0)")
    if own_local_root:  # (each configuration's part is gone already; never a folder the user named)
        shutil.rmtree(args.local_root, ignore_errors=True)


if __name__ == "__main__":
    if "RANK" in os.environ:
        worker(Path(sys.argv[1]), sys.argv[2:])
    else:
        main()
