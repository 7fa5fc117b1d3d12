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


AGENT = textwrap.dedent("""
    import subprocess, sys, time
    slot = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)  # as torchrun does
    print(slot.pid, flush=True)
    time.sleep(120)
""")


def test_a_launcher_killed_with_sigkill_takes_the_ranks_with_it():
    """The slots run in sessions of their own: a launcher killed with SIGKILL (``kill -9``,
    ``timeout -s KILL``) used to leave them and their ranks training on alone, writing into the
    run's directories while a relaunch began there, then blocked at the end on the store it
    hosted (a break-it pass). Now the slot sees its parent gone, kills its rank and exits."""
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "STARTED": "1"}
    agent = subprocess.Popen([sys.executable, "-c", AGENT, SLOT], stdout=subprocess.PIPE, text=True, env=env)
    slot = int(agent.stdout.readline())
    # the rank's own line: the slot is past its imports (torch's runs ``ldconfig -p`` as a child of
    # the slot, which a look for the slot's children alone could take for the rank, and the launcher
    # was then killed before the slot had looked at its parent)
    assert agent.stdout.readline().strip() == "RANK UP"
    kids = subprocess.run(["pgrep", "-P", str(slot)], capture_output=True, text=True).stdout.split()
    assert len(kids) == 1, kids
    rank = int(kids[0])
    agent.kill()
    agent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_alive(rank) or _alive(slot)):
        time.sleep(0.1)
    alive = [p for p in (rank, slot) if _alive(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"still running 10 s after the launcher was killed: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or while it was read
        return False
