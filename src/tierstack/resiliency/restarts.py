"""A job-wide restart count, kept in the run directory.

``torchrun --max-restarts N`` is counted by each agent (one per node) for the failures of its own
workers: a job whose failures land on different nodes restarts up to N times per node, and the
healthy agents restart their workers without counting at all (torch.distributed.elastic restarts
them when another node rejoins the rendezvous). This module counts the starts of the worker group
for the whole job: every start of the ranks under one rendezvous id (``TORCHELASTIC_RUN_ID``, the
``--rdzv-id``) after the first is a restart; ``<run_dir>/restarts.json`` keeps the count and the
history, and a start beyond ``TORCHELASTIC_MAX_RESTARTS`` stops before any work with an error that
says so (the agents may still try to start the ranks again; each such start stops at once).

A new launch is not a restart, even under the same rendezvous id (SLURM's ``$SLURM_JOB_ID`` is the
same for every ``srun`` of an allocation and after a requeue): torchrun gives each rank its agent's
own restart count (``TORCHELASTIC_RESTART_COUNT``), and after a failure the agent whose ranks failed
has counted it, so a start where every rank's count is 0 is a new launch of fresh agents and starts
a new record. Without that variable (another launcher) the rendezvous id alone decides.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

from tierstack.checkpointing import paths
from tierstack.errors import BadInputError
from tierstack.runtime import collectives as _dist

log = logging.getLogger(__name__)

RESTARTS_FILE = "restarts.json"


class RestartLimitError(BadInputError):
    """The job restarted more often than ``--max-restarts`` allows, counted job-wide."""


def record_start(run_dir: Path) -> Optional[dict]:
    """Collective: count this start of the ranks in ``<run_dir>/restarts.json`` (written by rank 0).

    Returns:
        The record ``{"rdzv_id", "restarts", "max_restarts", "starts": [{"unix", "world_size"}]}``
        (the same on every rank; a new launch starts a new one), or None outside torchrun (no
        rendezvous id: nothing to count).

    Raises:
        RestartLimitError: ``restarts`` exceeds torchrun's ``--max-restarts`` (every rank alike).
    """
    rdzv_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if rdzv_id is None:
        return None
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    # every rank's agent has restarted nothing: a new launch (an unknown count never says so)
    new_launch = all(c == "0" for c in _dist.all_gather_object(os.environ.get("TORCHELASTIC_RESTART_COUNT")))
    record = None
    if _dist.rank() == 0:
        path = Path(run_dir) / RESTARTS_FILE
        old = paths.read_json(path)
        same = old is not None and old.get("rdzv_id") == rdzv_id and not new_launch
        starts = (list(old.get("starts", [])) if same else []) + [{"unix": time.time(), "world_size": _dist.world_size()}]
        record = {"rdzv_id": rdzv_id, "restarts": len(starts) - 1, "max_restarts": max_restarts, "starts": starts}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            paths.atomic_write_json(path, record)
        except OSError as e:  # a full run_dir must not stop the training (its checkpoints may be elsewhere)
            log.warning("%s cannot be written (%s): this start is counted for this launch only, so the "
                        "job-wide restart limit is not kept across restarts until it can be written", path, e)
    record = _dist.broadcast_object(record)
    n = record["restarts"]
    if n > max_restarts:
        raise RestartLimitError(
            f"the job has restarted {n} time{'s' if n != 1 else ''}, more than --max-restarts={max_restarts} "
            f"(counted for the whole job since its launch "
            f"in {Path(run_dir) / RESTARTS_FILE}; torchrun counts per node): stopping; look at the first failure")
    if n and _dist.rank() == 0:
        log.warning("restart %d of at most %d (job-wide count in %s)", n, max_restarts, Path(run_dir) / RESTARTS_FILE)
    return record


def launcher_restarts_left() -> int:
    """How many more times this rank's torchrun agent restarts the ranks after a failure:
    ``TORCHELASTIC_MAX_RESTARTS - TORCHELASTIC_RESTART_COUNT`` (each agent counts the failures of
    its own ranks, see the module docstring); 0 outside torchrun."""
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    return max(0, max_restarts - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
