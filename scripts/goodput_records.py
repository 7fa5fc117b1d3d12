"""What the ranks of a goodput or chaos launch record, and what is read from it afterwards.

Every rank (``scripts/bench_goodput.py`` run by torchrun) appends JSON lines to its run directory:

- ``steps_rank<r>.jsonl``: ``{"t", "step", "pid", "loss"}`` per iteration (``t``: unix seconds at
  the end of the step; ``loss``: the step's training loss, nats, as Python's float repr, which is
  exact);
- ``starts.jsonl``: per process ``{"rank", "pid", "t_created", "t_process", "t_imported"}`` (unix
  seconds: the process was created by its launcher, its interpreter ran the script's first line,
  its imports were done), under in-process restart ``{"rank", "pid", "t_attempt"}`` at each attempt's
  start, and, once it resumed, ``{"rank", "pid", "t", "tier", "step", "load_s"}``;
- ``rank<r>.json``: ``{"pid", "local_dir"}`` of the process that holds rank ``r`` now (the injectors' victim).

The functions here read those files while the ranks still write them, and split the time from a
failure to the first new step into its parts (:func:`split`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

PARTS = ("detect", "process", "imports", "setup", "load")  # the split of fail->first step, in order


def records(path: Path) -> list[dict]:
    """The JSON lines of ``path``; none while it does not exist. A last line that does not parse
    is one a rank is still writing (or was killed writing): it is left out.

    Raises:
        json.JSONDecodeError: a damaged line before the last.
    """
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = [json.loads(x) for x in lines[:-1]]
    try:
        out += [json.loads(x) for x in lines[-1:]]
    except json.JSONDecodeError:
        pass
    return out


def finished(run: Path, last_step: int) -> bool:
    """Rank 0 recorded ``last_step``: the training is done (what remains is the final save and exit)."""
    steps = records(run / "steps_rank0.jsonl")
    return bool(steps) and steps[-1]["step"] >= last_step


def final_losses(run: Path) -> dict[int, float]:
    """Step -> loss of rank 0's final trajectory: where a step ran more than once (it was redone
    after a restart), its last run counts."""
    return {s["step"]: s["loss"] for s in records(run / "steps_rank0.jsonl") if "loss" in s}


def analyse(run: Path, kills: list) -> dict:
    """Per failure (``kills``: ``{"t": unix seconds}`` each): iterations lost (last step before it
    minus the step resumed from), seconds to the first new step and their :func:`split`; and the
    tier each restart resumed from, from rank 0's load record between the failure and that step
    (``scratch``: none, a fresh start). One entry per failure, whatever reaches the console (under
    in-process restart several ranks' lines do)."""
    steps = records(run / "steps_rank0.jsonl")
    starts = records(run / "starts.jsonl")
    loads = [s for s in starts if "tier" in s and s["rank"] == 0]
    lost, recover, parts, tiers = [], [], [], []
    for i, k in enumerate(kills):
        cut = restart_time(k["t"], kills[i + 1]["t"] if i + 1 < len(kills) else None, starts)
        before = [s for s in steps if s["t"] < cut]
        after = [s for s in steps if s["t"] > cut]
        if before and after:
            lost.append(before[-1]["step"] - (after[0]["step"] - 1))
            recover.append(after[0]["t"] - k["t"])
            parts.append(split(k["t"], after[0]["t"], starts))
            load = [s for s in loads if k["t"] < s["t"] <= after[0]["t"]]
            tiers.append(f"{load[0]['tier'].upper()} {load[0]['step']}" if load else "scratch")
    return {"lost": lost, "recover": recover, "parts": parts, "tiers": tiers}


def restart_time(t_fail: float, t_next: Optional[float], starts: list) -> float:
    """When rank 0's work after the failure at ``t_fail`` begins: its first new process or new
    attempt after it (before the next failure at ``t_next``), else ``t_fail``. A step that rank 0
    records between the failure and that start belongs to the attempt that failed (under in-process
    restart a rank that raised after step N leaves its peers finishing step N a few milliseconds
    later): it is work lost, not the restart's first step (counted as that, a run read 0 steps
    lost and 0.05 s to the first step)."""
    new = [s.get("t_process", s.get("t_attempt")) for s in starts if s.get("rank") == 0]
    new = [t for t in new if t is not None and t > t_fail and (t_next is None or t < t_next)]
    return min(new) if new else t_fail


def split(t_fail: float, t_step: float, starts: list) -> dict:
    """Failure to the first new step (unix seconds), in the parts of :data:`PARTS` (seconds), over
    the processes that started in between (the restarted ranks; the last one of each part counts):

    - ``detect``: the launchers notice the failure, stop the other ranks and meet again, to the
      creation of the last new process;
    - ``process``: process start: a new interpreter up to the script's first line;
    - ``imports``: torch, megatron-core, tierstack;
    - ``load``: the checkpoint load (rank 0's log line);
    - ``setup``: the rest (distributed init, model, optimizer, data, resume selection, first step).

    An in-process restart starts no process: its ranks record each attempt's start instead
    (``{"rank", "pid", "t_attempt"}``); then ``detect`` runs to the last attempt's start (NVRx
    notices, aborts, meets in its barrier, assigns the ranks), ``process`` and ``imports`` are 0, and
    ``load`` is rank 0's load line of that attempt. Empty when neither is found in between.
    """
    new = [s for s in starts if "t_process" in s and t_fail < s["t_process"] < t_step]
    if not new:
        attempts = [s["t_attempt"] for s in starts if "t_attempt" in s and t_fail < s["t_attempt"] < t_step]
        if not attempts:
            return {}
        t_att = max(attempts)
        load = sum(s["load_s"] for s in starts if "load_s" in s and s["rank"] == 0 and t_att < s["t"] < t_step)
        return {"detect": t_att - t_fail, "process": 0.0, "imports": 0.0, "load": load, "setup": t_step - t_att - load}
    t_proc = max(s["t_process"] for s in new)
    t_created = max(s.get("t_created", s["t_process"]) for s in new)
    t_imp = max(s["t_imported"] for s in new)
    pids = {s["pid"] for s in new}
    load = sum(s["load_s"] for s in starts if "load_s" in s and s["pid"] in pids and s["rank"] == 0)
    return {"detect": t_created - t_fail, "process": t_proc - t_created, "imports": t_imp - t_proc, "load": load,
            "setup": t_step - t_imp - load}
