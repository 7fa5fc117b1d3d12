"""How long a launcher takes to notice a dead or a hung rank and stop the others: measured figures.

Usage::

    .venv/bin/python scripts/bench_detection.py [--launchers torchrun,tierstack,ft_launcher] [--kills 2]
        [--hang-timeout-s 5] [--check-interval-s 5] [--no-hang] [--work-dir DIR]

Each launcher runs gpt_tiny on 2 ranks (mock data, LOCAL every 5, ``--max-restarts --kills``), with
``torch.distributed`` and tierstack as a user runs them:

- ``torchrun``: ``torchrun --standalone --nproc-per-node 2 --max-restarts N -m tierstack.cli pretrain gpt_tiny``
  (torchrun's defaults: ``--monitor-interval 0.1``);
- ``tierstack``: ``tierstack pretrain gpt_tiny --nproc-per-node 2 --max-restarts N`` (torchrun's own
  launcher in this process);
- ``ft_launcher``: nvidia-resiliency-ext's launcher with ``--ft-rank-heartbeat-timeout`` (its
  defaults: ``--monitor-interval 0.3``, ``--ft-workload-check-interval 5``; this script gives the
  check interval ``--check-interval-s``).

Each time the ranks have logged 7 iterations (past a sealed LOCAL save), rank 1 is SIGKILLed;
this process polls the ranks' processes every 5 ms and reads the launcher's log. Per kill:

- ``notice``: the kill to the launcher's "Sending process <pid> closing signal SIGTERM" line for
  the surviving rank (torchrun's log, microsecond stamps): the agent saw the dead rank (``-``:
  no such line, the survivor had ended by itself before the agent looked);
- ``stopped``: the kill to the last surviving rank of that start gone;
- ``respawn``: the kill to every new rank process seen (by this poll: an upper bound, about 10 ms late).

With ``ft_launcher`` (unless ``--no-hang``) one more launch SIGSTOPs rank 1 after 7 iterations
(a hung rank: no error, no exit) and gives, against ``--ft-rank-heartbeat-timeout``: ``killed``,
the stop to the hung rank gone (its rank monitor's SIGKILL), then ``stopped`` and ``respawn`` as above.

Prints one line per event and a table of medians. A figure, not a test: a loaded machine stretches
every column alike.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ITERS_BETWEEN_FAULTS = 7  # iterations logged before each fault: past a sealed LOCAL save (every 5)
POLL_S = 0.005
_SIGTERM_LINE = re.compile(r"^W(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*Sending process (\d+) closing signal SIGTERM", re.M)


def overrides(run: Path, iters: int) -> list[str]:
    return ["dataset.mock=true", f"train.train_iters={iters}", "train.eval_interval=null", "mlflow=null",
            "straggler=null", "logger.log_interval=1", "logger.progress_bar=false", f"logger.run_dir={run}",
            f"checkpoint.save={run}/checkpoints", f"checkpoint.save_interval={iters}",
            "checkpoint.local_save_interval=5", f"checkpoint.local_dir={run}/local"]


def command(launcher: str, run: Path, restarts: int, iters: int, hang_timeout_s: float, check_s: float) -> list[str]:
    """The launch command of ``launcher`` (see the module docstring)."""
    recipe = ["-m", "tierstack.cli", "pretrain", "gpt_tiny", *overrides(run, iters)]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts), *recipe]
    if launcher == "tierstack":
        return [sys.executable, "-m", "tierstack.cli", "pretrain", "gpt_tiny", "--nproc-per-node", "2",
                "--max-restarts", str(restarts), *overrides(run, iters)]
    if launcher == "ft_launcher":
        return [str(BIN / "ft_launcher"), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts),
                "--ft-initial-rank-heartbeat-timeout", "300", "--ft-rank-heartbeat-timeout", f"{hang_timeout_s:g}",
                "--ft-workload-check-interval", f"{check_s:g}", *recipe]
    raise ValueError(f"--launchers: unknown launcher {launcher!r} (torchrun, tierstack, ft_launcher)")


def ranks(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The rank processes of ``launcher``, by pid: its direct children that run tierstack with
    ``LOCAL_RANK`` set (not a rank's own children, not ft_launcher's rank monitors)."""
    out = {}
    for p in launcher.children(recursive=False):
        try:
            if "tierstack.cli" in " ".join(p.cmdline()) and "LOCAL_RANK" in p.environ() and p.status() != "zombie":
                out[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sigterm_times(log: str) -> dict[int, float]:
    """Unix time of torchrun's "Sending process <pid> closing signal SIGTERM" line, by pid."""
    year = dt.datetime.now().year
    out = {}
    for mmdd, hms, pid in _SIGTERM_LINE.findall(log):
        stamp = dt.datetime.strptime(f"{year}{mmdd} {hms}", "%Y%m%d %H:%M:%S.%f")
        out.setdefault(int(pid), stamp.timestamp())  # torchrun logs in local time
    return out


def iterations_logged(path: Path) -> int:
    return len(re.findall(r"\biter \d+/\d+", path.read_text(errors="replace")))


def launch(launcher: str, work: Path, faults: int, fault: str, hang_timeout_s: float, check_s: float,
           timeout_s: float = 600.0) -> list[dict]:
    """One launch with ``faults`` faults (``kill`` or ``stop``) of rank 1; returns one dict per fault."""
    run = work / f"{launcher}-{fault}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    iters = 10 + (ITERS_BETWEEN_FAULTS + 3) * faults
    log_path = run / "launch.log"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    events: list[dict] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(launcher, run, faults, iters, hang_timeout_s, check_s), stdout=log,
                                stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        top = psutil.Process(proc.pid)
        deadline = time.monotonic() + timeout_s
        try:
            seen = 0
            while len(events) < faults and proc.poll() is None and time.monotonic() < deadline:
                if iterations_logged(log_path) < seen + ITERS_BETWEEN_FAULTS:
                    time.sleep(0.05)
                    continue
                events.append(_fault(top, fault, deadline))
                seen = iterations_logged(log_path)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                for p in ranks(top).values():
                    p.kill()
                proc.wait()
    text = log_path.read_text(errors="replace")
    terms = sigterm_times(text)
    for e in events:
        t = min((terms[p] for p in e.pop("survivor_pids") if p in terms), default=None)
        e["notice"] = None if t is None else t - e["t"]
        e["rc"] = proc.returncode
    return events


def _fault(top: psutil.Process, fault: str, deadline: float) -> dict:
    """Kill (SIGKILL) or stop (SIGSTOP) rank 1 now; poll until the survivors are gone and new ranks run."""
    start = ranks(top)
    victim = next(p for p in start.values() if p.environ().get("LOCAL_RANK") == "1")
    others = [p for p in start.values() if p.pid != victim.pid]
    t0 = time.time()
    victim.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    event = {"fault": fault, "t": t0, "survivor_pids": [p.pid for p in others], "killed": None,
             "stopped": None, "respawn": None}
    while time.monotonic() < deadline:
        now = time.time()
        if event["killed"] is None and not alive(victim):
            event["killed"] = now - t0
        if event["stopped"] is None and not any(alive(p) for p in others) and not alive(victim):
            event["stopped"] = now - t0
        new = [pid for pid in ranks(top) if pid not in start]
        if event["respawn"] is None and len(new) == len(start):
            event["respawn"] = now - t0  # when this poll saw them (psutil's create time is off by up to 1 s)
        if event["stopped"] is not None and event["respawn"] is not None:
            return event
        time.sleep(POLL_S)
    return event


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launchers", default="torchrun,tierstack,ft_launcher")
    p.add_argument("--kills", type=int, default=2, help="SIGKILLs of rank 1 per launcher (one launch)")
    p.add_argument("--hang-timeout-s", type=float, default=5.0, help="ft_launcher's --ft-rank-heartbeat-timeout")
    p.add_argument("--check-interval-s", type=float, default=5.0,
                   help="ft_launcher's --ft-workload-check-interval (its default: 5)")
    p.add_argument("--no-hang", action="store_true", help="skip the SIGSTOP launch of ft_launcher")
    p.add_argument("--work-dir", default=None)
    args = p.parse_args()
    if args.kills < 1:
        p.error(f"--kills={args.kills}: give at least 1")
    if not args.hang_timeout_s > 0 or not args.check_interval_s > 0:
        p.error("--hang-timeout-s and --check-interval-s must be > 0 (seconds)")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_detection."))
    launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    for name in launchers:
        command(name, work, 1, 1, 1.0, 1.0)  # an unknown name fails before any launch
    rows = []
    for name in launchers:
        plan = [("kill", args.kills)] + ([("stop", 1)] if name == "ft_launcher" and not args.no_hang else [])
        for fault, n in plan:
            events = launch(name, work, n, fault, args.hang_timeout_s, args.check_interval_s)
            for e in events:
                print(f"{name:<12} {fault:<5} at {e['t']:.3f} rc={e['rc']} notice {fmt(e['notice'])} s, rank gone "
                      f"{fmt(e['killed'])} s, survivors stopped {fmt(e['stopped'])} s, new ranks {fmt(e['respawn'])} s",
                      flush=True)
            rows.append((name, fault, events))
    print(f"\n== detection: gpt_tiny, 2 ranks on this machine ({os.cpu_count()} CPUs); seconds from the fault "
          f"(median over faults); work dir {work}")
    print(f"{'launcher':<12}{'fault':<7}{'n':>3}{'notice':>9}{'gone':>8}{'stopped':>9}{'respawn':>9}")
    for name, fault, events in rows:
        def med(key):
            vals = [e[key] for e in events if e[key] is not None]
            return statistics.median(vals) if vals else None
        print(f"{name:<12}{fault:<7}{len(events):>3}{fmt(med('notice')):>9}{fmt(med('killed')):>8}"
              f"{fmt(med('stopped')):>9}{fmt(med('respawn')):>9}")
    print("notice: to the launcher's SIGTERM to the surviving rank; gone: the faulty rank's process ended "
          f"(kill: at once; stop: its rank monitor, --ft-rank-heartbeat-timeout {args.hang_timeout_s:g} s, "
          f"--ft-workload-check-interval {args.check_interval_s:g} s); stopped: every rank of that start ended; "
          "respawn: the new ranks' processes exist")


if __name__ == "__main__":
    main()
