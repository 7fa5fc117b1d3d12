"""What the chaos soak (``scripts/chaos.py``) concludes from a finished launch: how each fault was
handled, whether every tier verifies, whether the losses equal the failure-free run's, and whether
every GLOBAL checkpoint announced as published is still there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from chaos_faults import Fault
from goodput_records import final_losses, records

DETECTED_BY = {
    "kill": "rank {r}'s agent (the process exited)",
    "node": "rank {r}'s agent (the process exited)",
    "damage": "rank {r}'s agent; the file by its checksum at resume",
    "hang": "rank {p}'s collective timeout (distributed.timeout_s), then rank {r}'s agent",
    "eio": "rank {r}'s GLOBAL write (EIO, transient)",
    "enospc": "rank {r}'s GLOBAL write (ENOSPC, permanent), agreed on every rank",
    "slow": "nobody needs to: the write ends late",
}


DETECTED_IN_PROCESS = {  # under in-process restart, the process faults
    "kill": "rank {r}'s NVRx monitor process (the process exited)",
    "node": "rank {r}'s NVRx monitor process (the process exited)",
    "damage": "rank {r}'s NVRx monitor process; the memory step by its CRC, the file by its checksum at resume",
    "hang": "NVRx's heartbeat timeout on rank {r} (resiliency.heartbeat_timeout_s), which killed it",
}


def judge(f: Fault, run: Path, log: str, fired: dict[str, float], in_process: bool = False) -> dict:
    """How ``f`` was handled: ``{"ok", "detected", "handled", "resumed", "seconds", "lost"}``
    (``seconds``: fault to the first new step for a process fault; ``lost``: iterations redone).
    ``in_process``: the launch restarts in-process (spares, memory steps in node memory)."""
    detected = (DETECTED_IN_PROCESS if in_process and f.kind in DETECTED_IN_PROCESS else DETECTED_BY)[f.kind]
    row = {"ok": False, "detected": detected.format(r=f.rank, p=1 - f.rank), "handled": "",
           "resumed": "-", "seconds": None, "lost": None}
    if f.kind in ("kill", "node", "hang", "damage"):
        return _judge_restart(f, run, log, row, in_process)
    t = fired.get(f.id)
    if t is None:
        row["handled"] = "never fired (the run did not touch its path)"
        return row
    f.t = t
    s = f.step
    if f.kind == "eio":
        retried = re.search(rf"retrying.*iter_{s:07d}.*EIO|EIO.*iter_{s:07d}.*retrying", log) is not None
        published = f"GLOBAL checkpoint of step {s} published" in log
        row["ok"] = retried and published
        row["handled"] = ("retried, then published" if row["ok"] else
                          f"retried: {retried}, published: {published}")
    elif f.kind == "enospc":
        refused = [ln for ln in log.splitlines() if f"checkpoint of step {s} NOT" in ln and "ENOSPC" in ln]
        after = log[log.find(refused[0]):] if refused else ""
        later = sorted({int(m) for m in re.findall(r"GLOBAL checkpoint of step (\d+) published", after) if int(m) > s})
        row["ok"] = bool(refused)
        row["handled"] = ("not published, training went on; " + (f"next GLOBAL save published: step {later[0]}"
                          if later else "no later GLOBAL save ran") if refused
                          else "no 'NOT saved/published ... ENOSPC' line for that step")
    elif f.kind == "slow":
        m = re.search(rf"LOCAL checkpoint of step {s} sealed.*durable after ([\d.]+)s", log)
        nxt = re.search(r"LOCAL checkpoint of step \d+ handed to the writer \(blocked ([\d.]+)s\)", log[m.end():]) if m else None
        row["ok"] = m is not None
        row["handled"] = ((f"sealed, durable after {m.group(1)}s; the next LOCAL save waited "
                           f"{nxt.group(1) if nxt else '?'}s for it") if m else "step not sealed (a restart came first?)")
    return row


def _how_restarted(f: Fault, run: Path, starts: list, t_next: float) -> str:
    """Who took the rank between the fault and the next step: new processes (the launchers'
    restart), or, in-process, a spare (which node's) while the peer kept its process."""
    if any(s.get("t_created", 0) > f.t for s in starts if s.get("t_created", 0) < t_next):
        return "restarted by the launchers (new processes)"
    mine = [s for s in records(run / f"steps_rank{f.rank}.jsonl") if s["t"] > f.t][:1]
    peer = records(run / f"steps_rank{1 - f.rank}.jsonl")
    kept = [s["pid"] for s in peer if s["t"] < f.t][-1:] == [s["pid"] for s in peer if s["t"] > f.t][:1]
    who = f"a spare (pid {mine[0]['pid']}) took rank {f.rank}" if mine else f"rank {f.rank} came back"
    return f"in-process: {who}, rank {1 - f.rank} " + ("kept its process" if kept else "changed process too")


def _judge_restart(f: Fault, run: Path, log: str, row: dict, in_process: bool = False) -> dict:
    if f.t is None:
        row["handled"] = "not injected (the run ended first)"
        return row
    steps = records(run / "steps_rank0.jsonl")
    before = [s for s in steps if s["t"] < f.t]
    after = [s for s in steps if s["t"] > f.t]
    starts = records(run / "starts.jsonl")
    loads = [s for s in starts if "tier" in s and s["rank"] == 0 and s["t"] > f.t]
    if not after:
        row["handled"] = "no step after it: the job did not recover"
        return row
    row["seconds"] = after[0]["t"] - f.t
    resumed = after[0]["step"] - 1
    row["lost"] = (before[-1]["step"] if before else 0) - resumed
    row["resumed"] = f"{loads[0]['tier'].upper()} {loads[0]['step']}" if loads else "scratch"
    row["ok"] = True
    how = _how_restarted(f, run, starts, after[0]["t"]) if in_process else "restarted by the launchers"
    row["handled"] = how + "; " + (f.note or "rank killed" if f.kind != "hang" else "rank stopped")
    if f.kind == "hang" and in_process:
        m = re.search(r"Interruption\.(SOFT|HARD)_TIMEOUT affecting ranks", log)
        row["handled"] += (f"; NVRx's {m.group(1)}_TIMEOUT in the logs" if m
                           else "; no NVRx timeout line in the logs (who noticed it?)")
    elif f.kind == "hang":
        timeouts = len(re.findall(r"[Tt]imed out", log))
        row["handled"] += (f"; the peer's collective timed out ({timeouts} 'timed out' line(s) in the logs)" if timeouts
                           else "; no 'timed out' line in the logs (who noticed it?)")
    if f.kind == "damage":
        m = re.search(r"iter_(\d+)_", f.note)
        damaged = int(m.group(1)) if m else None
        fetched = damaged is not None and re.search(
            rf"LOCAL step {damaged} of rank {f.rank} retrieved from rank \d+: .*checksum verified", log) is not None
        if damaged is not None and resumed < damaged:
            row["handled"] += f"; resumed from an OLDER step than the damaged {damaged} (its replica not used)"
        elif fetched:
            row["handled"] += f"; step {damaged} found damaged and fetched from the peer's replica"
        elif damaged is not None:  # a newer step became complete on every rank after the kill: the damaged one unused
            row["handled"] += f"; the newer step {resumed} was resumed: the damaged step {damaged} was not needed"
    return row


def verify_tiers(paths: list[Path]) -> list[tuple[Path, int, str]]:
    """``tierstack checkpoints verify`` on each path: ``(path, status, output)``."""
    cli = Path(sys.executable).with_name("tierstack")
    out = []
    for p in paths:
        proc = subprocess.run([str(cli), "checkpoints", "verify", str(p)], capture_output=True, text=True)
        out.append((p, proc.returncode, proc.stdout + proc.stderr))
    return out


def compare_losses(reference: Path, chaos: Path, iterations: int) -> tuple[bool, str]:
    """The final trajectory of the chaos run against the failure-free one, bit for bit (floats as
    recorded: Python's repr, exact). Returns ``(equal, what differs or how many steps agree)``."""
    ref, got = final_losses(reference), final_losses(chaos)
    if sorted(ref) != list(range(1, iterations + 1)):
        return False, f"the failure-free run recorded {len(ref)} of {iterations} steps"
    missing = [s for s in ref if s not in got]
    differ = [s for s in ref if s in got and got[s] != ref[s]]
    if missing or differ:
        first = differ[0] if differ else None
        detail = f"; step {first}: {got[first]!r} vs {ref[first]!r}" if first else ""
        return False, f"{len(missing)} steps missing, {len(differ)} differ{detail}"
    return True, f"all {iterations} losses equal bit for bit (last: {ref[iterations]!r})"


def published_kept(log: str, global_dir: Path, verified: bool) -> tuple[bool, str]:
    """Every GLOBAL step announced as published still exists (and its tier verified), unless
    retention announced its removal after a newer one was published."""
    announced = sorted({int(s) for s in re.findall(r"GLOBAL checkpoint of step (\d+) published", log)})
    removed = {int(s) for s in re.findall(r"retention: removing GLOBAL checkpoint \S*iter_(\d+)", log)}
    present = {int(p.name[5:]) for p in global_dir.glob("iter_*") if p.name[5:].isdigit()}
    lost = [s for s in announced if s not in present and not (s in removed and any(n > s for n in announced))]
    if lost or not verified:
        return False, f"published then lost: {lost}; GLOBAL verify passed: {verified}"
    kept = sorted(present & set(announced))
    return True, (f"{len(announced)} GLOBAL steps published; {kept} still there and verified, "
                  f"{len(announced) - len(kept)} older ones removed by retention (most_recent_k)")
