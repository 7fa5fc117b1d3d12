"""``tierstack pretrain --nproc-per-node N``: start the ranks with torchrun's own launcher, and say in
one line per event what happened to them.

torchrun's agent logs two lines per failure ("Sending process N closing signal SIGTERM", "failed
(exitcode: -9) local_rank: 1 (pid: N) of binary: ...") and ends a failed job with its
``ChildFailedError`` report (about 20 lines, with no traceback unless the rank wrote one). Here the
first becomes one line naming the rank, its signal or exit status, and what the job does next
(restart n of N, or stop); a refusal of bad input (exit status 2, said by rank 0) gets no line
after it; a job that stops gets one line per failed rank instead of the report.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional, Sequence

TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # what torchrun forwards to the ranks by default
BAD_INPUT_STATUS = 2  # a rank's exit status after a refusal of bad input (recipes.runner)
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def exit_text(exitcode: int) -> str:
    """``"was killed by SIGKILL"`` for -9 (a signal, as Popen reports it), ``"exited with status 1"``."""
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class _FailureLines(logging.Filter):
    """On torchrun's multiprocessing logger: drops its SIGTERM notices and turns each "failed"
    record into one line of ours (its arguments: exit code, local rank, pid, program). On one
    machine (``--standalone``) the local rank is the global rank."""

    def __init__(self, max_restarts: int) -> None:
        super().__init__()
        self.max_restarts = max_restarts
        self.failures = 0

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("Sending process") and "closing signal" in msg:
            return False  # the agent stopping the other ranks: part of the line below
        if not (msg.startswith("failed (exitcode") and isinstance(record.args, tuple) and len(record.args) >= 3):
            return True
        exitcode, local_rank, pid = (int(a) for a in record.args[:3])
        self.failures += 1
        if exitcode == BAD_INPUT_STATUS and self.failures > self.max_restarts:
            return False  # a refusal, printed by rank 0: it stays the last thing printed
        if self.failures <= self.max_restarts:
            nxt = (f"restart {self.failures} of {self.max_restarts}: every rank starts again and resumes from the "
                   "newest checkpoint")
        elif self.max_restarts:
            nxt = f"no restart left (--max-restarts={self.max_restarts}): the job stops"
        else:
            nxt = "the job stops (no --max-restarts)"
        print(f"tierstack: rank {local_rank} (pid {pid}) {exit_text(exitcode)}; {nxt}", file=sys.stderr, flush=True)
        return False


def _failed_ranks(exc) -> str:
    """One line per failed rank of a ``ChildFailedError``, the first failure first."""
    first, _ = exc.get_first_failure()
    order = [first] + sorted(r for r in exc.failures if r != first)
    return "\n".join(f"tierstack: rank {r} {exit_text(exc.failures[r].exitcode)}" + (" (first)" if r == first else "")
                     for r in order)


def launch(command: Sequence[str], *, nproc_per_node: int, max_restarts: int = 0,
           shutdown_grace_s: Optional[int] = None, exit_signal: Optional[str] = None) -> int:
    """Start ``nproc_per_node`` ranks of ``command`` on this machine with torchrun's own launcher.

    The rendezvous is torchrun's ``--standalone`` one (a c10d store on a port the OS picks at bind
    time). ``OMP_NUM_THREADS`` defaults to 1, the value torchrun itself sets for several ranks per
    node (so the numbers are the same as a plain torchrun launch; set it to change that).

    Args:
        command: the program and its arguments, as after ``torchrun [options]`` (``["-m",
            "tierstack.cli", "pretrain", "gpt_tiny", ...]`` or ``["recipes/gpt_tiny.py", ...]``).
        nproc_per_node: ranks to start.
        max_restarts: torchrun's ``--max-restarts``: after a rank fails, torchrun stops the others
            and starts all of them again, up to this many times (the job-wide count is kept in
            ``<logger.run_dir>/restarts.json``). The ranks' process groups keep to keys of their own
            start in torchrun's shared store (:mod:`tierstack.runtime.attempt_store`), so no
            restarted rank reads a peer's address from before the restart.
        shutdown_grace_s: how long torchrun waits for the ranks after forwarding a stop signal
            before it SIGKILLs them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, torchrun's default 30 s,
            unless set): what a planned exit's checkpoint needs
            (:func:`~tierstack.resiliency.signals.planned_exit_grace_s`).
        exit_signal: a signal (``"SIGUSR1"``) torchrun forwards to the ranks besides its own
            (SIGTERM, SIGINT, SIGHUP, SIGQUIT): the early warning that asks for a planned exit.

    Returns:
        0 when every rank succeeded; else the first failed rank's exit status (1 for a signal),
        after one line saying which rank failed first and how (none after a refusal of bad
        input: rank 0 printed it, and it stays the last line);
        ``128 + N`` when this launcher itself received signal N (SIGTERM from a scheduler,
        Ctrl-C): torchrun has then stopped the ranks, each of which turned the signal into a
        planned exit (the shell's convention for a signal).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)  # its rendezvous INFO lines
    lines = _FailureLines(max_restarts)
    logging.getLogger(_AGENT_LOGGER).addFilter(lines)
    if shutdown_grace_s is not None:  # torchrun's 30 s would SIGKILL a planned exit's save
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(shutdown_grace_s)))
    forwarded = ["--signals-to-handle", f"{TORCHRUN_SIGNALS},{exit_signal}"] if exit_signal else []
    args = parse_args(["--standalone", "--nproc-per-node", str(nproc_per_node),
                       "--max-restarts", str(max_restarts), *forwarded, *command])
    try:
        torchrun(args)
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        # said already: the job's last failure (by the filter), or a refusal (by rank 0, as the last line)
        if lines.failures <= max_restarts and failure.exitcode != BAD_INPUT_STATUS:
            print(_failed_ranks(exc), file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:
        signum = int(exc.sigval)
        print(f"tierstack: the launcher received {signal.Signals(signum).name}; torchrun stopped the ranks "
              f"(exit status {128 + signum})", file=sys.stderr)
        return 128 + signum
    finally:
        logging.getLogger(_AGENT_LOGGER).removeFilter(lines)
    return 0
