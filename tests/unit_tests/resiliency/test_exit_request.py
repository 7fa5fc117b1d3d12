"""ExitRequest with real signals sent to this process: SIGHUP (the launcher gone) is counted once
however often it comes; SIGTERM escalates as documented."""

import os
import signal

from tierstack.resiliency.signals import ExitRequest


def test_repeated_sighup_is_one_request_and_never_kills():
    """A dying multi-threaded launcher delivers the parent-death signal once per exiting thread."""
    req = ExitRequest()
    try:
        for _ in range(4):
            os.kill(os.getpid(), signal.SIGHUP)
        assert req.reason == "SIGHUP (the launcher is gone)"
        assert signal.getsignal(signal.SIGHUP) == req._handle  # still ours: a fifth would not kill either
    finally:
        req.restore()


def test_a_second_sigterm_hands_back_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    req = ExitRequest()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert req.reason == "SIGTERM" and signal.getsignal(signal.SIGTERM) == req._handle
        os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is not req._handle  # the third goes to the previous one
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        req.restore()
        signal.signal(signal.SIGTERM, previous)


def test_the_early_warning_signal_asks_for_the_planned_exit_once():
    req = ExitRequest(early_warning="SIGUSR1")
    try:
        for _ in range(3):  # a scheduler may send it more than once; it never kills
            os.kill(os.getpid(), signal.SIGUSR1)
        assert req.reason == "SIGUSR1 (train.exit_signal)"
        assert signal.getsignal(signal.SIGUSR1) == req._handle
    finally:
        req.restore()
    assert signal.getsignal(signal.SIGUSR1) is not req._handle


def test_without_an_early_warning_sigusr1_is_left_alone():
    before = signal.getsignal(signal.SIGUSR1)
    req = ExitRequest()
    try:
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        req.restore()


def test_the_launchers_grace_covers_the_planned_exits_bounded_waits():
    from tierstack.config import ConfigContainer
    from tierstack.resiliency.signals import planned_exit_grace_s

    cfg = ConfigContainer()
    cfg.apply_overrides(["checkpoint.async_write_timeout_s=100", "distributed.timeout_s=50"])
    assert planned_exit_grace_s(cfg) == 250 > 30  # torchrun's default would SIGKILL the final save


def test_an_exit_signal_that_cannot_be_used_is_refused_naming_the_field():
    import pytest

    from tierstack.config import ConfigContainer, ConfigError

    cfg = ConfigContainer()
    cfg.apply_overrides(["train.exit_signal=SIGKILL"])
    with pytest.raises(ConfigError, match=r"train.exit_signal='SIGKILL': use one of \['SIGALRM', 'SIGUSR1'"):
        cfg.validate(1, check_paths=False)


def test_after_a_failed_run_sigterm_is_held_and_the_next_request_takes_it(monkeypatch):
    """A failed run's handlers are put back with SIGTERM held: torchrun's agent stops the survivors
    of a dead peer at the instant they unwind, and the default action killed a survivor before its
    one line said why it stops (CI, test_pretrain_max_restarts)."""
    from tierstack.resiliency import signals as signals_mod

    monkeypatch.setattr(signals_mod, "_held", [])
    previous = signal.getsignal(signal.SIGTERM)
    req = ExitRequest()
    try:
        req.restore(RuntimeError("a peer is gone"))
        os.kill(os.getpid(), signal.SIGTERM)  # held: this process is still here
        assert signals_mod.held_stop_signal() == "SIGTERM"
        again = ExitRequest()  # the next attempt (in-process restart) is asked to stop too
        assert again.reason == "SIGTERM"
        again.restore()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_after_a_finished_run_the_previous_sigterm_handler_is_back(monkeypatch):
    from tierstack.resiliency import signals as signals_mod

    monkeypatch.setattr(signals_mod, "_held", [])
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        ExitRequest().restore(None)
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM] and signals_mod.held_stop_signal() is None
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_survivor_whose_stop_signal_came_while_it_unwound_leaves_at_once(tmp_path):
    """rank_exit waits for torchrun's SIGTERM before a survivor exits; one that came already (held)
    ends the wait at once, with the survivor's status."""
    import subprocess
    import sys

    script = (
        "import os, signal\n"
        "from tierstack.recipes import rank_exit\n"
        "from tierstack.resiliency.signals import ExitRequest\n"
        "rank_exit.PEER_LOSS_GRACE_S = 600.0\n"
        "ExitRequest().restore(RuntimeError('peer gone'))\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "rank_exit.leave_after_peer_loss()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TORCHELASTIC_RUN_ID": "t"},
                          timeout=120, capture_output=True, text=True)
    from tierstack.recipes.rank_exit import PEER_LOSS_STATUS

    assert proc.returncode == PEER_LOSS_STATUS, proc.stderr
