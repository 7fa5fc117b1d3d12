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

Off unless :func:`enable` was called (once per process, by the in-process runner): each more
buffer set (a second; a third with memory steps) costs as much host memory as the first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

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

    def sources(self) -> list[torch.Tensor]:
        """The held bytes as 1-D uint8 views (what a loaded tensor may view; ``own_optimizer_state``
        takes them all in one walk of the optimizer state)."""
        return [b.reshape(-1).view(torch.uint8) for b in self.buffers]


_held: Optional[HeldStep] = None


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
    """Drop the held step (its buffers are freed when no tier uses them)."""
    global _held
    _held = None


class MemoryStager(Stager):
    """A :class:`Stager` whose :meth:`stage` never refills the held step's set, nor the set the
    writer reads while its job runs: with memory steps between file saves that takes a third set
    (allocated the first time a memory step comes while a file is still being written)."""

    def __init__(self, name: str):
        super().__init__(name)
        self._idle: list[tuple[list, Optional[list]]] = []  # (buffers, signature) of the sets not current
        self._writing: Optional[torch.Tensor] = None  # first buffer of the set the writer's job reads
        self._staged: dict[int, tuple[bytes, tuple]] = {}  # step -> (header, buffers) of the last stagings

    def _busy(self, buffers: list) -> bool:
        if not buffers:
            return False
        busy = [] if _held is None or not _held.buffers else [_held.buffers[0]]
        if self._job is not None and not self._job.done():
            busy.append(self._writing)
        return any(buffers[0] is b for b in busy)

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._busy(self._buffers):
            self._idle.append((self._buffers, self._signature))
            free = next((i for i, (b, _) in enumerate(self._idle) if not self._busy(b)), None)
            self._buffers, self._signature = self._idle.pop(free) if free is not None else ([], None)
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
        self._staged[step] = (header, tuple(self._buffers))

    def staged_step(self, step: int) -> Optional[tuple[bytes, tuple]]:
        """``(header, buffers)`` of ``step`` if it was staged here and its set was not refilled since."""
        return self._staged.get(step)

    def close(self, timeout_s: Optional[float] = None) -> None:
        super().close(timeout_s)
        self._idle, self._staged, self._writing = [], {}, None  # a held step keeps its own references

    def abandon(self) -> None:
        super().abandon()
        self._idle, self._staged, self._writing = [], {}, None


def stager_for(default: Stager) -> Stager:
    """The LOCAL tier's stager: a :class:`MemoryStager` when enabled, else ``default``."""
    return MemoryStager(default.name) if _enabled else default


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
    _held = HeldStep(step, run_id, rank, str(root), dict(topology), got[0], got[1], manifest)


def memory_candidate(run_id: Optional[str], rank: int, root: Any, topology: dict, rank_dir: Any):
    """The held memory step as a LOCAL resume :class:`~tierstack.checkpointing.types.Candidate`
    of this rank (its path: where its file would be in ``rank_dir``; it has none), or None: no
    memory step held, or one of another run, rank, root or topology."""
    from pathlib import Path

    from tierstack.checkpointing import paths
    from tierstack.checkpointing.types import Candidate, CheckpointTier

    h = _held
    if h is None or h.manifest is None or match(h.step, run_id, rank, root, topology) is None:
        return None
    path = Path(rank_dir) / paths.local_file_name(h.step, rank)
    return Candidate(CheckpointTier.LOCAL, h.step, path, h.manifest, None, False, {"in_memory": True})


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
