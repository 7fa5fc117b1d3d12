"""``TrainState``: every counter a resume must restore, as a ``Stateful`` object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

# State keys are constants so that checkpoints written by one version read in the next.
STEP = "step"
CONSUMED_TRAIN_SAMPLES = "consumed_train_samples"
SKIPPED_TRAIN_SAMPLES = "skipped_train_samples"
CONSUMED_VALID_SAMPLES = "consumed_valid_samples"
FLOPS_SO_FAR = "floating_point_operations_so_far"
EXPERIMENT_RUN_ID = "experiment_run_id"
LEGACY_TRACKER_RUN_ID = "tracker_run_id"  # checkpoints written before the rename


@dataclass
class TrainState:
    """Counters of a training run, embedded in every checkpoint of both tiers.

    Attributes:
        step: optimizer steps completed (the iteration number of the last finished step).
        consumed_train_samples: training samples drawn so far, over all data-parallel ranks; the
            sampler resumes from here, so data order continues exactly.
        skipped_train_samples: samples of steps skipped because the optimizer rejected the update
            (non-finite gradients).
        consumed_valid_samples: validation samples drawn so far (the validation iterator resumes).
        floating_point_operations_so_far: model FLOPs done so far (float, FLOPs).
        run_id: identifier of the run family; checkpoints of another run are never loaded.
        experiment_run_id: the experiment tracker's run id (mlflow), so a resume continues its curves.
        resumed_from: steps at which this run was resumed (for plots and logs).
        best_checkpoints: the top-K GLOBAL checkpoints by ``checkpoint.best_metric``, committed
            with the GLOBAL save that carries them: ``[[step, value], ...]``, best first
            (:mod:`tierstack.checkpointing.best`). Empty when ``keep_best_k`` is 0.
    """

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    run_id: str = ""
    experiment_run_id: Optional[str] = None
    resumed_from: list = field(default_factory=list)
    best_checkpoints: list = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        """Plain python values only (no tensors), safe for ``torch.load(weights_only=True)``."""
        d = dataclasses.asdict(self)
        d["resumed_from"] = list(self.resumed_from)
        d["best_checkpoints"] = [[int(s), float(v)] for s, v in self.best_checkpoints]
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Unknown keys raise ``KeyError`` (a newer format).

        ``tracker_run_id`` (its name in checkpoints of 0.1.0) is read as ``experiment_run_id``.
        """
        state = dict(state)
        if LEGACY_TRACKER_RUN_ID in state:
            state.setdefault(EXPERIMENT_RUN_ID, state.pop(LEGACY_TRACKER_RUN_ID))
        names = {f.name for f in dataclasses.fields(self)}
        unknown = set(state) - names
        if unknown:
            raise KeyError(f"TrainState: unknown keys {sorted(unknown)} in checkpoint")
        for k, v in state.items():
            if k == "best_checkpoints":
                v = [[int(s), float(m)] for s, m in v]
            setattr(self, k, list(v) if k == "resumed_from" else v)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "TrainState":
        ts = cls()
        ts.load_state_dict(state)
        return ts
