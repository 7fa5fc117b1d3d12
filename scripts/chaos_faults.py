"""The faults of the chaos soak (``scripts/chaos.py``): a seeded schedule, and their injection into a
running job without a human.

Each fault is tied to a training step, so the stream lands at the same places of the training on
a loaded machine as on a quiet one:

- ``kill``: SIGKILL of a rank (a spare of its node takes its rank, or its launcher restarts the job);
- ``node``: node replacement: the rank's node-local directory (and its node memory, when memory
  steps are kept there) is emptied, then the rank is killed;
- ``hang``: SIGSTOP of a rank. Under in-process restart NVRx's heartbeat timeout finds it
  (``resiliency.heartbeat_timeout_s``) and kills it, and a spare takes its rank; under the
  launcher's restart its peer's next collective times out (``distributed.timeout_s``) and that rank
  exits; the stopped rank's agent then kills it (torchrun's shutdown wait);
- ``damage``: the rank is killed, then bytes in the middle of its newest sealed LOCAL file are
  flipped (size kept), so that the resume has to read that step (its replica on the peer is good);
  with memory steps in node memory, the memory step the killed process left there too (its
  replacement must refuse it and read the file);
- ``eio``: a transient EIO when the rank opens its file of a GLOBAL save for writing (retried);
- ``enospc``: ENOSPC on every write of the rank's file of one GLOBAL save (permanent: that save is
  not published, training goes on);
- ``slow``: a slow disk: the rank's LOCAL write of one step waits :data:`SLOW_S` seconds.

The process faults (the first four) are done by :class:`Injector` from this process when rank 0
has recorded the fault's step. The I/O faults are the project's file-system fault injection
(``tests/functional_tests/resiliency/faults.py``, installed into every process of a rank by the
``sitecustomize`` of its ``inject/`` folder): :func:`io_env` is the environment that arms them for
the whole job, restarts included; each fires when a rank touches the step's path, and a one-shot
fault fires once over all processes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from goodput_records import records
from tierstack.checkpointing import node_memory

REPO = Path(__file__).resolve().parents[1]
INJECT = REPO / "tests" / "functional_tests" / "resiliency" / "inject"
PROCESS_KINDS = ("kill", "node", "hang", "damage")
IO_KINDS = ("eio", "enospc", "slow")
KINDS = PROCESS_KINDS + IO_KINDS
SLOW_S = 4.0  # seconds a slow disk holds one LOCAL write
REPEATABLE = ("kill", "node", "damage", "eio", "slow")  # kinds drawn again once every kind had its turn


@dataclass
class Fault:
    """One fault: ``kind`` (see the module docstring) at ``step`` on ``rank``; what happened is
    filled in by the injector (``t``: unix seconds it was done; for I/O faults, from the firing log)."""

    kind: str
    step: int
    rank: int
    t: Optional[float] = None
    note: str = ""

    @property
    def id(self) -> str:
        return f"{self.kind}-s{self.step}-r{self.rank}"


def schedule(seed: int, iterations: int, count: int, kinds: tuple, local_every: int, global_every: int) -> list[Fault]:
    """``count`` faults over the run, in step order, seeded: every kind of ``kinds`` once (in a
    seeded order), then more of :data:`REPEATABLE`; ENOSPC and the hang at most once.

    The steps are spread evenly between two LOCAL intervals after the start and one before the
    end, with a seeded offset; an I/O fault on GLOBAL moves to the nearest GLOBAL save, a slow
    LOCAL write to the nearest LOCAL save, and no two I/O faults share a save.

    Raises:
        ValueError: the run is too short for ``count`` faults (fewer than 2 iterations apart).
    """
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    extra = [k for k in REPEATABLE if k in kinds]
    while len(order) < count:
        order.append(rng.choice(extra))
    lo, hi = 2 * local_every + 2, iterations - local_every
    span = (hi - lo) / max(1, count)
    if span < 2:
        raise ValueError(f"{count} faults do not fit in {iterations} iterations")
    faults, used = [], set()
    for i, kind in enumerate(order[:count]):
        step = int(lo + (i + rng.uniform(0.2, 0.8)) * span)
        if kind in ("eio", "enospc"):
            step = _free_save(step, global_every, used, hi)
        elif kind == "slow":  # a LOCAL save that is no GLOBAL one: those are kept for eio and enospc
            step = _free_save(step, local_every, used, hi, avoid=range(global_every, hi, global_every))
        faults.append(Fault(kind, step, rng.randrange(2)))
    _clear_global_saves(faults, lo, hi)
    return sorted(faults, key=lambda f: f.step)


GLOBAL_SETTLE_STEPS = 6  # iterations a GLOBAL save with an I/O fault gets to retry and publish


def _clear_global_saves(faults: list[Fault], lo: int, hi: int) -> None:
    """Move a process fault that would land within :data:`GLOBAL_SETTLE_STEPS` after a GLOBAL save
    with an I/O fault to just after that window (or, past the end, to before the save): the
    asynchronous save, its retry and its publication take a few iterations, and a rank that dies
    meanwhile cuts it (correctly, nothing published is lost), which leaves the I/O fault's own
    handling unjudgeable. Seen: EIO at step 50, a node replacement at 52, "published: False"."""
    saves = sorted(f.step for f in faults if f.kind in ("eio", "enospc"))
    taken = {f.step for f in faults}
    for f in faults:
        if f.kind not in PROCESS_KINDS:
            continue
        for g in saves:
            if g <= f.step < g + GLOBAL_SETTLE_STEPS:
                options = [x for x in (*range(g + GLOBAL_SETTLE_STEPS, hi), *range(g - 2, lo, -1))
                           if x not in taken and not any(h <= x < h + GLOBAL_SETTLE_STEPS for h in saves)]
                if options:
                    taken.discard(f.step)
                    f.step = options[0]
                    taken.add(f.step)
                break


def _free_save(step: int, every: int, used: set, hi: int, avoid=()) -> int:
    """The save step nearest ``step`` (a multiple of ``every``, below ``hi``, not in ``avoid``) no
    other I/O fault uses."""
    near = max(every, round(step / every) * every)
    for s in sorted(range(every, hi, every), key=lambda s: abs(s - near)):
        if s not in used and s not in avoid:
            used.add(s)
            return s
    raise ValueError(f"no free save step for an I/O fault near {step}")


def io_env(faults: list[Fault], global_dir: Path, fault_dir: Path) -> dict:
    """The environment that arms the I/O faults of ``faults`` in every rank process of the launch."""
    spec = []
    for f in faults:
        staging = f"{global_dir}/iter_{f.step:07d}.staging-*/__{f.rank}_*"
        if f.kind == "eio":
            spec.append({"id": f.id, "op": "write", "path": staging, "rank": f.rank, "errno": "EIO", "times": 1})
        elif f.kind == "enospc":
            spec.append({"id": f.id, "op": "write", "path": staging, "rank": f.rank, "errno": "ENOSPC", "times": -1})
        elif f.kind == "slow":
            spec.append({"id": f.id, "op": "write", "path": f"*/{f.rank}/iter_{f.step:07d}_{f.rank}_local.dirty.pt",
                         "rank": f.rank, "sleep": SLOW_S, "times": 1})
    fault_dir.mkdir(parents=True, exist_ok=True)
    return {"TIERSTACK_FAULTS": json.dumps(spec), "TIERSTACK_FAULT_DIR": str(fault_dir),
            "PYTHONPATH": os.pathsep.join(p for p in (str(INJECT), os.environ.get("PYTHONPATH", "")) if p)}


def fired_at(fault_dir: Path) -> dict[str, float]:
    """Fault id -> unix time of its first firing (the I/O faults, from ``fired.log``)."""
    log = fault_dir / "fired.log"
    out: dict[str, float] = {}
    for line in (log.read_text().splitlines() if log.exists() else []):
        fid, _rank, _pid, t, _path = line.split(" ", 4)
        out.setdefault(fid, float(t))
    return out


def _newest_sealed(local_dir: Path, peer_dir: Path, rank: int) -> Optional[Path]:
    """Rank ``rank``'s newest LOCAL file whose manifest exists and whose replica the peer holds."""
    best = None
    for man in (local_dir / str(rank)).glob(f"iter_*_{rank}_local.manifest.json"):
        step = int(man.name.split("_")[1])
        if (peer_dir / "replicas" / str(rank) / man.name).exists() and (best is None or step > best[0]):
            best = (step, man.with_name(man.name.replace(".manifest.json", ".pt")))
    return None if best is None else best[1]


def damage(path: Path) -> str:
    """Flip 64 bytes in the middle of ``path`` (its size stays). Returns what was done."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
        f.flush()
        os.fsync(f.fileno())
    return f"flipped 64 bytes at offset {size // 2} of {path.name}"


class Injector:
    """The process faults of a schedule, done when rank 0 has recorded each one's step (call it as
    ``injector(run, stop)`` on a thread, e.g. by ``goodput_launch.launch``). A fault waits until the
    job has recorded a step after the previous one (so two never overlap in one restart) and is
    skipped once the last iteration is recorded. Every done fault gets its ``t`` and ``note``."""

    def __init__(self, faults: list[Fault], last_step: int, memory_dir: Optional[Path] = None):
        self.faults = [f for f in faults if f.kind in PROCESS_KINDS]
        self.last_step = last_step
        self.memory_dir = memory_dir  # the launch's checkpoint.memory_dir (memory steps in node memory), if any

    def __call__(self, run: Path, stop: threading.Event) -> None:
        t_prev = 0.0
        for f in self.faults:
            while not stop.wait(0.1):
                steps = records(run / "steps_rank0.jsonl")
                if steps and steps[-1]["step"] >= self.last_step:
                    return
                if steps and steps[-1]["t"] > t_prev and steps[-1]["step"] >= f.step and self._do(run, f):
                    t_prev = f.t
                    break

    def _do(self, run: Path, f: Fault) -> bool:
        """Inject ``f``; False when its rank is not up (the fault is tried again)."""
        info_path, peer_path = run / f"rank{f.rank}.json", run / f"rank{1 - f.rank}.json"
        if not info_path.exists() or not peer_path.exists():
            return False
        info, peer = json.loads(info_path.read_text()), json.loads(peer_path.read_text())
        local = Path(info["local_dir"])
        if f.kind == "damage" and _newest_sealed(local, Path(peer["local_dir"]), f.rank) is None:
            return False  # no sealed LOCAL step yet: tried again later
        try:
            os.kill(info["pid"], signal.SIGSTOP if f.kind == "hang" else signal.SIGKILL)
        except ProcessLookupError:
            return False
        f.t = time.time()
        held = None if self.memory_dir is None else node_memory.rank_dir(str(self.memory_dir), local, f.rank)
        if f.kind == "node":  # the node's disk and memory are gone: its spare finds neither
            shutil.rmtree(local, ignore_errors=True)
            f.note = f"node-local directory {local} wiped"
            if held is not None:
                shutil.rmtree(held.parent, ignore_errors=True)
                f.note += " and its node memory"
        elif f.kind == "damage":  # after the kill: no newer step can be sealed meanwhile
            victim = _newest_sealed(local, Path(peer["local_dir"]), f.rank)
            f.note = "rank killed; " + (damage(victim) if victim else "no sealed LOCAL file left to damage")
            if held is not None:  # and the memory step it left, so that the file is what the resume reads
                f.note += "; memory step: " + _damage_memory_step(held)
        return True


def _damage_memory_step(rank_dir: Path) -> str:
    """Flip bytes in the buffer set that the rank's node-memory record names (its held memory step)."""
    try:
        found = node_memory.read_record(rank_dir)
    except node_memory.RecordError as e:
        return f"record unreadable ({e})"
    if found is None:
        return "none held"
    return f"step {found[0]['step']}, " + damage(rank_dir / found[0]["file"])
