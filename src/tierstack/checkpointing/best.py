"""Top-K best GLOBAL checkpoints by a validation metric: proposed at validation, committed at save.

The protocol (issue 11):

1. **Propose** (every rank, after a validation run): :meth:`BestRecords.propose` remembers the
   candidate ``(step, value)`` when it would enter the top-K of the committed records. Nothing
   else changes: no file, no TrainState field.
2. **Commit** (every rank, when a GLOBAL checkpoint of that step is saved, after the non-finite
   guard's boundary agreement passed; a save the guard blocks when it ends is not kept in any
   tier, so its records are never published): :meth:`BestRecords.records_for` gives the top-K with the candidate merged in;
   the manager puts them into the TrainState captured by that save, so the restart metadata of
   the checkpoint being written already names it.
3. **Publish**: the records ride in the manifest and ``latest_train_state.pt`` with the checkpoint;
   rank 0 writes the ``best`` tracker (:data:`TRACKER_BEST`) atomically and retention keeps what
   :func:`protected_steps` names. The live TrainState takes the published records (a save that
   fails or is blocked leaves them unchanged). After a resume the records come back from the
   TrainState.

Records are ``[[step, value], ...]``, best first (lower is better for every metric in
:data:`METRICS`; ties go to the older step, which was there first).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

from tierstack.config.pretrained_spec import BEST_SUFFIX, TRACKER_BEST, resolve_pretrained  # noqa: F401 - re-exported
from tierstack.config.sections import BEST_METRICS as METRICS  # metric name -> lower is better


def top_k(records: Iterable, k: int) -> list[list]:
    """The ``k`` best ``[step, value]`` records, best first (lower value first, then older step);
    one record per step (a later record of the same step replaces an earlier one)."""
    by_step = {int(s): float(v) for s, v in records}
    ordered = sorted(by_step.items(), key=lambda sv: (sv[1], sv[0]))
    return [[s, v] for s, v in ordered[: max(k, 0)]]


def protected_steps(train_state: Mapping) -> set[int]:
    """Steps the top-K records of a published TrainState (``state_dict()``) protect from retention."""
    return {int(s) for s, _ in train_state.get("best_checkpoints") or []}


def best_step(train_state: Mapping) -> Optional[int]:
    """The best step of a TrainState's records, None when there are none."""
    records = train_state.get("best_checkpoints") or []
    return int(records[0][0]) if records else None


class BestRecords:
    """The proposal side of the protocol (see the module docstring); one per manager.

    Args:
        keep_best_k: records kept (0 = off: nothing is proposed or committed).
        metric: the metric name (a key of :data:`METRICS`, e.g. ``val_loss``).
        save_on_best: ask for a GLOBAL save at a step whose validation entered the top-K.
    """

    def __init__(self, keep_best_k: int, metric: str = "val_loss", save_on_best: bool = False):
        if metric not in METRICS:
            raise ValueError(f"checkpoint.best_metric={metric!r}: unknown, use one of {sorted(METRICS)}")
        self.k = keep_best_k
        self.metric = metric
        self.save_on_best = save_on_best
        self.pending: Optional[tuple[int, float]] = None  # (step, value) proposed, not yet committed

    @property
    def enabled(self) -> bool:
        return self.k > 0

    def propose(self, step: int, metrics: Mapping[str, float], committed: list) -> bool:
        """Remember ``metrics[metric]`` at ``step`` when it would enter the top-K of ``committed``.

        Not collective, but call it on every rank with the same values (validation losses are
        all-reduced). A non-finite value is never a candidate. Returns True when it enters.
        """
        value = metrics.get(self.metric)
        if not self.enabled or value is None or not math.isfinite(value):
            return False
        merged = top_k(list(committed) + [[step, value]], self.k)
        if any(s == step for s, _ in merged):
            self.pending = (step, float(value))
            return True
        return False

    def candidate_at(self, step: int) -> bool:
        """A candidate of ``step`` waits for its GLOBAL save."""
        return self.pending is not None and self.pending[0] == step

    def save_requested(self, step: int) -> bool:
        """True when ``save_on_best`` and the candidate of ``step`` waits for its GLOBAL save."""
        return self.save_on_best and self.pending is not None and self.pending[0] == step

    def records_for(self, step: int, committed: list) -> list[list]:
        """The records a GLOBAL checkpoint of ``step`` carries: ``committed`` with the candidate of
        ``step`` merged in (when there is one), trimmed to K. Pure: nothing is changed."""
        if not self.enabled:
            return [list(r) for r in committed]
        extra = [list(self.pending)] if self.pending is not None and self.pending[0] == step else []
        return top_k(list(committed) + extra, self.k)

    def settle(self, step: int) -> None:
        """The GLOBAL save of ``step`` was handed on, blocked or failed: its candidate is spent."""
        if self.pending is not None and self.pending[0] <= step:
            self.pending = None
