"""A failed rank ends right after its traceback (:mod:`tierstack.resiliency.fast_exit`): a real
interpreter, whose atexit handlers and teardown are skipped."""

import subprocess
import sys
import textwrap

from tierstack.resiliency.restarts import launcher_restarts_left

PROGRAM = textwrap.dedent("""
    import atexit, multiprocessing, sys, time
    from tierstack.resiliency.fast_exit import exit_after_traceback
    if __name__ == "__main__":
        atexit.register(lambda: print("ATEXIT RAN", flush=True))
        child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
        child.start()
        print(f"CHILD {child.pid}", flush=True)
        exit_after_traceback()
        exit_after_traceback()  # once is enough: the traceback is printed once
        if sys.argv[1] == "caught":
            try:
                raise ValueError("caught by the caller")
            except ValueError:
                pass
            child.terminate()
            print("GOES ON", flush=True)
        else:
            raise RuntimeError("Connection reset by peer")
""")


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120)


def test_an_uncaught_error_prints_its_traceback_once_and_ends_with_status_1_without_the_teardown():
    proc = _run("raise")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1
    assert "RuntimeError: Connection reset by peer" in proc.stderr
    assert "ATEXIT RAN" not in proc.stdout  # the interpreter's teardown was skipped
    pid = int(proc.stdout.split("CHILD ")[1].split()[0])
    assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0  # the child was stopped


def test_an_error_the_caller_catches_changes_nothing():
    proc = _run("caught")
    assert proc.returncode == 0, proc.stderr
    assert "GOES ON" in proc.stdout and "ATEXIT RAN" in proc.stdout and "Traceback" not in proc.stderr


def test_restarts_left_is_what_this_agent_still_restarts(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert launcher_restarts_left() == 0  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert launcher_restarts_left() == 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert launcher_restarts_left() == 0
