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
  another step) reads its file as before.

Off unless :func:`enable` was called (once per process, by the in-process runner): the second
buffer set costs as much host memory as the first.
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

    def sources(self) -> list[torch.Tensor]:
        """The held bytes as 1-D uint8 views (what a loaded tensor may view; see ``own_optimizer_state``)."""
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
    """A :class:`Stager` with two buffer sets; :meth:`stage` never refills the held step's set."""

    def __init__(self, name: str):
        super().__init__(name)
        self._other: tuple[list, Optional[list]] = ([], None)  # (buffers, signature) of the set not in use
        self._staged: dict[int, tuple[bytes, tuple]] = {}  # step -> (header, buffers) of the last stagings

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.wait_released()
        if _held is not None and self._buffers and _held.buffers and _held.buffers[0] is self._buffers[0]:
            mine = (self._buffers, self._signature)  # the held step's: staged into the other set
            self._buffers, self._signature = self._other
            self._other = mine
        return super().stage(tensors)

    def note(self, step: int, header: bytes) -> None:
        """The buffers just staged hold ``step`` (with this header); the last two are kept."""
        self._staged.pop(step, None)
        self._staged[step] = (header, tuple(self._buffers))
        for old in sorted(self._staged)[:-2]:
            del self._staged[old]

    def staged_step(self, step: int) -> Optional[tuple[bytes, tuple]]:
        """``(header, buffers)`` of ``step`` if it was staged here and its set was not refilled."""
        # (the tier finalizes a save before it stages the next one: the set of the step it
        # finalizes has not been refilled)
        return self._staged.get(step)

    def close(self, timeout_s: Optional[float] = None) -> None:
        super().close(timeout_s)
        self._other, self._staged = ([], None), {}  # a held step keeps its own references

    def abandon(self) -> None:
        super().abandon()
        self._other, self._staged = ([], None), {}


def stager_for(default: Stager) -> Stager:
    """The LOCAL tier's stager: a :class:`MemoryStager` when enabled, else ``default``."""
    return MemoryStager(default.name) if _enabled else default


def note_staged(stager: Stager, step: int, header: bytes) -> None:
    """After the LOCAL tier staged ``step``: remember which set holds it (no-op when disabled)."""
    if isinstance(stager, MemoryStager):
        stager.note(step, header)


def note_sealed(stager: Stager, *, step: int, run_id: str, rank: int, root: Any, topology: dict) -> None:
    """After ``step`` was sealed on every rank: it becomes this process's held step (when enabled)."""
    global _held
    if not isinstance(stager, MemoryStager):
        return
    got = stager.staged_step(step)
    if got is None:  # its set was refilled or dropped (a stuck writer abandoned it): nothing to hold
        return
    _held = HeldStep(step, run_id, rank, str(root), dict(topology), got[0], got[1])


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
