"""Weights & Biases for a run (section ``wandb``), from rank 0 alone.

``wandb.mode``: ``online`` (a W&B server), ``offline`` (files under ``<wandb.dir>/wandb/``, no
network; ``wandb sync`` uploads them later) or ``disabled``; null: ``$WANDB_MODE``, else online.
The run id is kept in ``<run_dir>/wandb_run_id.txt``: a resumed run opens the same id
(``resume="allow"``), so its history continues at the resumed iteration + 1. Metrics per log
interval go to the history at their iteration (W&B's ``step``); a published GLOBAL checkpoint is
logged as a W&B artifact of type ``checkpoint`` holding its metadata (tier, step, path, bytes,
seconds), never its bytes.
wandb is imported only when the section is on.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

from tierstack.config.sections import WandbConfig
from tierstack.observability.run_loggers import numeric_items

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id.txt"


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ImportError("the wandb section is on: pip install wandb (or set wandb=null)") from e
    return wandb


def _mode(cfg: WandbConfig) -> str:
    """``wandb.mode``, else ``$WANDB_MODE``, else online."""
    return cfg.mode or os.environ.get("WANDB_MODE") or "online"


def _settings(wandb):
    """No console capture, no system metrics; the run file flushed every second (wandb's default,
    15 s, lost the whole history of a short run killed without warning)."""
    fields = {"console": "off", "x_disable_stats": True, "x_transaction_log_flush_interval": 1.0}
    known = getattr(wandb.Settings, "model_fields", fields)  # pydantic settings (wandb >= 0.19)
    return wandb.Settings(**{k: v for k, v in fields.items() if k in known})


class WandbLogger:
    """Rank-0 W&B run of one training run family (every method a no-op on other ranks).

    Args:
        cfg: the ``wandb`` section.
        run_dir: the run directory (run id file; wandb's files unless ``wandb.dir`` is set).
        rank: global rank; only rank 0 talks to W&B.
        resume_step: the iteration this run starts from (0: fresh, a new W&B run id).
        config: the run config as nested dicts (W&B's run config).

    Raises:
        ImportError: wandb is not installed (names the package).
    """

    def __init__(self, cfg: WandbConfig, run_dir: str | os.PathLike, rank: int, resume_step: int = 0,
                 config: Optional[Mapping[str, Any]] = None) -> None:
        self.enabled = rank == 0 and _mode(cfg) != "disabled"
        self._run = None
        self.run_id: Optional[str] = None
        if not self.enabled:
            return
        wandb = _import_wandb()
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume_step > 0 and id_file.is_file() else None
        os.environ.setdefault("WANDB_SILENT", "true")
        _drop_an_inherited_service()
        kwargs = dict(project=cfg.project, entity=cfg.entity, name=cfg.run_name, tags=list(cfg.tags),
                      mode=_mode(cfg), dir=str(cfg.dir or run_dir), id=run_id or uuid.uuid4().hex[:12],
                      resume="allow", config=dict(config or {}), settings=_settings(wandb))
        self._run = _init_waiting_for_a_killed_holder(wandb, kwargs)
        if self._run is None:
            return
        self.run_id = self._run.id
        tmp = id_file.with_suffix(".tmp")
        tmp.write_text(self.run_id + "\n")
        os.replace(tmp, id_file)
        log.info("wandb: %s run %s (%s)", "continuing" if run_id else "new", self.run_id, _mode(cfg))

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Finite numeric metrics at W&B step ``step`` (the iteration)."""
        if self._run is not None:
            self._run.log(dict(numeric_items(metrics)), step=int(step))

    def log_checkpoint(self, event: Any) -> bool:
        """A published GLOBAL save as an artifact ``checkpoint-iter_<step>`` holding its metadata only."""
        if self._run is None or str(getattr(event.tier, "name", event.tier)).upper() != "GLOBAL":
            return False
        wandb = _import_wandb()
        metadata = {"tier": "GLOBAL", "step": int(event.step), "path": str(event.path),
                    "bytes": int(event.bytes), "seconds": float(event.seconds)}
        artifact = wandb.Artifact(f"checkpoint-iter_{int(event.step):07d}", type="checkpoint", metadata=metadata)
        artifact.add_reference(Path(event.path).resolve().as_uri(), checksum=False)  # a pointer, not the bytes
        self._run.log_artifact(artifact)
        return True

    def set_tag(self, key: str, value: Any) -> None:
        """A summary field ``<key>`` (W&B tags are labels, not key/value)."""
        if self._run is not None:
            self._run.summary[key] = str(value)

    def log_artifact(self, path: str | os.PathLike, artifact_path: Optional[str] = None) -> None:
        """A small file of the run (the loss curve) saved with the run."""
        if self._run is not None:
            self._run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def finish(self, status: str = "FINISHED") -> None:
        """Finish the W&B run (exit code 0 when FINISHED, 1 otherwise); idempotent."""
        if self._run is None:
            return
        run, self._run = self._run, None
        run.finish(exit_code=0 if status == "FINISHED" else 1)


def _drop_an_inherited_service() -> bool:
    """Forget a W&B service this process inherited (``$WANDB_SERVICE`` set by the process that
    launched the job, e.g. a driver script or a test process that called ``wandb.init`` and then
    ran torchrun), so that ``wandb.init`` starts a service owned by this rank.

    Why: a shared service outlives a SIGKILLed rank 0 and keeps its run id registered ("run ID ...
    is in use"), so every resume from the same driver would log without W&B. A service started by
    this rank is given its PID (``wandb-core --pid``) and exits with it, freeing the id. The token's
    format, ``<version>-<pid of the process that started the service>-unix-<socket>`` (or
    ``-tcp-localhost-<port>``), is wandb's (``wandb/sdk/lib/service/service_token.py``); a token
    this very process set (a second logger in one process) is kept.

    Returns:
        True when a token was dropped.
    """
    token = os.environ.get("WANDB_SERVICE", "")
    parts = token.split("-", 2)
    if len(parts) < 3 or parts[1] == str(os.getpid()):
        return False
    del os.environ["WANDB_SERVICE"]
    log.info("wandb: not using the W&B service inherited from process %s; this rank starts its own", parts[1])
    return True


IN_USE_WAIT_S = 60.0  # how long a resume waits for a killed rank's W&B service to let go of the run


def _init_waiting_for_a_killed_holder(wandb, kwargs: dict):
    """``wandb.init(**kwargs)``; while W&B says the run id "is in use" (another live client of the
    same W&B service has it open: since :func:`_drop_an_inherited_service` that is only a process
    of this job that shares this rank's own service), try again with backoff for up to
    :data:`IN_USE_WAIT_S` seconds (tenacity). Still held after that: say so once, naming the run id,
    and go on without W&B (the other loggers and training are unaffected); None then.

    Raises:
        Any other error of ``wandb.init``.
    """
    import tenacity

    def in_use(e: BaseException) -> bool:
        return "is in use" in str(e)

    try:
        for attempt in tenacity.Retrying(retry=tenacity.retry_if_exception(in_use), reraise=True,
                                         stop=tenacity.stop_after_delay(IN_USE_WAIT_S),
                                         wait=tenacity.wait_exponential(multiplier=0.5, max=5.0)):
            with attempt:
                return wandb.init(**kwargs)
    except Exception as e:  # noqa: BLE001 - only "in use" reaches here (reraise after the wait)
        if not in_use(e):
            raise
        log.error("wandb: run %s is still held by another process after %.0f s (%s); this launch logs "
                  "without W&B (TensorBoard, mlflow and metrics.jsonl go on)", kwargs["id"], IN_USE_WAIT_S, e)
        return None
