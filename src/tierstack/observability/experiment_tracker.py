"""Experiment tracking with mlflow: one run per training run family, continued across resumes.

Only rank 0 talks to mlflow; on every other rank (and when the ``mlflow`` section is None) each
method is a no-op. mlflow is imported only when tracking is on: the import takes seconds.

Default store: ``sqlite:///<run_dir>/mlflow.db`` (mlflow 3 refuses the plain file store), with
artifacts under ``<run_dir>/mlartifacts``. A server is used by setting ``mlflow.tracking_uri``.

What a run holds:

- params: the full config, flattened to ``section.field`` keys, logged once (at the first start;
  a resume leaves them, since mlflow refuses to change a logged param);
- metrics per log interval, at their iteration as the mlflow step;
- GLOBAL checkpoint events: metrics ``checkpoint/global_save_seconds`` and ``checkpoint/global_bytes``
  at the checkpoint's step, and one JSON artifact per event ``checkpoints/global_iter_<step>.json``
  (tier, step, path, bytes, seconds); LOCAL saves are frequent and node-local, so they are not logged;
- tags ``tierstack.resumed_at`` (steps of resumes) and the final status.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from tierstack.config.sections import MlflowConfig

log = logging.getLogger(__name__)

RESUMED_AT_TAG = "tierstack.resumed_at"
CHECKPOINT_ARTIFACT_DIR = "checkpoints"
_STATUSES = ("FINISHED", "FAILED", "KILLED")
# mlflow's limits (mlflow.utils.validation): keys 250 chars, param values 6000, tag values 8000,
# at most 100 params and 1000 metrics per log_batch call.
_MAX_KEY = 250
_MAX_PARAM_VALUE = 6000
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten nested dicts to ``{"section.field": "value"}``, values as strings within mlflow's limits.

    None becomes ``"None"`` (so an off feature is visible); long values are cut to 6000 characters
    with a trailing ``...``.
    """
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_params(value, prefix=f"{name}."))
            continue
        text = str(value)
        if len(text) > _MAX_PARAM_VALUE:
            text = text[: _MAX_PARAM_VALUE - 3] + "..."
        out[name[:_MAX_KEY]] = text
    return out


def _field(event: Any, name: str) -> Any:
    return event[name] if isinstance(event, Mapping) else getattr(event, name)


def _tier_name(tier: Any) -> str:
    return str(getattr(tier, "name", tier)).upper()


def _quiet_mlflow() -> None:
    """Keep mlflow (and the alembic migrations of a new sqlite store) off the console."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    # Training nodes often have no internet; mlflow 3 would otherwise send usage telemetry.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # It logs every failed database call with its traceback before raising it; the raise reaches
    # RunLoggers, which logs a logger's first failure (the same traceback) and counts the rest.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


class ExperimentTracker:
    """Rank-0 mlflow client for one training run: the *experiment* tracker.

    (Not the checkpoint tracker file ``latest_checkpointed_iteration.txt``, not megatron's RNG tracker.)

    Args:
        cfg: the ``mlflow`` config section; None turns tracking off (every method a no-op).
        run_dir: run directory (for the default sqlite store and artifacts).
        rank: global rank of this process; only rank 0 tracks.

    Raises:
        ImportError: tracking is on and mlflow is not installed (names the package).
    """

    def __init__(self, cfg: Optional[MlflowConfig], run_dir: str | os.PathLike, rank: int) -> None:
        self.cfg = cfg
        self.enabled = cfg is not None and rank == 0
        self.run_dir = Path(run_dir).resolve()
        self.run_id: Optional[str] = None
        self._client = None
        if not self.enabled:
            return
        _quiet_mlflow()
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:  # pragma: no cover - mlflow is a core dependency
            raise ImportError("mlflow tracking is on (config section `mlflow`): pip install mlflow") from e
        _quiet_mlflow()  # mlflow configures its logger at import
        self.tracking_uri = cfg.tracking_uri or f"sqlite:///{self.run_dir / 'mlflow.db'}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(
        self,
        config_params: Mapping[str, Any],
        resume_run_id: Optional[str] = None,
        resume_step: Optional[int] = None,
    ) -> Optional[str]:
        """Open the run: continue ``resume_run_id`` when the store has it, else create a new one.

        Args:
            config_params: the full config as nested dicts (``{"train": {"train_iters": 200}, ...}``);
                logged as params on a new run only.
            resume_run_id: mlflow run id kept in the checkpoint's TrainState (``experiment_run_id``).
            resume_step: the step resumed from, appended to the ``tierstack.resumed_at`` tag.

        Returns:
            The run id (rank 0, tracking on) or None.
        """
        if not self.enabled:
            return None
        client = self._client
        run = self._existing_run(resume_run_id) if resume_run_id else None
        if run is not None:
            self.run_id = run.info.run_id
            client.update_run(self.run_id, status="RUNNING")
            resumed = [s for s in run.data.tags.get(RESUMED_AT_TAG, "").split(",") if s]
            if resume_step is not None:
                resumed.append(str(resume_step))
                client.set_tag(self.run_id, RESUMED_AT_TAG, ",".join(resumed))
            log.info("mlflow: continuing run %s (%s)", self.run_id, self.tracking_uri)
            return self.run_id
        experiment_id = self._experiment_id()
        run = client.create_run(experiment_id, run_name=self.cfg.run_name)
        self.run_id = run.info.run_id
        self._log_params(flatten_params(config_params))
        log.info("mlflow: new run %s in experiment %r (%s)", self.run_id, self.cfg.experiment_name, self.tracking_uri)
        return self.run_id

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the run ended with ``status`` ("FINISHED", "FAILED" or "KILLED").

        Raises:
            ValueError: an unknown status.
        """
        if status not in _STATUSES:
            raise ValueError(f"status must be one of {_STATUSES}, got {status!r}")
        if not self.enabled or self.run_id is None:
            return
        self._client.set_terminated(self.run_id, status=status)
        log.info("mlflow: run %s %s", self.run_id, status)

    # -- logging ----------------------------------------------------------------------------------

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log numeric metrics at ``step`` (the iteration); None and non-numeric values are skipped."""
        if not self._active():
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = []
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            if math.isfinite(number):
                entries.append(Metric(key[:_MAX_KEY], number, now, int(step)))
        for i in range(0, len(entries), _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=entries[i : i + _METRICS_PER_BATCH])

    def log_checkpoint(self, event: Any) -> bool:
        """Log a checkpoint save event; only GLOBAL saves are logged.

        Args:
            event: object or mapping with ``tier`` (``CheckpointTier`` or its name), ``step``,
                ``path``, ``bytes`` (total size, bytes) and ``seconds`` (save duration, seconds).

        Returns:
            True when the event was logged.
        """
        if not self._active() or _tier_name(_field(event, "tier")) != "GLOBAL":
            return False
        step = int(_field(event, "step"))
        record = {
            "tier": "GLOBAL",
            "step": step,
            "path": str(_field(event, "path")),
            "bytes": int(_field(event, "bytes")),
            "seconds": float(_field(event, "seconds")),
        }
        self.log_metrics(
            step,
            {"checkpoint/global_save_seconds": record["seconds"], "checkpoint/global_bytes": record["bytes"]},
        )
        self._client.log_dict(self.run_id, record, f"{CHECKPOINT_ARTIFACT_DIR}/global_iter_{step:07d}.json")
        return True

    def log_artifact(self, path: str | os.PathLike, artifact_path: Optional[str] = None) -> None:
        """Copy a local file (e.g. the loss curve PNG) into the run's artifacts."""
        if self._active():
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tag(self, key: str, value: Any) -> None:
        """Set a run tag (e.g. the exit reason)."""
        if self._active():
            self._client.set_tag(self.run_id, key, str(value))

    # -- internals --------------------------------------------------------------------------------

    def _active(self) -> bool:
        return self.enabled and self.run_id is not None

    def _existing_run(self, run_id: str):
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id)
        except MlflowException:
            log.warning("mlflow: run %s (from the checkpoint) is not in %s; starting a new run", run_id, self.tracking_uri)
            return None

    def _experiment_id(self) -> str:
        experiment = self._client.get_experiment_by_name(self.cfg.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        artifacts = None
        if self.cfg.tracking_uri is None:
            artifacts = (self.run_dir / "mlartifacts").as_uri()
        return self._client.create_experiment(self.cfg.experiment_name, artifact_location=artifacts)

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        entries = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(entries), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=entries[i : i + _PARAMS_PER_BATCH])
