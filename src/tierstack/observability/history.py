"""``run_dir/metrics.jsonl``: metrics per log interval and run events, kept across resumes (rank 0).

Each line is one JSON object: ``{"step": 120, "loss": 2.9, ...}`` for metrics, or
``{"step": 120, "event": "checkpoint", "tier": "GLOBAL"}`` / ``{"step": 60, "event": "resume"}`` for
events. A resumed run reloads the file, drops what lies beyond the step it resumed from (those steps
are trained again), and appends; so a plot at the end covers the whole run family.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional

log = logging.getLogger(__name__)

FILE_NAME = "metrics.jsonl"
CHECKPOINT = "checkpoint"
RESUME = "resume"


class MetricsHistory:
    """Append-only metrics log of a run; on ranks other than 0 it keeps nothing and writes nothing.

    Args:
        path: the run directory (the file is ``<path>/metrics.jsonl``) or the ``.jsonl`` file itself.
        rank: global rank of this process.
        resume_step: when given, :meth:`load` at once, keeping records up to this step (the step
            the run starts from; 0 for a fresh start, which clears an old file).
    """

    def __init__(
        self, path: str | os.PathLike, rank: int = 0, resume_step: Optional[int] = None
    ) -> None:
        path = Path(path)
        self.path = path if path.suffix == ".jsonl" else path / FILE_NAME
        self.enabled = rank == 0
        self.records: list[dict[str, Any]] = []
        self._unwritten: list[str] = []  # lines a failed write left (a full disk): written with the next one
        if resume_step is not None:
            self.load(resume_step)

    def load(self, resume_step: Optional[int] = None) -> list[dict[str, Any]]:
        """Read the existing file; with ``resume_step``, drop records beyond it and rewrite the file.

        A torn last line (the previous run died while writing) is skipped with a warning.

        Returns:
            The records kept (also in :attr:`records`).
        """
        if not self.enabled or not self.path.exists():
            return self.records
        kept = []
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: unreadable line skipped", self.path, n)
                continue
            if resume_step is None or record.get("step", 0) <= resume_step:
                kept.append(record)
        self.records = kept
        if resume_step is not None:
            tmp = self.path.with_suffix(".jsonl.tmp")
            try:
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                os.replace(tmp, self.path)
            except OSError as e:  # a full disk: the file keeps the later records until it can be rewritten
                tmp.unlink(missing_ok=True)
                log.warning("%s: not cut back to step %d (%s); its records after that step stay in the file",
                            self.path, resume_step, e)
        return self.records

    def append(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record metrics at ``step``; values that are not JSON numbers or strings are converted to float."""
        record = {"step": int(step)}
        for key, value in metrics.items():
            if value is None or isinstance(value, (int, float, str)):
                record[key] = value
            else:
                record[key] = float(value)  # e.g. a 0-d tensor
        self._write(record)

    def add_checkpoint(self, step: int, tier: Any) -> None:
        """Record a checkpoint published at ``step`` (``tier``: ``CheckpointTier`` or its name)."""
        self._write({"step": int(step), "event": CHECKPOINT, "tier": str(getattr(tier, "name", tier)).upper()})

    def add_resume(self, step: int) -> None:
        """Record that the run resumed from ``step``."""
        self._write({"step": int(step), "event": RESUME})

    def metrics(self) -> list[dict[str, Any]]:
        """Metric records only (no events), in step order."""
        return [r for r in self.records if "event" not in r]

    def checkpoint_steps(self) -> dict[str, list[int]]:
        """``{"GLOBAL": [...], "LOCAL": [...]}`` steps of recorded checkpoints."""
        out: dict[str, list[int]] = {}
        for r in self.records:
            if r.get("event") == CHECKPOINT:
                out.setdefault(r["tier"], []).append(r["step"])
        return out

    def resume_steps(self) -> list[int]:
        """Steps the run resumed from."""
        return [r["step"] for r in self.records if r.get("event") == RESUME]

    def _write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (rank 0). A write that fails (ENOSPC on a full disk, EIO) never stops
        training: one warning, the record is kept in memory (:attr:`records`, the loss curve) and
        in a backlog written with the next record that can be (an INFO line says so)."""
        if not self.enabled:
            return
        self.records.append(record)
        self._unwritten.append(json.dumps(record) + "\n")
        size = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            size = self.path.stat().st_size if self.path.exists() else 0
            with self.path.open("a") as f:
                f.write("".join(self._unwritten))
        except OSError as e:
            if size is not None:  # no torn line before the backlog, once it is written
                with contextlib.suppress(OSError):
                    os.truncate(self.path, size)
            if len(self._unwritten) == 1:  # once per failing stretch, not at every log interval
                log.warning("%s: cannot write (%s); the metrics stay in memory and go on to the other loggers, "
                            "training goes on, the file is caught up once it can be written", self.path, e)
            return
        if len(self._unwritten) > 1:
            log.info("%s: written again, %d records caught up", self.path, len(self._unwritten))
        self._unwritten.clear()
