"""How a rank under torchrun ends when it cannot go on: after a refusal, or after losing a peer.

What torchrun prints, and when (torch.distributed.elastic, torch 2.x): its agent polls the ranks;
the first rank that exits non-zero makes it SIGTERM the others ("Sending process N closing signal
SIGTERM"), wait for them, log "failed (exitcode: E) local_rank: R", and then either restart every
rank (``--max-restarts``) or raise ``ChildFailedError``, whose report (``FAILED``, ``Failures:``,
``Root Cause (first observed failure):``) is the last thing a plain torchrun prints. The root cause
is the failure with the earliest timestamp, and its ``traceback :`` entry is what the rank wrote to
its ``TORCHELASTIC_ERROR_FILE`` (else a link to torch's docs). So a rank that refuses bad input
writes its refusal there: torchrun's report then ends with the refusal itself. (Under ``tierstack
pretrain --nproc-per-node N`` the launcher prints no report after a refusal: :mod:`.launch`.)

A rank whose peer is gone waits for the agent's SIGTERM before it exits, so that torchrun names
the rank that died, not the survivor, as the first failure.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from typing import Optional

from tierstack.resiliency import fast_exit
from tierstack.resiliency.signals import held_stop_signal

log = logging.getLogger("tierstack")

REFUSAL_GRACE_S = 30.0  # how long a rank other than 0 waits for rank 0 to print a config error
# how long a rank whose peer is gone waits before it exits: torchrun's agent sees a dead rank within
# its --monitor-interval (0.1 s by default); its SIGTERM may have come already (while the rank unwound)
PEER_LOSS_GRACE_S = 3.0
PEER_LOSS_STATUS = 1  # a survivor's exit status: it failed, and not on bad input (that is 2)


def write_torchrun_error_file(message: str) -> None:
    """Under torchrun, record ``message`` as this rank's error (``TORCHELASTIC_ERROR_FILE``, in the
    format of torch's ``ErrorHandler``), so that torchrun's report of the failed ranks shows it as
    the root cause instead of a link. Nothing outside torchrun; a file that cannot be written is
    skipped (the message was printed already)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        pass


def leave_after_rank_0(status: int) -> None:
    """End a rank other than 0 that refused its input (a config error, or bad input found at setup
    alike on every rank), after rank 0. Never returns.

    Every rank finds the same error, and only rank 0 prints it (and writes it as torchrun's root
    cause, :func:`write_torchrun_error_file`: torchrun names the first rank to end as the root
    cause). torchrun stops the other workers (SIGTERM) as soon as one exits non-zero, so a rank 1 that exited first could kill rank
    0 before it printed (seen on a busy machine: the run ended with no message at all). This rank
    waits instead: SIGTERM from torchrun (rank 0 has exited, message printed) ends it with
    ``status``, and so does the end of :data:`REFUSAL_GRACE_S` seconds (rank 0 on another node,
    whose agent does not stop this node's workers).
    """
    _exit_after(REFUSAL_GRACE_S, status, (signal.SIGTERM, signal.SIGINT))


def _exit_after(grace_s: float, status: int, signals: tuple) -> None:
    """End this process with ``status`` after ``grace_s`` seconds, or at once when one of
    ``signals`` arrives (torchrun's stop of its workers), or came already while the run unwound
    (:func:`~tierstack.resiliency.signals.held_stop_signal`). Never returns."""

    def leave(signum, frame):
        exit_now(status)

    for sig in signals:
        signal.signal(sig, leave)
    if held_stop_signal() is not None:
        exit_now(status)
    time.sleep(grace_s)
    exit_now(status)


exit_now = fast_exit.exit_now  # end now with a status, children stopped, logs flushed (never returns)


def what_torchrun_does_next() -> str:
    """What the job does after this failure, from this rank's agent (``TORCHELASTIC_RESTART_COUNT``,
    ``TORCHELASTIC_MAX_RESTARTS``): ``"restart 1 of 3 follows"`` or ``"no restart left ..."``."""
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if done < most:
        return f"restart {done + 1} of {most} follows"
    return f"no restart left (--max-restarts={most}): the job stops" if most else "the job stops (no --max-restarts)"


def report_peer_loss(rank: int, what: str, log_file: Optional[str]) -> None:
    """The survivor's one console line: which rank stopped, why, what the job does next, where the
    traceback went (the caller logged it to the rank's log file)."""
    where = f"; traceback in {log_file}" if log_file else ""
    cause = "a rank is gone or hung" if what.startswith("timed out") else "another rank is gone"
    line = f"rank {rank} stopped: {cause} ({what.rstrip('.')}); {what_torchrun_does_next()}{where}"
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.error("%s", line)


def leave_after_peer_loss() -> None:
    """End a rank whose peer is gone after :data:`PEER_LOSS_GRACE_S` seconds (at once on torchrun's
    SIGTERM), with :data:`PEER_LOSS_STATUS`. The rank that died first is then the failure torchrun
    reports first; this rank exiting before the agent noticed that death could be taken for it."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _exit_after(PEER_LOSS_GRACE_S, PEER_LOSS_STATUS, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
    exit_now(PEER_LOSS_STATUS)
