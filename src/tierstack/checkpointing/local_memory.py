"""The LOCAL step a rank still holds in host memory, for a resume without a file read.

Under in-process restart (:mod:`tierstack.resiliency.in_process`) a healthy rank keeps its process,
and with it the staging buffers its last LOCAL save was written from. This module keeps them
usable as a resume source:

- the LOCAL tier stages into one of **two** buffer sets (:class:`MemoryStager`), never into the one
  holding the newest step sealed on every rank: a save in flight (or one that failed) refills the
  other set, so the state resumed from is always a sealed one, bit for bit what its file holds;
- when a save is sealed, its set and header become the process's :class:`HeldStep` (one per
  process; it survives the attempt's tier, manager and process groups, which are rebuilt);
- at the resume, the tier verifies and loads that step from the held buffers when step, run,
  rank, root and topology are the ones asked for; anything else (a replaced rank, a new process,
  another step) reads its file as before;
- with ``checkpoint.memory_save_interval`` the tier also stages *memory steps* between its file
  saves: the same staging, then the non-finite check of the live tensors and one agreement on
  the training thread, and no file, no replica. A memory step is a resume candidate only in the
  processes that hold it (its manifest is kept beside it, :func:`memory_candidate`): a rank whose
  process was replaced holds none, so selection skips it as a memory step (no lost checkpoint)
  and the ranks agree on the newest file step, as on any start. Healthy ranks that all survived
  lose at most the step in flight.

With ``checkpoint.memory_dir`` the sets are files in the node's shared memory and the held memory
step is recorded there too (:mod:`~tierstack.checkpointing.node_memory`): a process that takes the
rank of one that died on the same node adopts it, so a killed rank loses at most the step in flight too.

Off unless :func:`enable` was called (once per process, by the in-process runner): each more
buffer set (a second; a third with memory steps) costs as much host memory as the first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from tierstack.checkpointing import node_memory
from tierstack.checkpointing.staging import Stager

log = logging.getLogger(__name__)

_enabled = False


@dataclass(frozen=True)
class HeldStep:
    """A sealed LOCAL step in host memory: the file's header and its tensors' buffers."""

    step: int
    run_id: str
    rank: int
    root: str
    topology: dict
    header: bytes
    buffers: tuple  # of torch.Tensor, the staging set it was written from
    manifest: Optional[dict] = None  # a memory step's manifest (it has no file); None: a file step
    record_dir: Optional[str] = None  # where its node-memory record is (``checkpoint.memory_dir``), or None

    def sources(self) -> list[torch.Tensor]:
        """The held bytes as 1-D uint8 views (what a loaded tensor may view; ``own_optimizer_state``
        takes them all in one walk of the optimizer state)."""
        return [b.reshape(-1).view(torch.uint8) for b in self.buffers]


_held: Optional[HeldStep] = None
_warned: set = set()  # (reason, directory) of node-memory problems already logged by this process


def enable() -> None:
    """Keep sealed LOCAL steps in memory from now on, in this process (two staging sets)."""
    global _enabled
    _enabled = True


def enabled() -> bool:
    """True after :func:`enable` in this process."""
    return _enabled


def held() -> Optional[HeldStep]:
    """The step this process holds, or None."""
    return _held


def forget() -> None:
    """Drop the held step (its buffers are freed when no tier uses them), and its node-memory record."""
    global _held
    if _held is not None and _held.record_dir is not None:
        node_memory.remove_record(Path(_held.record_dir))
    _held = None


class MemoryStager(Stager):
    """A :class:`Stager` whose :meth:`stage` never refills the held step's set, nor the set the
    writer reads while its job runs: with memory steps between file saves that takes a third set
    (allocated the first time a memory step comes while a file is still being written)."""

    def __init__(self, name: str, node_dir: Optional[Path] = None):
        super().__init__(name)
        self.node_dir = node_dir  # the sets are files there (node memory), or None: anonymous memory
        self._file: Optional[str] = None  # the current set's file
        self._idle: list[tuple[list, Optional[list], Optional[str]]] = []  # (buffers, signature, file) of the others
        self._writing: Optional[torch.Tensor] = None  # first buffer of the set the writer's job reads
        self._staged: dict[int, tuple[bytes, tuple, Optional[str]]] = {}  # step -> (header, buffers, file)

    def _allocate(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.node_dir is None:
            return super()._allocate(tensors)
        try:
            buffers, self._file = node_memory.allocate(tensors, self.node_dir)
        except OSError as e:  # a full tmpfs (ENOSPC), another user's directory: in the process's memory
            why = "not usable" if isinstance(e, PermissionError) else "no room"
            if (why, str(self.node_dir)) not in _warned:  # once per process, not at every allocation and attempt
                _warned.add((why, str(self.node_dir)))
                log.warning("%s staging: checkpoint.memory_dir %s (%s: %s); memory steps stay in the process's "
                            "own memory, so a replacement of this process cannot adopt them", self.name, why,
                            self.node_dir, e)
            self._file = None
            return super()._allocate(tensors)
        return buffers

    def _busy(self, buffers: list) -> bool:
        if not buffers:
            return False
        busy = [] if _held is None or not _held.buffers else [_held.buffers[0]]
        if self._job is not None and not self._job.done():
            busy.append(self._writing)
        return any(buffers[0] is b for b in busy)

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._busy(self._buffers):
            self._idle.append((self._buffers, self._signature, self._file))
            free = next((i for i, (b, _, _) in enumerate(self._idle) if not self._busy(b)), None)
            self._buffers, self._signature, self._file = self._idle.pop(free) if free is not None else ([], None, None)
        return super().stage(tensors)  # (its wait_released: only for the set the writer reads)

    def wait_released(self) -> None:
        if self._buffers and self._writing is self._buffers[0]:
            super().wait_released()

    def submit(self, fn, *args, **kwargs):
        self._writing = self._buffers[0] if self._buffers else None
        return super().submit(fn, *args, **kwargs)

    def note(self, step: int, header: bytes) -> None:
        """The buffers just staged hold ``step`` (with this header); what they held before is gone."""
        mine = self._buffers[0] if self._buffers else None
        self._staged = {s: v for s, v in self._staged.items() if s != step and not (v[1] and v[1][0] is mine)}
        self._staged[step] = (header, tuple(self._buffers), self._file)

    def staged_step(self, step: int) -> Optional[tuple[bytes, tuple, Optional[str]]]:
        """``(header, buffers, file)`` of ``step`` if it was staged here and its set was not refilled
        since (``file``: the set's file in node memory, or None)."""
        return self._staged.get(step)

    def close(self, timeout_s: Optional[float] = None) -> None:
        super().close(timeout_s)
        self._idle, self._staged, self._writing, self._file = [], {}, None, None  # a held step keeps its own references

    def abandon(self) -> None:
        super().abandon()
        self._idle, self._staged, self._writing, self._file = [], {}, None, None


def stager_for(default: Stager, node_dir: Optional[Path] = None) -> Stager:
    """The LOCAL tier's stager: a :class:`MemoryStager` when enabled (its sets files in ``node_dir``,
    :func:`node_memory.rank_dir <tierstack.checkpointing.node_memory.rank_dir>`, when given), else ``default``."""
    return MemoryStager(default.name, node_dir) if _enabled else default


def note_staged(stager: Stager, step: int, header: bytes) -> None:
    """After the LOCAL tier staged ``step``: remember which set holds it (no-op when disabled)."""
    if isinstance(stager, MemoryStager):
        stager.note(step, header)


def note_sealed(stager: Stager, *, step: int, run_id: str, rank: int, root: Any, topology: dict,
                manifest: Optional[dict] = None) -> None:
    """After ``step`` was sealed on every rank: it becomes this process's held step (when enabled).
    ``manifest``: a memory step's (it has no file to read one from). A held step newer than
    ``step`` stays (a memory step taken while the file of ``step`` was still being written)."""
    global _held
    if not isinstance(stager, MemoryStager):
        return
    got = stager.staged_step(step)
    if got is None:  # its set was refilled or dropped (a stuck writer abandoned it): nothing to hold
        return
    if _held is not None and _held.step > step:  # a memory step newer than a file that sealed after it
        return
    record = _record(stager.node_dir, got, step=step, run_id=run_id, rank=rank, root=str(root),
                     topology=dict(topology), manifest=manifest)
    _held = HeldStep(step, run_id, rank, str(root), dict(topology), got[0], got[1], manifest, record)


def _record(node_dir: Optional[Path], got: tuple, *, step: int, run_id: str, rank: int, root: str, topology: dict,
            manifest: Optional[dict]) -> Optional[str]:
    """Before the held step changes: the node-memory record names the new one when it is a memory
    step in a file-backed set, else none is left (the set the old record named may be refilled)."""
    if node_dir is None:
        return None
    header, buffers, file = got
    if manifest is None or file is None:
        node_memory.remove_record(node_dir)
        return None
    try:
        node_memory.write_record(node_dir, step=step, run_id=run_id, rank=rank, root=root, topology=topology,
                                 manifest=manifest, header=header, buffers=buffers, file=file)
    except OSError as e:  # said once per process and directory (a full tmpfs fails every step alike)
        if ("record", str(node_dir)) not in _warned:
            _warned.add(("record", str(node_dir)))
            log.warning("rank %d: memory step %d is held in this process only: its node-memory record in %s "
                        "could not be written (%s); said once, the later steps alike", rank, step, node_dir, e)
        return None
    return str(node_dir)


def memory_candidate(run_id: Optional[str], rank: int, root: Any, topology: dict, rank_dir: Any,
                     node_dir: Optional[Path] = None):
    """The held memory step as a LOCAL resume :class:`~tierstack.checkpointing.types.Candidate`
    of this rank (its path: where its file would be in ``rank_dir``; it has none), or None: no
    memory step held, or one of another run, rank, root or topology. A process that holds no
    step first adopts the one a dead process of this rank left in ``node_dir`` (:func:`adopt`)."""
    from tierstack.checkpointing import paths
    from tierstack.checkpointing.types import Candidate, CheckpointTier

    if _held is None and node_dir is not None and _enabled:
        adopt(node_dir, rank, root, topology)
    h = _held
    if h is None or h.manifest is None or match(h.step, run_id, rank, root, topology) is None:
        return None
    path = Path(rank_dir) / paths.local_file_name(h.step, rank)
    return Candidate(CheckpointTier.LOCAL, h.step, path, h.manifest, None, False, {"in_memory": True})


def adopt(node_dir: Path, rank: int, root: Any, topology: dict) -> Optional[HeldStep]:
    """Make the memory step that a previous process of ``rank`` left in node memory (``node_dir``)
    this process's held step, when it is of this rank, LOCAL root and topology; a record of another
    root, rank or topology is removed (its directory is this root's and rank's: it can never be resumed)."""
    global _held
    got = node_memory.adopt(node_dir)
    if got is None:
        return None
    meta, header, buffers, file = got
    problem = None
    if meta["rank"] != rank or meta["root"] != str(root) or meta["topology"] != dict(topology):
        problem = "it is of another rank, LOCAL root or topology"
    else:
        from tierstack.checkpointing import local_file

        try:  # the header too: a step that cannot be decoded must not stop every restart that adopts it
            local_file.decode_parts(header, list(buffers), node_dir / node_memory.RECORD)
        except Exception as e:  # noqa: BLE001 - whatever the decoder raises, the file step is resumed instead
            problem = f"its header does not decode ({type(e).__name__}: {e})"
    if problem is not None:
        log.warning("rank %d: the memory step %s in %s is not adopted: %s; removed", rank, meta["step"], node_dir,
                    problem)
        node_memory.remove_record(node_dir)
        return None
    _held = HeldStep(meta["step"], meta["run_id"], rank, str(root), dict(topology), header, buffers,
                     meta["manifest"], str(node_dir))
    log.info("rank %d: adopted memory step %d from node memory (%s), left by the rank's previous process",
             rank, meta["step"], file)
    return _held


def release() -> None:
    """The run ended here: drop the held step, its node-memory record and every set file of this process."""
    forget()
    node_memory.release_files()


def memory_manifest(step: int, rank: int, root: Any, topology: dict) -> Optional[dict]:
    """The manifest of the memory step ``step`` when this process holds it for this rank, root
    and topology; None otherwise (a file step's manifest is read from its file)."""
    h = match(step, None, rank, root, topology)
    return None if h is None else h.manifest


def forget_newer(step: int) -> None:
    """Drop the held step when it is newer than ``step`` (a rewind to ``step``: never resumed again)."""
    if _held is not None and _held.step > step:
        forget()


def match(step: int, run_id: Optional[str], rank: int, root: Any, topology: dict) -> Optional[HeldStep]:
    """The held step when it is ``step`` of this run, rank, LOCAL root and topology; else None."""
    h = _held
    if h is None or h.step != step or h.rank != rank or h.root != str(root) or h.topology != dict(topology):
        return None
    if run_id is not None and h.run_id != run_id:
        return None
    return h


def decode(h: HeldStep, path: Any) -> Any:
    """The state dict of ``h`` (NVRx ``TensorAwareStateDict``), its tensors views of the held buffers."""
    from tierstack.checkpointing import local_file

    log.info("rank %d: LOCAL step %d taken from host memory (no file read)", h.rank, h.step)
    return local_file.decode_parts(h.header, list(h.buffers), path)
