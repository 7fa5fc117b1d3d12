"""A rank slot: the torchrun worker process forks the real rank and outlives it.

Why. torchrun's agent watches its worker processes; when one exits with an error (a SIGKILLed
rank, or one the in-process restart's monitor killed because it hung), the agent stops every other
worker of the node and, with ``--max-restarts``, starts them all again: the healthy ranks lose
their processes, which is what in-process restart is there to avoid. So the torchrun worker is
only a slot: it forks the rank (imports are done before the fork, so the child starts warm) and
waits for it. A child that ends normally ends the slot with its status. A child that dies by a
signal, or exits with :data:`DISCARDED` (the in-process restart took it out of the job), leaves the slot waiting, quietly, until the job is over (another rank, a warm spare, has
taken its place), and the slot then exits 0; when the job fails instead, torchrun stops the slot
together with the others. A rank that dies after the slot passed it the launcher's SIGTERM or
SIGINT (torchrun stopping the job) ends the slot at once: torchrun sends that signal once, and
would wait its 30 s before a SIGKILL.

"The job is over" is the key :data:`DONE_KEY` in the job's store, set by every rank whose wrapped
training returned (:func:`mark_done`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

DONE_KEY = "job/done"
GONE_KEY = "job/gone"  # how many rank processes of the job died or were discarded (their slots wait)
DISCARDED = 75  # a rank's exit status meaning "taken out of the job, which goes on": its slot waits
_POLL_S = 0.2  # how often an orphaned slot looks for the end of the job (and for its agent)
_AGENT_POLL_S = 0.1  # how often a slot whose rank lives looks for the rank's end and for its agent


def run_in_slot(rank_main: Callable[[], int], store: dist.Store) -> int:
    """Fork; the child runs ``rank_main()`` and exits with its status; the parent waits for it.

    Args:
        rank_main: the rank's whole life (it returns an exit status: 0 on success).
        store: the job's store (a client of the launcher's store, or one this process hosts);
            the child inherits it, and the parent polls it for :data:`DONE_KEY` once its child died.

    Returns:
        In the parent: the exit status for the slot (the child's own, 0 after a child that died
        by a signal once the job finished). Never returns in the child.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    agent = os.getppid()  # the launcher's process (torchrun's agent)
    pid = os.fork()
    if pid == 0:  # the rank
        code = 1
        try:
            code = int(rank_main() or 0)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - printed; the slot reports the status
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    # the slot: forward torchrun's stop signals to the rank, then wait for it
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _f, child=pid: _forward(child, s))
    status = _wait_for_rank(pid, agent)
    if status is None:
        return 1
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) != DISCARDED:
        return os.WEXITSTATUS(status)
    how = "was discarded" if os.WIFEXITED(status) else f"died by {signal.Signals(os.WTERMSIG(status)).name}"
    if _forwarded:  # torchrun is stopping the job (it sends its SIGTERM once): no DONE_KEY will come
        log.warning("rank slot %s: its rank (pid %d) %s after the launcher's %s; the slot stops too",
                    os.environ.get("RANK", "?"), pid, how, signal.Signals(_forwarded[0]).name)
        return 128 + _forwarded[0]
    rank = os.environ.get("RANK", "0")
    if not _started(store, rank):  # NVRx's initial barrier waits for every rank: nothing would replace it
        log.error("rank slot %s: its rank (pid %d) %s during the job's start (before NVRx's initial barrier, "
                  "where no spare can take its place); the slot exits with an error, so that the launcher "
                  "ends or restarts the job", rank, pid, how)
        return 1
    log.warning("rank slot %s: its rank (pid %d) %s; waiting for the job to finish without it", rank, pid, how)
    return wait_for_job(store)


_forwarded: list[int] = []  # the stop signals this slot passed to its rank


def _wait_for_rank(pid: int, agent: int) -> Optional[int]:
    """The rank's wait status once it ended; None when the launcher (``agent``, this slot's parent)
    died first: the rank is then SIGKILLed. Why: the slots and ranks run in sessions of their own, so
    a SIGKILLed launcher (``kill -9``, ``timeout -s KILL``) left them training on alone, writing into
    the run's directories while a relaunch started there, and then blocked at the end on the store
    it hosted (a break-it pass). Polled every :data:`_AGENT_POLL_S` seconds (a blocking ``waitpid``
    cannot also watch the parent)."""
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return status
        if os.getppid() != agent:
            log.error("rank slot %s: the launcher (pid %d) is gone, so nothing can stop, restart or finish this "
                      "job: its rank (pid %d) is killed; what it saved stays for a relaunch", os.environ.get("RANK", "?"),
                      agent, pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return None
        time.sleep(_AGENT_POLL_S)


def started_key(rank: str) -> str:
    """Set by the rank of torchrun's rank ``rank`` once it is past NVRx's initial barrier (from then
    on, NVRx's monitor process reports its death and a spare takes its place)."""
    return f"job/started/{rank}"


def _started(store: dist.Store, rank: str) -> bool:
    try:
        return store.check([started_key(rank)])
    except Exception:  # noqa: BLE001 - the store's host is gone: the job is over anyway
        return True


def _forward(child: int, signum: int) -> None:
    _forwarded.append(signum)
    try:
        os.kill(child, signum)
    except ProcessLookupError:  # the rank is gone: the slot stops too
        os._exit(128 + signum)


def wait_for_job(store: dist.Store, parent: Optional[int] = None, processes: Optional[int] = None) -> int:
    """Count this slot's rank as gone (:data:`GONE_KEY`), then block until :data:`DONE_KEY` is set
    in ``store`` (returns 0), this process's parent (the torchrun agent) is gone, or every one of
    the job's ``processes`` rank processes (default: torchrun's ``WORLD_SIZE``, spares included)
    is gone (returns 1, so that the launcher ends the job or restarts it: no process is left to
    finish it, nor to say so). A store whose host is gone also returns 1."""
    parent = os.getppid() if parent is None else parent
    processes = int(os.environ.get("WORLD_SIZE", "1")) if processes is None else processes
    try:
        store.add(GONE_KEY, 1)
    except Exception:  # noqa: BLE001 - the store's host is gone: the job is over, and not by us
        return 1
    while True:
        try:
            store.wait([DONE_KEY], timedelta(seconds=_POLL_S))
            return 0
        except dist.DistStoreError:
            pass
        except Exception:  # noqa: BLE001 - the store's host is gone: the job is over, and not by us
            return 1
        if os.getppid() != parent:
            return 1
        try:
            gone = store.add(GONE_KEY, 0)
        except Exception:  # noqa: BLE001 - as above
            return 1
        if gone >= processes:
            log.error("rank slot %s: every one of the job's %d rank processes is gone (spares included) and "
                      "the job did not finish: the slot exits with an error", os.environ.get("RANK", "?"), gone)
            return 1
        time.sleep(0.01)


def mark_done(store: dist.Store) -> None:
    """Say in ``store`` that the job finished (every rank that returned from training calls it)."""
    store.set(DONE_KEY, "1")
