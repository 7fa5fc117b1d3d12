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
