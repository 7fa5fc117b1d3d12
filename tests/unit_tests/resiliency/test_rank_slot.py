"""The rank slot (``resiliency/rank_slot.py``) in a real forked process: a rank that dies after the
launcher's SIGTERM ends its slot at once (torchrun sends SIGTERM once and SIGKILLs 30 s later);
a rank that dies on its own leaves the slot waiting for the job to finish, unless every rank
process of the job is gone (then no one is left to finish it: the slot exits with an error), or
the rank died before NVRx's initial barrier (no spare can take its place there)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SLOT = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from tierstack.resiliency import rank_slot
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the job's store
    def rank():
        own = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
        if os.environ.get("STARTED") == "1":  # what the rank sets once past NVRx's initial barrier
            own.set(rank_slot.started_key(os.environ["RANK"]), "1")
        print("RANK UP", flush=True)
        time.sleep(60)
        return 0
    sys.exit(rank_slot.run_in_slot(rank, store))
""")


def _slot(processes=2, started=True):
    env = {**os.environ, "WORLD_SIZE": str(processes), "RANK": "0",  # torchrun's: the job's processes, spares included
           "STARTED": "1" if started else "0"}
    proc = subprocess.Popen([sys.executable, "-c", SLOT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "RANK UP"
    return proc


def test_a_rank_that_dies_after_the_launchers_sigterm_ends_its_slot_at_once():
    proc = _slot()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # what torchrun's agent does to every worker when it stops the job
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert time.monotonic() - t0 < 10
    assert "after the launcher's SIGTERM; the slot stops too" in out, out


def test_a_rank_that_dies_on_its_own_leaves_the_slot_waiting_for_the_job():
    proc = _slot()
    child = int(subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[0])
    os.kill(child, signal.SIGKILL)  # a dead rank: a spare takes its place, the slot waits for the job's end
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=3)
    proc.kill()
    proc.communicate()


def test_when_every_rank_process_of_the_job_is_gone_the_slot_exits_with_an_error():
    """A job of 1 process whose rank died: nothing can finish it or say so, so the slot does not
    wait for ever (the launcher then ends the job, or restarts it)."""
    proc = _slot(processes=1)
    child = int(subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[0])
    os.kill(child, signal.SIGKILL)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 1, out
    assert "every one of the job's 1 rank processes is gone (spares included) and the job did not finish" in out, out


def test_a_rank_that_dies_before_nvrxs_initial_barrier_ends_its_slot_with_an_error():
    """NVRx's initial barrier waits for every rank, and no spare can take a place there: the other
    ranks would wait for its timeout (over 3 minutes, seen in a break-it pass). The slot exits 1
    at once, so the launcher ends the job or restarts it."""
    proc = _slot(started=False)
    child = int(subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[0])
    os.kill(child, signal.SIGKILL)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 1, out
    assert "during the job's start (before NVRx's initial barrier, where no spare can take its place)" in out, out
