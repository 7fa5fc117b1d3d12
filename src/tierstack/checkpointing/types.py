"""The vocabulary of the package: tiers, what a checkpoint holds, events, and the tier Protocol."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Protocol

import torch

from tierstack.train_state import TrainState


class CheckpointTier(enum.Enum):
    LOCAL = "local"
    GLOBAL = "global"


@dataclass
class TrainingObjects:
    """What a checkpoint holds; the training loop builds it once and the manager reads it at each save."""

    model: list[torch.nn.Module]  # megatron DDP-wrapped chunks
    optimizer: Any  # megatron ChainedOptimizer / DistributedOptimizer / FP32Optimizer
    scheduler: Any  # megatron OptimizerParamScheduler
    train_state: TrainState


@dataclass(frozen=True)
class SaveEvent:
    """A published GLOBAL checkpoint (listeners never hear of LOCAL saves)."""

    tier: CheckpointTier
    step: int
    path: str
    bytes: int
    seconds: float  # time the training loop was blocked by this save (scheduling + finalize)
    train_state: Optional[dict] = None  # the TrainState published with it (``TrainState.state_dict()``)


@dataclass(frozen=True)
class ResumeInfo:
    tier: CheckpointTier
    step: int
    path: str
    seconds: float = 0.0  # wall time of the load


@dataclass
class Candidate:
    """One checkpoint one rank can see, before the ranks agree on it."""

    tier: CheckpointTier
    step: int
    path: Path  # GLOBAL: the step directory; LOCAL: this rank's file
    manifest: Optional[dict] = None
    problem: Optional[str] = None  # None = valid on this rank
    foreign: bool = False  # another run's checkpoint: ignored, never quarantined
    extra: dict = field(default_factory=dict)


class CheckpointTierHandler(Protocol):
    """One tier: everything :class:`~tierstack.checkpointing.manager.CheckpointManager` and resume
    selection use, so that neither holds a branch per tier. A new tier implements this and is added
    to :func:`~tierstack.checkpointing.manager.build_tiers`.

    Every method is collective (every rank calls it, in the same order) unless it says otherwise.
    """

    tier: CheckpointTier
    persistent: ClassVar[bool]  # survives the loss of a node (the final save of a run prefers such a tier)
    per_rank_files: ClassVar[bool]  # each rank's own files (LOCAL): a failed check quarantines that rank's only
    failures: list[int]  # steps whose save failed on some rank, in order (the manager decides what follows)
    nonfinite: list[tuple[int, list[int]]]  # (step, ranks): saves blocked by a NaN/inf staged state (manager takes them)
    last_durable_s: Optional[float]  # start of the last finalized save to its sealed/published agreement

    @property
    def enabled(self) -> bool:
        """Configured at all: to save or to resume from (not collective)."""
        ...

    @property
    def saves(self) -> bool:
        """Configured to save (a tier may be read-only, e.g. GLOBAL with ``load`` but no ``save``)."""
        ...

    @property
    def interval(self) -> Optional[int]:
        """Iterations between interval saves; None = only final and planned-exit saves."""
        ...

    @property
    def run_root(self) -> Optional[Path]:
        """Where the tier's ``run.json`` is read from to agree on the run family (None: nowhere)."""
        ...

    def claim(self, run_id: str) -> None:
        """At a fresh start: write ``run.json`` of ``run_id`` where the tier saves (on the right ranks)."""
        ...

    def prepare_resume(self, run_id: str) -> None:
        """Before resume selection: make what this tier can obtain available locally (LOCAL: files
        retrieved from replicas on other nodes); no-op for a tier that has nothing to fetch."""
        ...

    def interrupted_steps(self) -> list[int]:
        """Steps whose save this rank left unfinished (LOCAL: a ``.dirty`` file; not collective)."""
        ...

    def abandon(self, step: int) -> None:
        """``step`` was found to be an interrupted save: this rank's files of it are leftovers for
        the next save of the tier to remove (not collective)."""
        ...

    def rewind(self, step: int, run_id: str) -> Optional[list[int]]:
        """After a resume at ``step`` by ``checkpoint.ckpt_step``: move this rank's checkpoints of
        ``run_id`` newer than ``step`` aside (``.rewound-to-<step>``, never deleted) and
        return their steps; None when the tier resumed from a root it does not save to (left
        alone). Not collective."""
        ...

    def candidates(self, run_id: Optional[str]) -> list[Candidate]:
        """This rank's view of the tier's checkpoints of ``run_id`` (header checks; no quarantine; not collective)."""
        ...

    def verify(self, candidate: Candidate) -> Optional[str]:
        """This rank's part of the full check of ``candidate`` (sizes, checksums): None when valid,
        else ``"<reason> ..."`` (the first word names the quarantine)."""
        ...

    def quarantine(self, candidate: Candidate, reason: str) -> None:
        """Move an invalid candidate out of the way (rename, never delete)."""
        ...

    def load(self, step: int, objs: TrainingObjects) -> str:
        """Restore ``objs`` in place from ``step``; returns the path loaded."""
        ...

    def save(self, objs: TrainingObjects, *, run_id: str) -> Optional[float]:
        """Checkpoint ``objs.train_state.step``: finalize the save still in flight (at most one per
        tier), copy the state into the tier's staging buffers and hand the write to its writer
        thread (:class:`~tierstack.checkpointing.staging.Stager`); a synchronous save also waits
        and publishes.

        Returns the seconds the caller was blocked, or None when the save failed everywhere.
        """
        ...

    def finalize(self, blocking: bool) -> None:
        """Seal and publish the save in flight once its writer ended on every rank (``blocking``:
        wait for it). A failure on any rank fails it on every rank (``failures``; ``nonfinite``
        when a writer found NaN/inf in the staged state)."""
        ...

    @property
    def in_flight_step(self) -> Optional[int]:
        """The step of the save in flight (not yet finalized); None without one (not collective)."""
        ...

    def release_retention(self, settled_through: Optional[int]) -> None:
        """Start the retention held for saves of steps up to ``settled_through`` (None: all): no
        tier can veto those steps any more. Not collective; same on every rank."""
        ...

    def veto(self, step: int) -> None:
        """The non-finite guard blocked ``step`` in another tier: this tier keeps no save of it
        (in flight: discarded at finalize; sealed: removed). Not collective; same on every rank."""
        ...

    @property
    def in_flight(self) -> int:
        """Saves handed to the writer and not yet finalized (0 or 1; not collective)."""
        ...

    @property
    def staging_bytes(self) -> int:
        """Bytes of host staging memory the tier keeps between saves on this rank (not collective)."""
        ...

    @property
    def retention_pending(self) -> bool:
        """Retention (deleting old checkpoints) still runs on this rank's retention thread (not collective)."""
        ...

    def wait_retention(self, timeout_s: Optional[float] = None) -> bool:
        """Block until the retention jobs this rank started have ended, at most ``timeout_s``
        seconds; False when some still run (not collective)."""
        ...

    def close_retention(self) -> None:
        """Wait for retention (bounded), then stop the retention thread (not collective)."""
        ...

    def saved_steps(self) -> list[int]:
        """Steps this process saved that are sealed/published on every rank (not collective)."""
        ...

    def close(self) -> None:
        """Finalize the save in flight (blocking), stop the writer thread, free the staging buffers."""
        ...

    def close_alone(self) -> None:
        """Not collective: on a rank unwinding from its own error, abandon the save in flight
        unpublished and stop the writer without waiting for it."""
        ...
