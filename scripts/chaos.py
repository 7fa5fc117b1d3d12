"""The chaos soak: ``scripts/bench_goodput.py --chaos MINUTES [--seed N] [--iterations N] [--work-dir DIR]
[--chaos-restart in-process|launcher] [--chaos-spares N]``.

The goodput worker (gpt_tiny, TP=1 on 2 simulated nodes x 1 rank, ``scripts/launch_nodes.sh
--max-restarts 50``) trains with LOCAL checkpoints every :data:`LOCAL_EVERY` iterations replicated to
the other node (``checkpoint.replication_factor=2``) and GLOBAL ones, while a seeded mixed stream of
faults (:mod:`chaos_faults`: rank SIGKILL, node replacement, a hung rank, a transient EIO on a
GLOBAL write, ENOSPC on one GLOBAL save, a damaged LOCAL file, a slow disk) hits it over the whole
run. No human acts: the ranks restart, the tiers retry or refuse, the resume picks the step.

How the ranks restart (``--chaos-restart``): ``in-process`` (the default) runs each simulated node
with ``--chaos-spares`` warm spares (``resiliency.restart=in-process``, ``resiliency.spare_ranks``
= 2 x that) and a memory step every iteration in node memory (``checkpoint.memory_dir`` under the
node-local root): a dead or hung rank's process is replaced by a spare of its node, which adopts
the memory step the dead process left, while the healthy rank keeps its process; a node whose
spares are used up falls back to the launchers' restart (new processes, new spares). ``launcher``:
every fault of a process restarts every rank as a new process (torchrun ``--max-restarts``).

In order:

1. a probe launch (failure-free, :data:`PROBE_ITERS` iterations) measures the seconds per
   iteration and to the first step, so that ``--iterations auto`` makes the soak last about
   ``MINUTES`` at the target goodput (:data:`TARGET`);
2. the failure-free reference: the same config and seed, no faults (its wall time is the
   goodput's numerator, its losses the ones to match);
3. the soak itself; then, per fault, who detected it, how it was handled (resumed from which tier
   and step, how long from the fault to the next new step, iterations redone), and the totals;
4. the checks: ``tierstack checkpoints verify`` on the GLOBAL directory and on each node's LOCAL
   directory passes; the final losses equal the reference's bit for bit; every GLOBAL checkpoint
   announced as published still exists and verifies (or was removed by retention after a newer
   one was published); in-process, nothing of the run is left in node memory at its end.

Under the launcher's restart a hang is caught by its peer's next collective: ``distributed.timeout_s`` and
``checkpoint.collective_timeout_s`` are :data:`HANG_TIMEOUT_S` here (the defaults, 600 and 120 s,
would keep a hung job waiting that long); torchrun's agent then stops the stopped rank with SIGTERM
and, as it cannot act on it, SIGKILLs it after torchrun's fixed 30 s shutdown wait. (Fixed: torch
2.13's ``LocalElasticAgent._stop_workers``, which a restart calls, runs ``_shutdown()`` with its
default of 30 s; ``--shutdown-timeout`` / ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` set only the wait of
the agent's own stop on a signal. Tried in a 10-minute soak: the hang still cost 54 s.) That makes
a hang the costliest fault there, so such soaks shorter than :data:`HANG_MIN_MINUTES` leave it out.
Under in-process restart NVRx's heartbeat timeout (3 s) finds it, and every soak has one.

Exit status 0 when every fault was handled and every check passed; 1 otherwise. A JSON summary
goes to ``<work-dir>/chaos_summary.json``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import chaos_checks
import chaos_faults
import goodput_launch
from goodput_records import records

LOCAL_EVERY = 5
PROBE_ITERS = 20
TARGET = 0.85  # goodput the soak is sized for (and judged against)
HANG_TIMEOUT_S = 15.0
HANG_MIN_MINUTES = 5.0
FAULTS_PER_MINUTE = 1.0
GLOBAL_EVERY_S = 20.0  # about this many seconds of training between GLOBAL saves


def soak_overrides(run: Path, iterations: int, global_every: int, args=None, local_root: Path = None) -> list[str]:
    """The config of the soak, the reference's too: LOCAL + replicas + GLOBAL, bounded waits; under
    ``--chaos-restart in-process`` also in-process restart with ``--chaos-spares`` spares per node
    and a memory step every iteration in node memory (``<local_root>/node_memory``)."""
    out = [*goodput_launch.base_overrides(run, iterations, 60.0), f"checkpoint.save_interval={global_every}",
           f"checkpoint.local_save_interval={LOCAL_EVERY}", "checkpoint.replication_factor=2",
           f"distributed.timeout_s={HANG_TIMEOUT_S:g}", f"checkpoint.collective_timeout_s={HANG_TIMEOUT_S:g}"]
    if in_process(args):
        out += [*goodput_launch.IN_PROCESS, f"resiliency.spare_ranks={2 * args.chaos_spares}",
                "checkpoint.memory_save_interval=1", f"checkpoint.memory_dir={memory_dir(local_root)}"]
    return goodput_launch.with_global_dir(run, out)


def in_process(args) -> bool:
    """The soak restarts in-process (``--chaos-restart in-process``, the default)."""
    return args is not None and getattr(args, "chaos_restart", "launcher") == "in-process"


def memory_dir(local_root: Path) -> Path:
    """Node memory of a launch whose node-local directories are under ``local_root`` (removed with them)."""
    return local_root / "node_memory"


def _launch(run: Path, overrides: list[str], local_root: Path, args, **kwargs) -> dict:
    """:func:`goodput_launch.launch` on 2 simulated nodes, each with its spares under in-process restart."""
    per_node = 1 + (args.chaos_spares if in_process(args) else 0)
    return goodput_launch.launch(run, overrides, local_root, processes_per_node=per_node, **kwargs)


def _probe(work: Path, local_root: Path, args) -> dict:
    """Seconds per iteration (median) and from the launch to the first step, failure-free."""
    run, local = work / "chaos_probe", local_root / "probe"
    r = _launch(run, soak_overrides(run, PROBE_ITERS, 10 * LOCAL_EVERY, args, local), local, args)
    steps = records(run / "steps_rank0.jsonl")
    if r["rc"] != 0 or len(steps) < 3:
        tail = (run / "launch.log").read_text(errors="replace").splitlines()[-40:]
        raise SystemExit("\n".join([*tail, f"chaos: the probe launch failed (rc {r['rc']}, {len(steps)} steps "
                                    f"recorded); the last lines of {run / 'launch.log'} above"]))
    gaps = sorted(b["t"] - a["t"] for a, b in zip(steps[1:], steps[2:]))  # the first step compiles
    start = min(s["t_created"] for s in records(run / "starts.jsonl") if "t_created" in s)  # not the load lines
    return {"step_s": gaps[len(gaps) // 2], "startup_s": steps[0]["t"] - start, "wall": r["wall"]}


def _plan(args, work: Path) -> dict:
    minutes = float(args.chaos)
    hang = minutes >= HANG_MIN_MINUTES or in_process(args)  # in-process: found by the heartbeat timeout in seconds
    kinds = chaos_faults.KINDS if hang else tuple(k for k in chaos_faults.KINDS if k != "hang")
    if args.iterations == "auto":
        probe = _probe(work, args.local_root, args)
        iterations = max(60, int((minutes * 60 * TARGET - probe["startup_s"]) / probe["step_s"]))
        print(f"chaos: probe {probe['step_s']:.2f}s per iteration, {probe['startup_s']:.1f}s to the first step", flush=True)
        step_s = probe["step_s"]
    else:
        iterations, step_s = int(args.iterations), 0.4
    global_every = max(2, round(GLOBAL_EVERY_S / step_s / LOCAL_EVERY)) * LOCAL_EVERY
    count = max(len(kinds), round(minutes * FAULTS_PER_MINUTE))
    faults = chaos_faults.schedule(args.seed, iterations, count, kinds, LOCAL_EVERY, global_every)
    return {"minutes": minutes, "iterations": iterations, "global_every": global_every, "faults": faults}


def _load() -> str:
    """The machine's load averages, for the reader of a timing figure (other work slows both runs)."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} {five:.1f} {fifteen:.1f} on {os.cpu_count()} CPUs"


def _print_faults(faults: list, rows: list[dict], t0: float) -> None:
    head = f"{'#':>2} {'t s':>6} {'step':>5} {'fault':<7}{'rank':>5}  {'resumed from':<13}{'fault->step s':>14}{'lost':>5}  ok  detected by / handled"
    print(head + "\n" + "-" * len(head))
    for i, (f, r) in enumerate(zip(faults, rows), 1):
        t = f"{f.t - t0:6.1f}" if f.t else f"{'-':>6}"
        sec = f"{r['seconds']:14.1f}" if r["seconds"] is not None else f"{'-':>14}"
        lost = f"{r['lost']:5d}" if r["lost"] is not None else f"{'-':>5}"
        print(f"{i:>2} {t} {f.step:>5} {f.kind:<7}{f.rank:>5}  {r['resumed']:<13}{sec}{lost}  "
              f"{'yes' if r['ok'] else 'NO ':<3} {r['detected']}; {r['handled']}", flush=True)


def main(args, work: Path) -> int:
    """The soak (see the module docstring); returns the exit status."""
    plan = _plan(args, work)
    faults, iterations = plan["faults"], plan["iterations"]
    how = (f"in-process restart, {args.chaos_spares} warm spare(s) per node, a memory step every iteration in node "
           "memory" if in_process(args) else "the launcher's restart")
    print(f"== chaos soak: gpt_tiny TP=1 on 2 simulated nodes x 1 rank, {iterations} iterations, LOCAL every "
          f"{LOCAL_EVERY} replicated to the other node, GLOBAL every {plan['global_every']}, {how}, seed {args.seed}; "
          f"{len(faults)} faults: " + ", ".join(f"{f.kind}@{f.step}/r{f.rank}" for f in faults), flush=True)
    ref_run, run = work / "chaos_reference", work / "chaos"
    ref_local = args.local_root / "reference"
    reference = _launch(ref_run, soak_overrides(ref_run, iterations, plan["global_every"], args, ref_local), ref_local, args)
    print(f"failure-free: {reference['wall']:.1f}s (rc {reference['rc']}); {_load()}", flush=True)
    fault_dir = work / "chaos_faults"
    shutil.rmtree(fault_dir, ignore_errors=True)
    env = chaos_faults.io_env(faults, run / "global", fault_dir)
    local_root = args.local_root / "chaos"
    injector = chaos_faults.Injector(faults, iterations, memory_dir(local_root) if in_process(args) else None)
    soak = _launch(run, soak_overrides(run, iterations, plan["global_every"], args, local_root), local_root, args,
                   limit_s=max(3 * reference["wall"], 600), injector=injector, env=env, keep_local=True)
    log = "\n".join([(run / "launch.log").read_text(errors="replace")] +
                    [p.read_text(errors="replace") for p in sorted((run / "logs").glob("*.log"))])
    fired = chaos_faults.fired_at(fault_dir)
    rows = [chaos_checks.judge(f, run, log, fired, in_process(args)) for f in faults]
    starts = records(run / "starts.jsonl") if (run / "starts.jsonl").exists() else []
    t0 = min((s["t_created"] for s in starts if "t_created" in s), default=0.0)  # the file has load lines too
    goodput = reference["wall"] / soak["wall"] if soak["rc"] == 0 else float("nan")
    print(f"soak: {soak['wall']:.1f}s (rc {soak['rc']}), goodput {goodput:.2f} of the failure-free run "
          f"(target >= {TARGET}); {_load()}; t s = seconds after the first rank started")
    _print_faults(faults, rows, t0)
    tiers = [run / "global"] + sorted(local_root.glob("node*/local"))
    left = [str(p) for p in memory_dir(local_root).rglob("*") if p.is_file()] if in_process(args) else []
    verified = chaos_checks.verify_tiers(tiers)
    shutil.rmtree(local_root, ignore_errors=True)
    checks = {f"verify {p}": (status == 0, text.strip().splitlines()[-1] if text.strip() else "")
              for p, status, text in verified}
    global_ok = verified[0][1] == 0
    checks["losses"] = chaos_checks.compare_losses(ref_run, run, iterations)
    checks["published"] = chaos_checks.published_kept(log, run / "global", global_ok)
    if in_process(args):  # the end of the run gives the node memory back
        checks["node memory"] = (not left, f"{len(left)} file(s) left in node memory" + (f": {left[:3]}" if left else ""))
    restarts = [r for r in rows if r["seconds"] is not None]
    handled = sum(r["ok"] for r in rows)
    print(f"totals: {len(faults)} faults, {handled} handled without a human, {len(restarts)} restarts "
          f"({sum(r['seconds'] for r in restarts):.1f}s from fault to next step, "
          f"{sum(r['lost'] for r in restarts)} iterations redone); goodput {goodput:.2f}")
    for name, (ok, text) in checks.items():
        print(f"check {'PASS' if ok else 'FAIL'} {name}: {text}")
    for p, status, text in verified:
        if status != 0:
            print(f"--- verify {p} (status {status}):\n{text}")
    ok = soak["rc"] == 0 and handled == len(faults) and all(c[0] for c in checks.values())
    summary = {"ok": ok, "rc": soak["rc"], "goodput": goodput, "reference_s": reference["wall"], "wall_s": soak["wall"],
               "iterations": iterations, "faults": [{**vars(f), **r} for f, r in zip(faults, rows)],
               "checks": {k: list(v) for k, v in checks.items()}}
    (work / "chaos_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"work dir {work}: chaos_summary.json, the runs' logs and checkpoints (chaos/, chaos_reference/); "
          "remove it when done", flush=True)
    return 0 if ok else 1
